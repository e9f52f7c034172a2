"""Gradient clipping and the finite-gradient check in fused ops (agents/algorithms/gradients.py):
the same parameters as RLlib's per-tensor code, with one host read in `apply_gradients` instead
of two per tensor."""
import copy
import math

import pytest
import torch
from ray.rllib.core.learner.torch.torch_learner import TorchLearner
from ray.rllib.utils.torch_utils import clip_gradients as rllib_clip_gradients
from torch.overrides import TorchFunctionMode

from agents.algorithms.gradients import FusedGradients, all_finite, clip_gradients
from agents.config import algorithm_config, load
from tests.conftest import QUICKSTART

HOST_READS = {"__bool__", "__float__", "__int__", "__index__", "item", "tolist", "cpu", "numpy"}


class HostReads(TorchFunctionMode):
    """Counts the tensor-to-host reads (each a device sync on a GPU) made inside it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in HOST_READS
        return func(*args, **(kwargs or {}))


def _grads(seed: int, scale: float) -> dict:
    g = torch.Generator().manual_seed(seed)
    shapes = [(64, 32), (32,), (7, 3, 5), (1,), (128,)]
    return {f"p{i}": torch.randn(s, generator=g) * scale for i, s in enumerate(shapes)}


@pytest.mark.parametrize("scale", [1e-3, 1.0, 50.0])
def test_global_norm_clip_equals_rllibs_exactly(scale):
    ours, theirs = _grads(0, scale), _grads(0, scale)
    norm = clip_gradients(ours, grad_clip=1.0, grad_clip_by="global_norm")
    ref = rllib_clip_gradients(theirs, grad_clip=1.0, grad_clip_by="global_norm")
    assert torch.equal(norm, ref)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    if scale == 50.0:  # it clipped: the clipped gradients' global norm is the clip value
        assert math.isclose(torch.norm(torch.stack([g.norm() for g in ours.values()])).item(), 1.0, rel_tol=1e-5)


def test_non_finite_gradients_clip_as_rllibs_and_fail_the_screen():
    ours, theirs = _grads(1, 1.0), _grads(1, 1.0)
    for grads in (ours, theirs):
        grads["p0"][3, 4] = float("nan")
        grads["p2"][0, 0, 0] = float("inf")
    norm = clip_gradients(ours, grad_clip=0.5, grad_clip_by="global_norm")
    ref = rllib_clip_gradients(theirs, grad_clip=0.5, grad_clip_by="global_norm")
    assert torch.equal(norm, ref)
    assert all(torch.equal(ours[k].nan_to_num(), theirs[k].nan_to_num()) for k in ours)
    assert not all_finite(list(ours.values()))
    assert all_finite(list(_grads(2, 1.0).values())) and all_finite([])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_global_norm_clip_on_cuda_equals_rllibs_up_to_the_norms_summation_order():
    ours = {k: g.cuda() for k, g in _grads(4, 50.0).items()}
    theirs = {k: g.cuda() for k, g in _grads(4, 50.0).items()}
    norm = clip_gradients(ours, grad_clip=1.0, grad_clip_by="global_norm")
    ref = rllib_clip_gradients(theirs, grad_clip=1.0, grad_clip_by="global_norm")
    torch.testing.assert_close(norm, ref, rtol=1e-5, atol=0)
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-5, atol=1e-8)
    assert all_finite(list(ours.values()))


@pytest.mark.parametrize("mode", ["value", "norm"])
def test_other_clip_modes_are_rllibs(mode):
    ours, theirs = _grads(3, 5.0), _grads(3, 5.0)
    clip_gradients(ours, grad_clip=0.1, grad_clip_by=mode)
    rllib_clip_gradients(theirs, grad_clip=0.1, grad_clip_by=mode)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.fixture(scope="module")
def learner(ray_local):
    cfg = load(QUICKSTART, ["training.train_batch_size=64", "training.minibatch_size=64", "env.max_new_tokens=6",
                            "env_runners.num_envs_per_env_runner=4"])
    algo = algorithm_config(cfg).build_algo()
    yield algo.learner_group._learner
    algo.stop()


def _step(learner, apply, grads: dict):
    """Applies `grads` to a copy of the learner's parameters and optimizer; returns the new
    parameters and the host reads it made."""
    saved = ({pid: p.detach().clone() for pid, p in learner._params.items()},
             {k: copy.deepcopy(o.state_dict()) for k, o in learner._named_optimizers.items()})
    try:
        with HostReads() as reads:
            apply(learner, {pid: g.clone() for pid, g in grads.items()})
        return {pid: p.detach().clone() for pid, p in learner._params.items()}, reads.count
    finally:
        with torch.no_grad():
            for pid, p in learner._params.items():
                p.copy_(saved[0][pid])
        for k, o in learner._named_optimizers.items():
            o.load_state_dict(saved[1][k])


def test_fused_apply_gradients_steps_as_rllib_with_one_host_read(learner):
    assert isinstance(learner, FusedGradients)
    g = torch.Generator().manual_seed(0)
    grads = {pid: torch.randn(p.shape, generator=g) * 1e-2 for pid, p in learner._params.items()}
    ours, our_reads = _step(learner, type(learner).apply_gradients, grads)
    theirs, their_reads = _step(learner, TorchLearner.apply_gradients, grads)
    assert all(torch.equal(ours[pid], theirs[pid]) for pid in ours)
    assert any(not torch.equal(ours[pid], p) for pid, p in learner._params.items())  # it stepped
    assert our_reads == 1 and their_reads >= 2 * len(grads), (our_reads, their_reads)


def test_a_nan_gradient_takes_rllibs_path_and_becomes_zero(learner):
    g = torch.Generator().manual_seed(1)
    grads = {pid: torch.randn(p.shape, generator=g) * 1e-2 for pid, p in learner._params.items()}
    first = next(iter(grads))
    grads[first].view(-1)[0] = float("nan")
    ours, _ = _step(learner, type(learner).apply_gradients, grads)
    theirs, _ = _step(learner, TorchLearner.apply_gradients, grads)
    assert all(torch.equal(ours[pid], theirs[pid]) for pid in ours)
    assert all(torch.isfinite(p).all() for p in ours.values())
