"""The decode engine's CUDA graphs emulated on the CPU, and a count of the ops run outside them.

On a GPU each eager op is a kernel launch (tens of microseconds of host time at the project's
shapes), and a replayed graph is one launch whatever it holds. A machine without a GPU cannot
time that, but it can count it: `emulate_capture()` makes every `DecodeEngine` built afterwards
take its capture path on the CPU (the same warm-up, static inputs copied in, static outputs
overwritten by each replay), and `OpCounter` counts the aten ops dispatched outside those
replays, the ones that would be launches on a GPU.

    with OpCounter() as ops, emulate_capture(ops):
        ...  # rollouts
    print(ops.n, ops.replays)
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from agents.modules.decode_engine import DecodeEngine


class OpCounter(TorchDispatchMode):
    """Counts the aten ops run while it is active and not `paused()`."""

    def __init__(self):
        super().__init__()
        self.n, self.replays, self.paused_depth = 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused_depth:
            self.n += 1
        return func(*args, **(kwargs or {}))

    @contextmanager
    def paused(self):
        self.paused_depth += 1
        try:
            yield
        finally:
            self.paused_depth -= 1


def count_ops(fn) -> int:
    """How many aten ops `fn()` runs eagerly."""
    with OpCounter() as ops:
        fn()
    return ops.n


class _Graph:
    """A captured step on the CPU: `replay()` runs it and writes its outputs into the static ones."""

    def __init__(self, run, out, counter):
        self.run, self.out, self.counter = run, out, counter

    def replay(self):
        with self.counter.paused() if self.counter is not None else nullcontext():
            new = self.run()
            pairs = ((self.out, new),) if torch.is_tensor(new) else ((self.out[k], v) for k, v in new.items())
            for static, value in pairs:
                static.copy_(value)
        if self.counter is not None:
            self.counter.replays += 1


def capture_on_the_cpu(engine: DecodeEngine, counter: OpCounter | None = None) -> None:
    """Puts `engine` on its capture path on the CPU: `_capture` runs the real warm-up, then keeps the
    function as the graph and its outputs, computed with the ring put back as it was (a capture
    computes nothing), as the static outputs."""
    engine.capture = True

    def capture(static_inputs, run, steps=1):
        with counter.paused() if counter is not None else nullcontext():
            engine._warm_up(run, steps=steps)
            state = [t.clone() for t in (engine.kv, engine.real, engine.slot)]
            out = run()
            out = out.clone() if torch.is_tensor(out) else {k: v.clone() for k, v in out.items()}
            for t, saved in zip((engine.kv, engine.real, engine.slot), state):
                t.copy_(saved)
        return _Graph(run, out, counter), static_inputs, out

    engine._capture = capture


def capturing_init(counter: OpCounter | None = None):
    """`DecodeEngine.__init__` followed by `capture_on_the_cpu` (for a test's monkeypatch)."""
    init = DecodeEngine.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        capture_on_the_cpu(self, counter)

    return patched


@contextmanager
def emulate_capture(counter: OpCounter | None = None):
    """Every `DecodeEngine` built inside the block captures on the CPU (`capture_on_the_cpu`)."""
    init = DecodeEngine.__init__
    DecodeEngine.__init__ = capturing_init(counter)
    try:
        yield
    finally:
        DecodeEngine.__init__ = init
