"""The EnvRunner for the token env: RLlib's single-agent EnvRunner, with fresh prompts per reset.

With `batch_mode: complete_episodes` RLlib 2.60 resets every vector env at the
start of each `sample()` call and passes the same seed each time
(`SingleAgentEnvRunner._reset_envs`). The env reseeds its prompt draw from it,
so every call would replay the same `num_envs_per_env_runner` prompts and a
policy could learn just those. Here the k-th seeded reset of an EnvRunner uses
`seed + k * SEED_STRIDE`: runs stay reproducible, and each call draws new prompts.
"""
from __future__ import annotations

from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner

SEED_STRIDE = 1_000_003  # far apart from the per-sub-env (+i) and per-EnvRunner (+index) offsets


class TokenEnvRunner(SingleAgentEnvRunner):
    def _try_env_reset(self, *, seed=None, options=None):
        if seed is not None:
            self._seeded_resets = getattr(self, "_seeded_resets", 0)
            seed, self._seeded_resets = seed + self._seeded_resets * SEED_STRIDE, self._seeded_resets + 1
        return super()._try_env_reset(seed=seed, options=options)
