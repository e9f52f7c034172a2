"""benchmarks/static_verify.py: the check of the static update's replays against eager updates
leaves training exactly as it would have been, and finds an update that went wrong."""
import pytest
import torch

from agents.algorithms.static_update import StaticUpdate
from benchmarks.static_verify import ReplayCheck
from tests.test_static_update import _train


def _same_tensors(monkeypatch) -> list:
    """Wraps each check: the parameters and the optimizer state are the same tensors after it (a
    captured CUDA graph holds their addresses); the list gets one True per check that kept them."""
    kept, check = [], ReplayCheck._check

    def pointers(learner, module_id):
        optimizer = learner.get_optimizers_for_module(module_id)[0][1]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return ([p.data_ptr() for p in params],
                [v.data_ptr() for p in params for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v)])

    def checked(self, original, learner, module_id, bucket, inputs):
        before = pointers(learner, module_id)
        out = check(self, original, learner, module_id, bucket, inputs)
        after = pointers(learner, module_id)
        kept.append(before[0] == after[0] and (before[1] == after[1] or not before[1]))  # (no state before the first step)
        return out

    monkeypatch.setattr(ReplayCheck, "_check", checked)
    return kept


def test_checking_every_update_changes_nothing_and_finds_eager_equal_to_eager(ray_local, monkeypatch):
    plain, _, plain_returns = _train(True)
    kept = _same_tensors(monkeypatch)
    right = StaticUpdate._static_run
    check = ReplayCheck(every=1)
    check.install()
    try:
        checked, _, checked_returns = _train(True)
    finally:
        check.remove()
    records = check.take()
    assert StaticUpdate._static_run is right  # the patch is undone
    assert len(kept) == 8 and all(kept)
    assert checked_returns == plain_returns
    for name, p in plain.items():
        assert torch.equal(checked[name], p), name  # the checked update's result is what training goes on from
    assert len(records) == 8  # 2 iterations x 2 epochs x 2 minibatches
    # on the CPU nothing is captured: the "replay" is the eager function, the same to the bit
    assert all(not r["replayed"] and r["apart_over_moved"] == 0.0 and r["loss"] == r["eager_loss"] for r in records)


def test_an_update_that_went_wrong_is_found(ray_local, monkeypatch):
    right = StaticUpdate._static_run

    def wrong(learner, module_id, bucket, inputs):  # the update, then every parameter knocked off
        out = right(learner, module_id, bucket, inputs)
        with torch.no_grad():
            for p in learner.module[module_id].parameters():
                p.add_(torch.randn_like(p) * 1e-2)
        return out

    monkeypatch.setattr(StaticUpdate, "_static_run", wrong)
    torch.manual_seed(0)  # the knocks' draws
    unchecked = _train(True, iterations=1)[0]
    check = ReplayCheck(every=3)
    check.install()
    try:
        torch.manual_seed(0)
        checked = _train(True, iterations=1)[0]
    finally:
        check.remove()
    records = check.take()
    assert len(records) == 1  # the third of 4 updates
    assert records[0]["apart_over_moved"] > 1.0
    for name, p in unchecked.items():  # training went on from the checked update's own (wrong) result
        assert torch.equal(checked[name], p), name


def test_every_must_be_at_least_one():
    with pytest.raises(ValueError, match="at least 1"):
        ReplayCheck(every=0)
