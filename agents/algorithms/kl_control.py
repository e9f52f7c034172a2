"""Per-token KL penalty against a frozen reference model (Ziegler et al., 2019).

The task reward is sparse (at the end of a sequence); every token additionally
pays `coef * (log pi(a_t|s_t) - log p_ref(a_t|s_t))`, the sampled-token
estimate of KL(pi || ref). `coef` is fixed, or adapted after every update so
the per-sequence KL tracks `target`:

    err  = clip(KL / target - 1, -0.2, 0.2)
    coef = coef * (1 + err * n_sequences / horizon)
"""
from __future__ import annotations

import torch

from ray.rllib.connectors.connector_v2 import ConnectorV2
from ray.rllib.core.columns import Columns


class AdaptiveKLController:
    def __init__(self, coef: float, target: float | None = None, horizon: int = 10000):
        self.coef = float(coef)
        self.target = target
        self.horizon = horizon

    def update(self, kl_per_sequence: float, n_sequences: int) -> float:
        if self.target:
            err = min(max(kl_per_sequence / self.target - 1.0, -0.2), 0.2)
            self.coef *= 1.0 + err * n_sequences / self.horizon
        return self.coef


class ReferenceKLPenalty(ConnectorV2):
    """Learner connector piece: subtracts the KL penalty from the batch's rewards.

    Runs before GAE so that advantages and value targets see the penalised
    rewards. Records what it measured in `self.last` for the learner to log.
    """

    def __init__(self, input_observation_space=None, input_action_space=None, *, controller: AdaptiveKLController):
        super().__init__(input_observation_space, input_action_space)
        self.controller = controller
        self.last: dict[str, dict] = {}

    def __call__(self, *, rl_module, batch, episodes, **kwargs):
        self.last = {}
        for module_id, module_batch in batch.items():
            module = rl_module[module_id].unwrapped()  # under DDP (several learners) the wrapper hides it
            if not hasattr(module, "reference_logp"):
                continue
            kl = module_batch[Columns.ACTION_LOGP] - module.reference_logp(module_batch)
            if Columns.LOSS_MASK in module_batch:  # the artificial bootstrap step pays nothing
                kl = kl * module_batch[Columns.LOSS_MASK]
            module_batch[Columns.REWARDS] = module_batch[Columns.REWARDS] - self.controller.coef * kl
            n_tokens = (
                module_batch[Columns.LOSS_MASK].sum() if Columns.LOSS_MASK in module_batch else kl.numel()
            )
            n_sequences = max(len(episodes), 1)
            self.last[module_id] = {
                "ref_kl": float(kl.sum()) / n_sequences,
                "ref_kl_per_token": float(kl.sum() / torch.clamp(torch.as_tensor(n_tokens), min=1)),
                "n_sequences": n_sequences,
            }
        return batch
