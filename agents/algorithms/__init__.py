"""The algorithms a config can name. Each module below defines `SPEC`, an
`agents.algorithms.base.AlgorithmSpec`; adding an algorithm is writing its module and adding
one line here."""
from __future__ import annotations

import importlib

MODULES = (
    "agents.algorithms.ppo",
    "agents.algorithms.a3c",
    "agents.algorithms.dqn",
    "agents.algorithms.guided",
    "agents.algorithms.reinforce",
)

_SPECS: dict = {}


def specs() -> dict:
    """Algorithm name -> its spec (modules imported on first use: they import RLlib)."""
    if not _SPECS:
        for name in MODULES:
            spec = importlib.import_module(name).SPEC
            for algo in spec.names:
                if algo in _SPECS:
                    raise RuntimeError(f"algorithm {algo!r} is registered by {name} and another module")
                _SPECS[algo] = spec
    return _SPECS
