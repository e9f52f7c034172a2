"""The learner's update as one static function (agents/algorithms/static_update.py): on the CPU it
runs eagerly and must give RLlib's update; what a CUDA graph needs of it (fixed shapes, no host
read, no graph break) is checked here too. The captured replays are checked on CUDA only."""
import gc
import math
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from agents.algorithms import static_update as su
from agents.config import algorithm_config, load
from agents.core import PASS_ROWS
from env.validation import ConfigError
from tests.conftest import QUICKSTART, ROOT
from tests.test_gradients import HostReads

SMALL = ["training.train_batch_size=512", "training.minibatch_size=256", "training.num_epochs=2",
         "env.max_new_tokens=8", "env_runners.num_envs_per_env_runner=16"]
MID = "default_policy"
A3C_CONFIG = os.path.join(ROOT, "tune_configs", "a3c_synthetic.yaml")
A2C_SMALL = ["env_runners.num_env_runners=0", "training.train_batch_size=512", "env.max_new_tokens=8",
             "env_runners.num_envs_per_env_runner=16", "training.lr_decay_steps=2000"]
PPO_PP_CONFIG = os.path.join(ROOT, "tune_configs", "ppo_pp_synthetic.yaml")
PPO_PP_SMALL = ["training.train_batch_size=256", "training.minibatch_size=128", "training.num_epochs=2",
                "env.max_new_tokens=8", "env_runners.num_envs_per_env_runner=8", "guide.beta=0.5"]


def _train(static: bool, iterations: int = 2, more=()):
    """(learner parameters, learner metrics of the last iteration, sampled returns per iteration)
    of a fresh quickstart run."""
    cfg = load(QUICKSTART, SMALL + list(more) + [f"training.static_update={str(static).lower()}"])
    algo = algorithm_config(cfg).build_algo()
    try:
        results = [algo.train() for _ in range(iterations)]
        learner = algo.learner_group._learner
        params = {k: p.detach().clone() for k, p in learner.module[MID].named_parameters()}
        return params, results[-1]["learners"][MID], [r["env_runners"]["episode_return_mean"] for r in results]
    finally:
        algo.stop()


@pytest.fixture(scope="module")
def runs(ray_local):
    return {static: _train(static) for static in (False, True)}


def test_the_static_update_gives_rllibs_update_on_the_cpu(runs):
    (theirs, their_metrics, their_returns), (ours, our_metrics, our_returns) = runs[False], runs[True]
    assert our_returns == their_returns  # iteration 2 sampled by the weights of iteration 1's updates
    # 8 Adam steps of lr 1e-3 (2 iterations x 2 epochs x 2 minibatches): rounding can move an
    # element with a near-zero gradient by up to lr a step; here they stay within 1e-5
    for name, p in theirs.items():
        torch.testing.assert_close(ours[name], p, rtol=0, atol=1e-5)
    for key in ("total_loss", "policy_loss", "vf_loss", "entropy", "vf_explained_var", "clip_fraction",
                "mean_kl_loss", "gradients_default_optimizer_global_norm"):
        assert our_metrics[key] == pytest.approx(their_metrics[key], rel=1e-4, abs=1e-6), key
    assert our_metrics["static_update_skipped"] == 0.0
    assert set(their_metrics) <= set(our_metrics)


