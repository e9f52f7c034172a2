"""How the PPO family's advantages are standardized: a floor under the divisor.

RLlib's GAE (`GeneralAdvantageEstimation`) standardizes each batch's advantages: (A - mean) /
max(1e-4, std). Standardizing is scale-free: once a policy is nearly deterministic and every
episode earns nearly the same return, the advantages are the critic's small errors and a rare
sampled deviation, and dividing by their own small std makes the batch drive an update as large
as any other. Without a KL penalty, single updates then moved such policies far (the learner's
KL estimate against the rollout's log-probs, `mean_kl_loss`, of 0.1 to 5.7 per step) and knocked
runs off a reward they had held for hundreds of iterations (docs/results/plateau.md).

`training.advantage_std_floor` sets that floor, in the reward's units: (A - mean) / max(floor,
std). At RLlib's 1e-4 (the default) the pipeline is RLlib's own and this piece is not installed.
A floor above every batch's std leaves the advantages centred and unscaled, so their size
follows the returns' (1.0 where the advantages stay within about [-1, 1], as with rewards in
[0, 1] and no KL penalty once the critic has learned their scale).
"""
from __future__ import annotations

import numpy as np
import torch
from ray.rllib.connectors.connector_v2 import ConnectorV2
from ray.rllib.core.columns import Columns
from ray.rllib.evaluation.postprocessing import Postprocessing

RLLIB_STD_FLOOR = 1e-4  # the floor RLlib's GAE divides by at least


def standardize(advantages: np.ndarray, loss_mask: np.ndarray, floor: float = RLLIB_STD_FLOOR) -> np.ndarray:
    """Zero mean over the loss steps, divided by max(floor, their std); other rows 0 (they are
    masked out anyway)."""
    live = advantages[loss_mask]
    if live.size == 0:
        return np.zeros_like(advantages)
    out = (advantages - live.mean()) / max(floor, float(live.std()))
    return np.where(loss_mask, out, 0.0).astype(np.float32)


class FloorAdvantageStd(ConnectorV2):
    """Learner connector piece after RLlib's GAE: the advantages again from the value targets and
    the values GAE read (the module's `compute_values`), standardized over the loss steps with the
    divisor at least `floor`. Where the rollouts stored the values (the value head on the policy's
    trunk) and every episode is complete, `compute_values` returns those; otherwise (a separate
    value model, an episode cut short) it runs a second value pass over the batch after GAE's. Over
    the loss steps: a batch with an episode cut short also holds RLlib's artificial bootstrap rows,
    which RLlib's standardization counts and this one leaves out (as the guided estimate does)."""

    def __init__(self, input_observation_space=None, input_action_space=None, *, floor: float, **kwargs):
        super().__init__(input_observation_space, input_action_space, **kwargs)
        self.floor = float(floor)

    def __call__(self, *, rl_module, batch, episodes, **kwargs):
        for module_id, module_batch in batch.items():
            if Postprocessing.VALUE_TARGETS not in module_batch:
                continue
            targets = torch.as_tensor(module_batch[Postprocessing.VALUE_TARGETS]).float()
            with torch.no_grad():
                values = rl_module[module_id].unwrapped().compute_values(module_batch)
            raw = (targets - values.float().to(targets.device)).cpu().numpy()
            mask = module_batch.get(Columns.LOSS_MASK)
            mask = np.ones(len(raw), dtype=bool) if mask is None else torch.as_tensor(mask).cpu().numpy().astype(bool)
            device = module_batch[Postprocessing.ADVANTAGES].device
            module_batch[Postprocessing.ADVANTAGES] = torch.as_tensor(standardize(raw, mask, self.floor), device=device)
        return batch
