"""What an EnvRunner's rollouts draw from and where they stand, for seeding and checkpoints.

Everything an EnvRunner draws from derives from the config's `seed` and the EnvRunner's index
(`rollout_seed`); its state (the process's generators, the env's rows, the module's per-row
rollout state and generators; the process generators' helpers are agents/core.py's) goes into the EnvRunner's checkpoints (agents/env_runner.py) and,
for the learner's own draws, into the learner's (agents/algorithms/token_learner.py).
"""
from __future__ import annotations

import copy
from collections import defaultdict

import numpy as np
from ray.rllib.core.rl_module.multi_rl_module import MultiRLModule

from env.vector_env import TokenGenerationVectorEnv


def rollout_seed(seed: int, index: int) -> int:
    """The seed of a module's rollout generators on EnvRunner `index`: its own stream, apart
    from the env rows' (`seed + index * num_envs + row`) and the process's (`seed + index`)."""
    return int(np.random.SeedSequence([int(seed), int(index), 0x6775]).generate_state(1)[0])


def _private_state(obj) -> dict:
    """An env's mutable episode state: its underscore attributes (per-row arrays, the row's
    prompt, generated tokens and generator; the tokenizer, task and data are public)."""
    return {k: copy.deepcopy(v) for k, v in vars(obj).items() if k.startswith("_")}


def env_state(env) -> dict:
    env = env.unwrapped
    state = {"env": _private_state(env)}
    if isinstance(env, TokenGenerationVectorEnv):
        state["rows"] = [_private_state(row) for row in env.rows]
    elif hasattr(env, "envs"):  # gymnasium's SyncVectorEnv
        state["rows"] = [_private_state(e.unwrapped) for e in env.envs]
        # and each row's wrappers' flags (e.g. OrderEnforcing's "has been reset")
        state["wrappers"] = [[_private_state(w) for w in _wrappers(e)] for e in env.envs]
    return state


def _wrappers(env) -> list:
    """The gymnasium wrappers around a row, outermost first (not the row itself)."""
    out = []
    while env is not env.unwrapped:
        out.append(env)
        env = env.env
    return out


def set_env_state(env, state: dict) -> None:
    env = env.unwrapped
    rows = env.rows if isinstance(env, TokenGenerationVectorEnv) else [e.unwrapped for e in getattr(env, "envs", [])]
    pairs = [(env, state["env"])] + list(zip(rows, state.get("rows", [])))
    for e, saved in zip(getattr(env, "envs", []), state.get("wrappers", [])):
        pairs += list(zip(_wrappers(e), saved))
    for obj, saved in pairs:
        for k, v in saved.items():
            setattr(obj, k, copy.deepcopy(v))


def _modules(module) -> dict:
    """{module id: module} of a MultiRLModule, {None: module} of a single one, {} of none."""
    if module is None:
        return {}
    return dict(module.items()) if isinstance(module, MultiRLModule) else {None: module}


def _module_rollout_states(module) -> dict:
    return {mid: m.unwrapped().get_rollout_state() for mid, m in _modules(module).items()
            if hasattr(m.unwrapped(), "get_rollout_state")}


def _set_module_rollout_states(module, states: dict) -> None:
    for mid, state in states.items():
        (module if mid is None else module[mid]).unwrapped().set_rollout_state(state)


def _seed_module_rollouts(module, seed: int) -> None:
    for m in _modules(module).values():
        if hasattr(m.unwrapped(), "seed_rollouts"):
            m.unwrapped().seed_rollouts(seed)


SAMPLING = ("needs_reset", "to_module", "shared", "ongoing", "chunks", "done")


def sampling_state(runner) -> dict:
    """Where RLlib's SingleAgentEnvRunner stands between sample() calls (the stock runner): the
    seeded resets so far, the episodes in progress and their earlier chunks (for the episode
    metrics), the next module input and the connectors' shared data, as copies of RLlib's objects
    (SingleAgentEpisode.from_state cannot rebuild one whose extra model outputs it saved as buffers)."""
    return {"seeded_resets": getattr(runner, "_seeded_resets", 0),
            **copy.deepcopy({"needs_reset": runner._needs_initial_reset, "to_module": runner._cached_to_module,
                             "shared": getattr(runner, "_shared_data", None), "ongoing": runner._ongoing_episodes,
                             "chunks": dict(runner._ongoing_episodes_for_metrics),
                             "done": runner._done_episodes_for_metrics})}


def set_sampling_state(runner, state: dict) -> None:
    runner._seeded_resets = state["seeded_resets"]
    saved = copy.deepcopy({k: state[k] for k in SAMPLING})
    runner._needs_initial_reset, runner._cached_to_module = saved["needs_reset"], saved["to_module"]
    if saved["shared"] is not None:
        runner._shared_data = saved["shared"]
    runner._ongoing_episodes, runner._done_episodes_for_metrics = saved["ongoing"], saved["done"]
    runner._ongoing_episodes_for_metrics = defaultdict(list, saved["chunks"])
