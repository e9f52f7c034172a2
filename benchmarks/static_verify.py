"""Checks the static update's CUDA graph replays against the same update run eagerly, during a
real run (`peer_trl.py --static-verify-every N`).

Every N-th static update is checked (on a GPU most are replays of captured graphs; each record
says whether it was one):
  1. the learner's parameters and optimizer state are copied;
  2. the update runs as it would (the graph's replay);
  3. its result is copied, the state from (1) put back, and the same inputs are run through the
     static function eagerly (`StaticUpdate._eager`);
  4. the replay's result is put back, so training goes on exactly as it would have.
Each check records how far apart the two updates left the parameters, relative to how far the
eager update moved them (`apart / moved`; index_add_'s atomics make it nonzero on CUDA, a
replay that read memory it should not have gives about 1 or more), and the two losses. On the CPU
nothing is captured and both runs are eager: the ratio is 0.

It patches `StaticUpdate._static_run` (the project's own class) and costs two copies of the
parameters and the optimizer state plus one eager update per check.
"""
from __future__ import annotations

import torch

from agents.algorithms.static_update import StaticUpdate


def _params(learner, module_id) -> tuple[torch.optim.Optimizer, list]:
    optimizer = learner.get_optimizers_for_module(module_id)[0][1]
    return optimizer, [p for group in optimizer.param_groups for p in group["params"]]


@torch.no_grad()
def _copy(tensors: list) -> list:
    return [t.detach().clone() for t in tensors]


@torch.no_grad()
def _put(tensors: list, values: list) -> None:
    for t, v in zip(tensors, values):
        t.copy_(v)


def _copy_state(optimizer, params: list) -> list:
    """Each parameter's optimizer state, copied ({}: none yet)."""
    return [{k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state.get(p, {}).items()} for p in params]


@torch.no_grad()
def _put_state(optimizer, params: list, states: list, live: list) -> None:
    """Puts `states` into the optimizer, in place into the `live` tensors (a captured graph holds
    them) where the state had them; a state that was empty (before the first step) is emptied."""
    for p, state, tensors in zip(params, states, live):
        if not state:
            optimizer.state.pop(p, None)
            continue
        optimizer.state[p] = tensors
        for k, v in state.items():
            if torch.is_tensor(v):
                tensors[k].copy_(v)
            else:
                tensors[k] = v


def _distance(a: list, b: list) -> float:
    return float(torch.sqrt(sum(((x.float() - y.float()) ** 2).sum() for x, y in zip(a, b))))


class ReplayCheck:
    """Installs the check on StaticUpdate (`install`, undone by `remove`); `take()` returns the
    checks made since the last call, each {"replayed", "apart_over_moved", "loss", "eager_loss"}."""

    def __init__(self, every: int):
        if every < 1:
            raise ValueError(f"--static-verify-every must be at least 1 (got {every})")
        self.every, self.candidates, self._records, self._original = every, 0, [], None

    def install(self) -> None:
        original = self._original = StaticUpdate._static_run
        check = self

        def checked(learner, module_id, bucket, inputs):
            check.candidates += 1
            if check.candidates % check.every:
                return original(learner, module_id, bucket, inputs)
            return check._check(original, learner, module_id, bucket, inputs)

        StaticUpdate._static_run = checked

    def remove(self) -> None:
        if self._original is not None:
            StaticUpdate._static_run = self._original
            self._original = None

    def _check(self, original, learner, module_id, bucket, inputs):
        optimizer, params = _params(learner, module_id)
        before, before_state = _copy(params), _copy_state(optimizer, params)
        out, replayed = original(learner, module_id, bucket, inputs)
        live = [optimizer.state.get(p) for p in params]  # the state's own tensors (updated in place)
        mine, mine_state = _copy(params), _copy_state(optimizer, params)
        _put(params, before)
        _put_state(optimizer, params, before_state, live)
        eager_total, _ = learner._eager(module_id, optimizer, inputs)
        theirs = _copy(params)
        _put(params, mine)
        _put_state(optimizer, params, mine_state, live)
        moved = _distance(theirs, before)
        apart = _distance(mine, theirs)
        self._records.append({"replayed": bool(replayed), "apart_over_moved": apart / moved if moved else apart,
                              "loss": float(out[0]), "eager_loss": float(eager_total)})
        return out, replayed

    def take(self) -> list:
        records, self._records = self._records, []
        return records
