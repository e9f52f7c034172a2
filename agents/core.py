"""What every layer above `env/` shares: the batch-column names, the generator-state and the
device helpers. It imports nothing of the project's, so anything may import it.

Layers, one direction (tests/test_layers.py checks every import, lazy ones included):
env/ -> agents.core, models, samplers -> agents.modules, guides -> agents.algorithms ->
the EnvRunner and the config -> the tools (train, evaluate, generate, serve, export, ...).
"""
from __future__ import annotations

import logging
import random

import numpy as np
import torch

# Per-row and per-step batch columns beyond RLlib's `Columns`.
SEQ_ID = "seq_id"  # the row's episode index in a learner batch (whole-sequence minibatches)
# the static update's learner pass, made beforehand: (ids, mask, inverse, column), see
# agents/algorithms/static_update.py and agents/modules/actor_critic.py hidden_at_last_token
PASS_ROWS = "static_pass_rows"
# bool per row an EnvRunner may add: the row's observation is the previous call's same row plus one
# appended token (its KV cache and per-row sampler state carry on); kept on the CPU
ROW_CONTINUES = "row_continues"
SAMPLER_STATE = "sampler_state"  # per-step sampler state (mirostat's mu) used when acting
MASK_SIZE = "mask_size"  # number of kept tokens per row, from the training forward pass
GUIDE_ROLE = "guide_role"  # per-step column: POLICY, GUIDE or DEVIATION

# The window of every per-episode mean an EnvRunner logs (RLlib's metrics_num_episodes_for_smoothing):
# each result's means cover every episode it finished. RLlib's new stack keeps only the last
# `window` (default 100) of each EnvRunner's episodes per result and drops the others (windows do
# not reach back into earlier results), so an iteration of about 270 quickstart episodes reported
# the mean of its last 100.
EPISODES_PER_RESULT = 10_000_000

# State keys beyond RLlib's: an EnvRunner's rollout state (agents/env_runner.py), and in an
# algorithm's checkpoint the remote EnvRunners' and every learner's generators (agents/algorithms/
# base.py RemoteRunnerStates).
ROLLOUT_STATE = "rollout_state"
REMOTE_RUNNERS = "remote_env_runners"
LEARNER_RNGS = "learner_generators"


def state_requested(name: str, components, not_components) -> bool:
    """Whether a get_state(components, not_components) call asks for the top-level key `name`."""
    def names(c):
        return set() if c is None else {c} if isinstance(c, str) else set(c)

    return (components is None or name in names(components)) and name not in names(not_components)


def global_rng_state() -> dict:
    """The process's Python, NumPy and torch (CPU and CUDA) generator states."""
    state = {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_global_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def cpu_copy(x):
    """A tensor's detached CPU copy for a checkpoint (None stays None)."""
    return None if x is None else x.detach().cpu().clone()


def on_device(x, device):
    """A restored tensor on the module's device (None, or no device given: as it is)."""
    return None if x is None or device is None else x.to(device)


class DropLogLines(logging.Filter):
    """A logging filter dropping the records whose message holds `fragment`: a library's notice a
    user of the CLIs can do nothing about (RLlib's deprecation of the config its own RLModules
    are built through; its note that the new API stack is on, which the project always uses)."""

    def __init__(self, fragment: str):
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


def no_transformers_bars() -> None:
    """Turns off transformers' progress bars ("Loading weights", "Writing model shards") in this
    process: a CLI's own lines are its output."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
