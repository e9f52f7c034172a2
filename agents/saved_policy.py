"""Where a checkpoint keeps its policy, the precisions a loaded policy decodes in and the seeds it
takes: what the command lines (`agents.serve`, `agents.generate`, `agents.export`, `agents.evaluate`)
check of a `--checkpoint`, `--precision` and `--seed` before anything is loaded. The standard library only, so a wrong path is refused
before torch, RLlib or Ray are imported.
"""
from __future__ import annotations

import os

# Where an Algorithm checkpoint keeps the trained policy: RLlib's component names (COMPONENT_LEARNER_GROUP,
# COMPONENT_LEARNER, COMPONENT_RL_MODULE, DEFAULT_MODULE_ID from ray.rllib.core, whose import loads torch
# and RLlib; tests/test_rllib_contract.py checks the two agree).
MODULE_SUBDIR = os.path.join("learner_group", "learner", "rl_module", "default_policy")
PRECISIONS = ("fp32", "bf16")  # a loaded policy's weights while it decodes (generate, serve)
MAX_SEED = 2**31 - 1  # the largest seed a user gives (generate, evaluate, serve); row i samples from seed + i


def find_module_dir(path: str) -> str:
    path = os.path.abspath(os.path.expanduser(path))
    for candidate in (os.path.join(path, MODULE_SUBDIR), path):
        if os.path.isfile(os.path.join(candidate, "module_state.pt")) or os.path.isfile(
            os.path.join(candidate, "module_state.pkl")
        ):
            return candidate
    inside = checkpoints_under(path)
    if inside:  # an experiment or trial directory: name its newest checkpoint
        more = f" (and {len(inside) - 1} older)" if len(inside) > 1 else ""
        raise RunDirectoryError(f"--checkpoint: {path} is a run directory, not a checkpoint; its newest checkpoint "
                                f"is {inside[-1]}{more}")
    raise FileNotFoundError(f"--checkpoint: {path} holds no policy (looked for {MODULE_SUBDIR})")


class RunDirectoryError(FileNotFoundError):
    """A checkpoint was asked for, and the path is a run (experiment or trial) directory holding some."""


def checkpoints_under(path: str) -> list[str]:
    """The checkpoint directories (holding a policy) under `path`, oldest first."""
    found = set()
    for root, dirs, files in os.walk(path):
        if root.endswith(os.sep + MODULE_SUBDIR) and {"module_state.pt", "module_state.pkl"} & set(files):
            found.add(root[:-len(os.sep + MODULE_SUBDIR)])
            dirs.clear()
    return sorted(found, key=lambda d: (os.path.getmtime(d), d))