@pytest.mark.parametrize("algorithm", ["a2c", "ppo_pp"])
def test_a2c_and_guided_static_updates_give_rllibs_update_on_the_cpu(ray_local, algorithm):
    """A2C (A3C with no remote EnvRunner: sample here, then one step), with its learning rate
    annealed (the schedule's lr reaches the function as a device tensor); PPO++ (the guide's
    steps masked out of the loss) through the same function."""
    config, small = {"a2c": (A3C_CONFIG, A2C_SMALL), "ppo_pp": (PPO_PP_CONFIG, PPO_PP_SMALL)}[algorithm]
    runs = {}
    for static in (False, True):
        cfg = load(config, small + [f"training.static_update={str(static).lower()}"])
        algo = algorithm_config(cfg).build_algo()
        try:
            results = [algo.train() for _ in range(2)]
            params = {k: p.detach().clone() for k, p in algo.learner_group._learner.module[MID].named_parameters()}
            runs[static] = params, results[-1]["learners"][MID], [r["env_runners"]["episode_return_mean"] for r in results]
            if algorithm == "ppo_pp":  # guide steps were there to mask
                assert results[-1]["env_runners"]["guided_episode_fraction"] > 0.2
        finally:
            algo.stop()
    (theirs, their_metrics, their_returns), (ours, our_metrics, our_returns) = runs[False], runs[True]
    assert our_returns == their_returns
    assert our_metrics["static_update_skipped"] == 0.0  # it ran (RLlib's update logs no such key)
    for name, p in theirs.items():
        torch.testing.assert_close(ours[name], p, rtol=0, atol=1e-5)
    for key in ("total_loss", "policy_loss", "vf_loss", "entropy", "vf_explained_var", "mean_kl_loss"):
        assert our_metrics[key] == pytest.approx(their_metrics[key], rel=1e-4, abs=1e-6), key
    # and the updates moved the weights well past that tolerance (both runs did learn)
    assert max(float((ours[name] - p).abs().max()) for name, p in _initial_params(cfg).items()) > 1e-3


def _initial_params(cfg) -> dict:
    from env.text_env import TokenGenerationEnv

    algo_config = algorithm_config(cfg)
    module = algo_config.get_rl_module_spec(env=TokenGenerationEnv(algo_config.env_config)).build()
    return dict(module.named_parameters())


@pytest.fixture(scope="module")
def learner(ray_local):
    cfg = load(QUICKSTART, SMALL + ["training.static_update=true"])
    algo = algorithm_config(cfg).build_algo()
    yield algo, algo.learner_group._learner
    algo.stop()


def _minibatch(algo, learner):
    """A padded minibatch of the static function (the inputs the first update took)."""
    seen = []
    original = su.StaticUpdate._static_step

    def spy(self, module_id, inputs):
        seen.append({k: v.clone() for k, v in inputs.items()})
        return original(self, module_id, inputs)

    su.StaticUpdate._static_step = spy
    try:
        algo.train()
    finally:
        su.StaticUpdate._static_step = original
    return seen[0]


def _batch(inputs):
    batch = {k: v for k, v in inputs.items() if k not in su.PASS_KEYS}
    batch[PASS_ROWS] = tuple(inputs[k] for k in su.PASS_KEYS)
    return batch


def test_inputs_are_padded_to_their_buckets_and_padding_weighs_nothing(learner):
    algo, lrn = learner
    inputs = _minibatch(algo, lrn)
    seqs, steps = inputs["ids"].shape[0], inputs["inverse"].shape[0]
    assert seqs % su.SEQ_BUCKET == 0 and steps % su.ROW_BUCKET == 0
    weight = inputs[su.STEP_WEIGHT]
    real = int(inputs[su.STEP_COUNT])
    assert float(weight.sum()) == pytest.approx(1.0) and bool((weight[real:] == 0).all())
    # the padding changes nothing: the loss over the same steps with other padding is the same
    module, cfg = lrn.module[MID], lrn.config.get_config_for_module(MID)

    def loss(x):
        batch = _batch(x)
        with torch.no_grad():
            total, _ = lrn.loss_terms(MID, cfg, batch, module.forward_train(batch),
                                      su.WeightedMean(x[su.STEP_WEIGHT], x[su.STEP_COUNT]), x[su.ENTROPY_COEFF])
        return total

    more = {}
    for k, v in inputs.items():
        if k in ("ids", "mask"):
            more[k] = torch.cat([v, torch.zeros_like(v[:su.SEQ_BUCKET])])
        elif v.dim() and len(v) == steps:
            more[k] = torch.cat([v, torch.zeros_like(v[:su.ROW_BUCKET])])
        else:
            more[k] = v
    torch.testing.assert_close(loss(more), loss(inputs), rtol=1e-6, atol=1e-8)


