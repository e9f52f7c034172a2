"""StableAdamW's update clipping on the learners' Adam (`training.update_clipping`,
agents/algorithms/gradients.py UpdateClipping): the arithmetic against a plain per-tensor
implementation, what it leaves alone, the spike it damps, and the learners' paths that step."""
import math

import pytest
import torch

from agents.algorithms.gradients import UpdateClipping, update_clipping_of
from agents.config import algorithm_config, load
from env.validation import ConfigError
from tests.conftest import QUICKSTART, ROOT
from tests.test_gradients import HostReads
from tests.test_static_update import CAPTURE_UNSAFE, MID, SMALL, AtenOps, _minibatch

LR, BETAS, EPS = 1e-3, (0.9, 0.999), 1e-8


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((4, 3), (3,), (5, 2, 2))]


def _gradients(quiet=2000, seed=1):
    """A plateau's gradients: near zero (1e-3) for `quiet` steps, then one a thousand times larger."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((4, 3), (3,), (5, 2, 2))
    return ([[1e-3 * (1.0 + 0.1 * torch.randn(s, generator=g)) for s in shapes] for _ in range(quiet)]
            + [[torch.randn(s, generator=g) for s in shapes]])


def _reference(params, gradients):
    """StableAdamW without weight decay, one tensor at a time (Wortsman et al. 2023, Algorithm 2
    with Adam's bias correction): lr_t = lr / max(1, sqrt(mean(g^2 / max(v_hat, eps^2))))."""
    params = [p.detach().clone().double() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t, grads in enumerate(gradients, start=1):
        for i, g in enumerate(grads):
            g = g.double()
            m[i] = BETAS[0] * m[i] + (1 - BETAS[0]) * g
            v[i] = BETAS[1] * v[i] + (1 - BETAS[1]) * g * g
            m_hat, v_hat = m[i] / (1 - BETAS[0] ** t), v[i] / (1 - BETAS[1] ** t)
            rms = math.sqrt(float((g * g / v_hat.clamp_min(EPS * EPS)).mean()))
            params[i] -= LR / max(1.0, rms) * m_hat / (v_hat.sqrt() + EPS)
    return params


def _run(gradients, clipped: bool, **adam):
    params = _params()
    optimizer = torch.optim.Adam(params, lr=LR, betas=BETAS, eps=EPS, **adam)
    clipping = UpdateClipping(optimizer) if clipped else None
    scales, changes = [], []
    for grads in gradients:
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()
        changes.append(max(float((p.detach() - b).abs().max()) for p, b in zip(params, before)))
        if clipping is not None:
            scales.append(float(clipping.last_scale))
    return params, scales, changes


@pytest.mark.parametrize("adam", [{"fused": True}, {"foreach": True}, {"foreach": False}])
def test_it_is_stableadamws_update(adam):
    gradients = _gradients()
    got, scales, _ = _run(gradients, True, **adam)
    for p, want in zip(got, _reference(_params(), gradients)):
        torch.testing.assert_close(p.detach().double(), want, rtol=1e-5, atol=1e-6)  # float32 against float64
    assert scales[0] == 1.0  # the first step's v is its own g^2: RMS 1
    assert max(scales[:-1]) == 1.0 and scales[-1] < 0.5  # the spike after 2,000 near-zero gradients was scaled down


def test_while_the_gradients_shrink_it_leaves_adams_steps_alone():
    """Each gradient smaller than the ones before (as while a policy converges): g^2 < v, RMS
    below 1, and the parameters are Adam's bit for bit."""
    g = torch.Generator().manual_seed(3)
    shrinking = [[0.9 ** t * (1.0 + 0.01 * torch.randn(s, generator=g)) for s in ((4, 3), (3,), (5, 2, 2))]
                 for t in range(30)]
    plain, _, _ = _run(shrinking, False, fused=True)
    clipped, scales, _ = _run(shrinking, True, fused=True)
    assert scales == [1.0] * 30
    for a, b in zip(plain, clipped):
        assert torch.equal(a, b)


def test_a_spike_after_quiet_steps_moves_no_coordinate_by_much_more_than_the_lr():
    """Plain Adam steps each coordinate by up to about 0.1 / sqrt(0.001) = 3.2x the lr when a
    gradient arrives far larger than the recent ones (v is out of date); clipped, well below it
    where the spike spreads over the tensor (RMS is a mean over the tensor)."""
    gradients = _gradients()
    _, _, plain = _run(gradients, False, fused=True)
    _, scales, clipped = _run(gradients, True, fused=True)
    assert plain[-1] > 2.5 * LR
    assert clipped[-1] < 0.2 * LR  # about (1 - beta1) x the lr: the spike spreads over each tensor here
    # on the quiet steps, whose gradients vary by 10%, it took some off (RMS just above 1)
    assert all(0.8 * b <= a <= b * (1 + 1e-3) for a, b in zip(clipped[:-1], plain[:-1]))  # float32 rounding


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_skipped_step_stays_skipped_and_reports_no_clipping(bad):
    """Fused Adam's `found_inf` (the static update's non-finite screen) skips the step; the hook
    then moves nothing either, and its scale is 1 (nothing was clipped), NaN or inf alike, also
    for the tensors whose gradients were finite."""
    params = _params()
    optimizer = torch.optim.Adam(params, lr=LR, fused=True)
    clipping = UpdateClipping(optimizer)
    for t in range(30):
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        optimizer.step()
    before = [p.detach().clone() for p in params]
    params[0].grad = torch.full_like(params[0], bad)
    for p in params[1:]:
        p.grad = torch.ones_like(p)  # would be clipped hard after 30 small steps
    optimizer.found_inf = torch.ones(())
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert float(clipping.last_scale) == 1.0


def _train(more, iterations=2):
    cfg = load(QUICKSTART, SMALL + ["training.update_clipping=true"] + list(more))
    algo = algorithm_config(cfg).build_algo()
    try:
        results = [algo.train() for _ in range(iterations)]
        learner = algo.learner_group._learner
        params = {k: p.detach().clone() for k, p in learner.module[MID].named_parameters()}
        return algo, params, results[-1]["learners"][MID]
    finally:
        algo.stop()


def test_rllibs_update_and_the_static_one_both_take_it(ray_local):
    """Both of PPO's update paths on the CPU: the optimizer carries the clipping, each logs the
    iteration's smallest scale, and they step to the same parameters (as without clipping,
    tests/test_static_update.py)."""
    algo, theirs, their_metrics = _train(["training.static_update=false"])
    assert update_clipping_of(algo.learner_group._learner.get_optimizers_for_module(MID)[0][1]) is not None
    _, ours, our_metrics = _train(["training.static_update=true"])
    for metrics in (their_metrics, our_metrics):
        assert 0.0 < metrics["update_clip_scale"] < 1.0  # some tensor's step was clipped (0.78 here)
    assert our_metrics["update_clip_scale"] == pytest.approx(their_metrics["update_clip_scale"], rel=1e-4)
    for name, p in theirs.items():
        torch.testing.assert_close(ours[name], p, rtol=0, atol=1e-5)


def test_the_static_step_with_it_reads_nothing_on_the_host(ray_local):
    """What a CUDA graph needs of the clipped step: no host read, no op capture cannot hold."""
    cfg = load(QUICKSTART, SMALL + ["training.static_update=true", "training.update_clipping=true"])
    algo = algorithm_config(cfg).build_algo()
    try:
        lrn = algo.learner_group._learner
        inputs = _minibatch(algo, lrn)  # one update first: the clipping's buffers exist, as after a warm-up
        optimizer = lrn.get_optimizers_for_module(MID)[0][1]
        optimizer.zero_grad(set_to_none=True)
        with HostReads() as reads, AtenOps() as ops:
            values, names = lrn._static_step(MID, inputs)
        assert reads.count == 0
        assert "_foreach_lerp_" in ops.names and not ops.names & CAPTURE_UNSAFE
        assert "update_clip_scale" in names
    finally:
        algo.stop()


def test_an_algorithm_that_does_not_read_it_refuses_it():
    with pytest.raises(ConfigError) as err:
        load(f"{ROOT}/tune_configs/dqn_synthetic.yaml", ["training.update_clipping=true"])
    assert "training.update_clipping" in str(err.value) and "\n" not in str(err.value)
