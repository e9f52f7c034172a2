"""The guided algorithms' learner pipeline (agents/algorithms/guided.py): the stored roles become
the loss mask (guide steps neither pay the KL penalty nor count in the loss), policy steps get
GAE and AggreVaTeD's deviation steps the guide-completed return, and advantages are
standardised over the loss steps only.
"""
from __future__ import annotations

import numpy as np
import torch
from ray.rllib.connectors.connector_v2 import ConnectorV2
from ray.rllib.connectors.learner import GeneralAdvantageEstimation
from ray.rllib.core.columns import Columns
from ray.rllib.evaluation.postprocessing import Postprocessing
from ray.rllib.utils.postprocessing.value_predictions import compute_value_targets

from agents.algorithms.advantages import RLLIB_STD_FLOOR, standardize
from agents.core import GUIDE_ROLE
from agents.guides import DEVIATION, GUIDE, POLICY


def guided_loss_mask(loss_mask: torch.Tensor, roles: torch.Tensor) -> torch.Tensor:
    """Loss steps are the policy's own (POLICY, DEVIATION); guide roll-in/roll-out steps are not."""
    return loss_mask & (roles != GUIDE)


def guided_value_targets(values, rewards, terminateds, truncateds, roles, *, gamma: float, lambda_: float):
    """Value targets and raw advantages (targets - values) per row of episodes laid end to end
    (RLlib's layout; an episode cut short ends in RLlib's artificial bootstrap step, a
    terminated one has none: `AddOneTsToUnfinishedEpisodes`)

    POLICY steps get GAE(gamma, lambda). A DEVIATION step's target is its Monte-Carlo return
    (the guide completed the text after it), so its advantage is that return minus V(s_d).
    """
    gae = compute_value_targets(values=values, rewards=rewards, terminateds=terminateds, truncateds=truncateds,
                                gamma=gamma, lambda_=lambda_)
    mc = compute_value_targets(values=values, rewards=rewards, terminateds=terminateds, truncateds=truncateds,
                               gamma=gamma, lambda_=1.0)
    targets = np.where(roles == DEVIATION, mc, gae).astype(np.float32)
    return targets, targets - values


class MaskGuideSteps(ConnectorV2):
    """Learner connector piece: turns the stored roles into the loss mask (before the KL penalty,
    so guide steps pay none)."""

    def __call__(self, *, rl_module, batch, episodes, **kwargs):
        for module_batch in batch.values():
            if GUIDE_ROLE in module_batch and Columns.LOSS_MASK in module_batch:
                module_batch[Columns.LOSS_MASK] = guided_loss_mask(module_batch[Columns.LOSS_MASK],
                                                                   module_batch[GUIDE_ROLE])
        return batch


class GuidedAdvantageEstimation(GeneralAdvantageEstimation):
    """GAE for policy steps, guide-completed returns for AggreVaTeD's deviation steps; advantages
    standardized over the loss steps with the divisor at least `floor` (`training.advantage_std_floor`)."""

    def __init__(self, *args, floor: float = RLLIB_STD_FLOOR, **kwargs):
        super().__init__(*args, **kwargs)
        self.floor = float(floor)

    def __call__(self, *, rl_module, episodes, batch, **kwargs):
        lens = [len(e) for e in self.single_agent_episode_iterator(episodes, agents_that_stepped_only=False)]
        for module_id, module_batch in batch.items():
            module = rl_module[module_id].unwrapped()
            if not hasattr(module, "compute_values"):
                continue
            with torch.no_grad():
                values = module.compute_values(module_batch)
            device = values.device
            values = values.float().cpu().numpy()
            assert values.shape[0] == sum(lens)

            def col(key, fill=0):
                v = module_batch.get(key)
                return np.full(len(values), fill) if v is None else torch.as_tensor(v).cpu().numpy()

            roles = col(GUIDE_ROLE, POLICY)
            targets, raw = guided_value_targets(
                values, col(Columns.REWARDS).astype(np.float32), col(Columns.TERMINATEDS).astype(np.float32),
                col(Columns.TRUNCATEDS).astype(np.float32), roles, gamma=self.gamma, lambda_=self.lambda_)
            loss_mask = col(Columns.LOSS_MASK, True).astype(bool)
            advantages = standardize(raw, loss_mask, self.floor)
            module_batch[Postprocessing.ADVANTAGES] = torch.as_tensor(advantages, device=device)
            module_batch[Postprocessing.VALUE_TARGETS] = torch.as_tensor(targets, device=device)
        return batch