def test_the_static_step_reads_nothing_on_the_host_and_compiles_without_graph_breaks(learner):
    """What capture as a CUDA graph needs: the whole step (forward, loss, backward, clipping,
    Adam) makes no host read (each would be a device sync), and its forward pass and loss trace
    as one graph (`torch.compile(fullgraph=True)`)."""
    algo, lrn = learner
    inputs = _minibatch(algo, lrn)
    before = {k: p.detach().clone() for k, p in lrn.module[MID].named_parameters()}
    optimizer = lrn.get_optimizers_for_module(MID)[0][1]
    optimizer.zero_grad(set_to_none=True)
    with HostReads() as reads:
        values, names = lrn._static_step(MID, inputs)
    assert reads.count == 0
    assert values.shape == (len(names),) and "total_loss" in names
    assert any(not torch.equal(p, before[k]) for k, p in lrn.module[MID].named_parameters())  # it stepped

    cfg = lrn.config.get_config_for_module(MID)

    def forward_and_loss(x):
        batch = _batch(x)
        total, metrics = lrn.loss_terms(MID, cfg, batch, lrn.module[MID].forward_train(batch),
                                        su.WeightedMean(x[su.STEP_WEIGHT], x[su.STEP_COUNT]), x[su.ENTROPY_COEFF])
        return total, metrics

    torch._dynamo.reset()
    gc.collect()  # trunks of earlier tests' runs leave lean_forward's weak table now, not mid-trace
    compiled = torch.compile(forward_and_loss, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        got, want = compiled(inputs), forward_and_loss(inputs)
    torch.testing.assert_close(got, want)


# aten ops that read device data back to the host on CUDA (each a sync that stream capture cannot
# hold): host reads, data-dependent output shapes, and the sorting embedding backward (above 3,072
# indices) and accumulating index_put_ (the backward of advanced indexing)
CAPTURE_UNSAFE = {"_local_scalar_dense", "item", "nonzero", "_unique", "_unique2", "unique_consecutive",
                  "unique_dim", "masked_select", "repeat_interleave", "bincount", "embedding_dense_backward",
                  "index_put", "index_put_", "_index_put_impl_", "masked_scatter", "histc"}


class AtenOps(TorchDispatchMode):
    """The names of the aten ops run inside it (forward, backward and optimizer alike)."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_the_static_step_runs_no_op_that_capture_cannot_hold(learner):
    """The ops of the whole step (here on the CPU; on CUDA the same ops): none that reads device
    data back to the host on CUDA. The same pass outside the static update takes the embedding's
    own backward (what the check would see)."""
    algo, lrn = learner
    inputs = _minibatch(algo, lrn)
    lrn.get_optimizers_for_module(MID)[0][1].zero_grad(set_to_none=True)
    with AtenOps() as ops:
        lrn._static_step(MID, inputs)
    assert {"addmm", "index_select", "index_add", "_fused_adam_"} <= ops.names  # it saw the step
    assert not ops.names & CAPTURE_UNSAFE, ops.names & CAPTURE_UNSAFE
    with AtenOps() as ops:
        total, _ = lrn.loss_terms(MID, lrn.config.get_config_for_module(MID), _batch(inputs),
                                  lrn.module[MID].forward_train(_batch(inputs)),
                                  su.WeightedMean(inputs[su.STEP_WEIGHT], inputs[su.STEP_COUNT]), 0.0)
        total.backward()
    assert "embedding_dense_backward" in ops.names


def test_a_non_finite_gradient_skips_the_whole_step(learner):
    algo, lrn = learner
    inputs = _minibatch(algo, lrn)
    inputs["advantages"][0] = float("nan")
    optimizer = lrn.get_optimizers_for_module(MID)[0][1]
    before = {k: p.detach().clone() for k, p in lrn.module[MID].named_parameters()}
    steps = [s["step"].clone() for s in optimizer.state.values()]
    optimizer.zero_grad(set_to_none=True)
    total, metrics = lrn._unpack(MID, *lrn._static_step(MID, inputs))
    assert float(metrics["static_update_skipped"]) == 1.0
    assert all(torch.equal(p, before[k]) for k, p in lrn.module[MID].named_parameters())
    assert all(torch.equal(s["step"], old) for s, old in zip(optimizer.state.values(), steps))


@pytest.mark.parametrize("setting, field", [
    ("sampler.name=top_k", "sampler.name"), ("training.mle_coef=0.5", "training.mle_coef"),
    ("training.gradient_checkpointing=true", "training.gradient_checkpointing"),
])
def test_settings_it_cannot_serve_are_refused_in_one_line(setting, field):
    more = ["sampler.k=5"] if setting.startswith("sampler") else []
    with pytest.raises(ConfigError) as err:
        load(QUICKSTART, ["training.static_update=true", setting] + more)
    message = str(err.value)
    assert message.startswith("training.static_update:") and field in message and "\n" not in message


def test_an_unsupported_model_falls_back_to_rllibs_update_with_one_warning(learner, caplog):
    algo, lrn = learner
    module = lrn.module[MID].unwrapped()
    module.serves_static_update = False  # as a seq2seq module
    try:
        with caplog.at_level("WARNING"):
            result = algo.train()
    finally:
        del module.serves_static_update
    skipped = result["learners"][MID].get("static_update_skipped")  # not logged this iteration
    assert skipped is None or math.isnan(skipped)
    assert any("training.static_update" in r.getMessage() and "RLlib's way" in r.getMessage()
               for r in caplog.records)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("algorithm, shared_pool, more", [("ppo", True, []), ("a2c", True, []), ("ppo", False, []),
                                                     ("ppo", True, ["training.update_clipping=true"])])
def test_captured_updates_equal_the_eager_static_updates_on_cuda(ray_local, algorithm, shared_pool, more, monkeypatch):
    """On CUDA the static function is captured once per bucket and replayed: the same learning
    as running it eagerly each time (first update eager, second captured, later replayed), up to
    the summation order of index_add_'s atomics. `shared_pool` False: each bucket's graph in its
    own memory pool (static_update.SHARED_POOL); `more`: with update clipping in the graph too."""
    from agents.algorithms import static_update

    monkeypatch.setattr(static_update, "SHARED_POOL", shared_pool)
    gpu = ["learners.num_gpus_per_learner=1"]  # the default precisions: bf16 autocast on a GPU with bf16
    config, small = (QUICKSTART, SMALL) if algorithm == "ppo" else (A3C_CONFIG, A2C_SMALL)
    results = {}
    for capture in (True, False):
        cfg = load(config, small + gpu + ["training.static_update=true"] + more)
        algo = algorithm_config(cfg).build_algo()
        learner = algo.learner_group._learner
        start = {k: p.detach().cpu().clone() for k, p in learner.module[MID].named_parameters()}
        if not capture:
            learner._static_graphs = _NeverCaptures()
        outs = [algo.train() for _ in range(3)]
        replays = sum(o["learners"][MID].get("static_update_replays", 0) for o in outs)
        params = {k: p.detach().cpu() for k, p in learner.module[MID].named_parameters()}
        results[capture] = (start, params, outs[0]["learners"][MID], replays)
        algo.stop()
    (start, ours, our_first, replays), (_, theirs, their_first, eager_replays) = results[True], results[False]
    assert replays >= 1 and eager_replays == 0
    # Each term within 1e-3 relative or 3e-5 absolute, the total within 3e-5 absolute: A2C's policy
    # loss and total are means of terms that nearly cancel (on an H100: policy loss 1.46e-4 against
    # 1.57e-4, total -0.010778 against -0.010767, both 1.1e-5 apart; the entropy near 3.9), so a
    # relative bound on them would measure bf16 noise.
    for key in ("policy_loss", "vf_loss", "entropy"):
        assert our_first[key] == pytest.approx(their_first[key], rel=1e-3, abs=3e-5), key
    assert our_first["total_loss"] == pytest.approx(their_first["total_loss"], abs=3e-5)
    moved = torch.cat([(theirs[k] - start[k]).flatten() for k in start]).norm()
    apart = torch.cat([(ours[k] - theirs[k]).flatten() for k in start]).norm()
    assert moved > 0 and apart < 0.05 * moved, (float(apart), float(moved))


class _NeverCaptures(dict):
    """A graph table whose buckets are never captured: every update runs the function eagerly."""

    def __setitem__(self, key, entry):
        entry.graph = False
        super().__setitem__(key, entry)
