"""Colocated weight syncs: the local EnvRunner gets the learner's weights by an in-place copy,
with nothing through Ray's object store, and trains exactly as RLlib's sync does."""
import os

import numpy as np
import pytest
import ray
import torch
import tree

from agents.config import algorithm_config, load
from agents.weight_sync import settle_sync_dtype
from env.validation import ConfigError
from tests.conftest import QUICKSTART, ROOT

SMALL = ["training.train_batch_size=512", "training.minibatch_size=256", "env_runners.num_envs_per_env_runner=8"]


def object_store_bytes(monkeypatch) -> list:
    """Counts the bytes of the tensors and arrays every `ray.put` call is given."""
    counted = []
    original = ray.put

    def put(value, *args, **kwargs):
        counted.append(sum(getattr(x, "nbytes", 0) for x in tree.flatten(value)))
        return original(value, *args, **kwargs)

    monkeypatch.setattr(ray, "put", put)
    return counted


def runner_and_learner_modules(algo):
    runner = algo.env_runner_group.local_env_runner.module
    learner = algo.learner_group.foreach_learner(lambda l: l.module["default_policy"]).result_or_errors[0].get()
    return runner, learner


def train(overrides, monkeypatch, iterations=3):
    cfg = load(QUICKSTART, SMALL + overrides)
    counted = object_store_bytes(monkeypatch)
    algo = algorithm_config(cfg).build_algo()
    curve, synced, versions = [], [], []  # versions: the weights sampled with, and the runner's after the sync
    try:
        for _ in range(iterations):
            before = sum(counted)
            result = algo.train()
            curve.append(result["env_runners"]["episode_return_mean"])
            runner, learner = runner_and_learner_modules(algo)
            learned = learner.state_dict()
            same = all(torch.equal(t, learned[k].to(t.dtype)) for k, t in runner.state_dict().items())
            synced.append((same, sum(counted) - before, getattr(algo, "colocated_sync_bytes", None),
                           {p.dtype for p in runner.lm.parameters()}))
            versions.append((result["env_runners"]["weights_seq_no"],
                             algo.env_runner_group.local_env_runner.get_state(components="rl_module")["weights_seq_no"]))
    finally:
        algo.stop()
    return curve, synced, versions


def test_colocated_sync_moves_nothing_through_the_object_store_and_trains_as_rllibs_sync(ray_local, monkeypatch):
    colocated, synced, versions = train([], monkeypatch)
    for same, put_bytes, copied, _ in synced:
        assert same  # after every update the EnvRunner's weights are the learner's
        assert put_bytes == 0  # nothing went through the object store
        assert copied > 100_000  # the tiny GPT-2's weights (tied embedding once) were copied in place
    rllib, synced, rllib_versions = train(["env_runners.colocated=false"], monkeypatch)
    assert all(same for same, *_ in synced)
    assert versions == rllib_versions == [(0, 1), (1, 2), (2, 3)]  # the weights' version, as RLlib's sync sets it
    assert all(put_bytes > 100_000 for _, put_bytes, *_ in synced)  # RLlib's sync: the weights, through the store
    np.testing.assert_array_equal(colocated, rllib)  # the same seed gives the same curve


def test_colocated_sync_casts_to_the_rollout_precision(ray_local, monkeypatch):
    _, synced, _ = train(["env_runners.precision=bf16"], monkeypatch, iterations=1)
    same, put_bytes, copied, runner_dtypes = synced[0]
    assert runner_dtypes == {torch.bfloat16}  # the EnvRunner's module holds bf16 weights...
    assert same and put_bytes == 0 and copied > 100_000  # ...the learner's, cast, copied in place


def evaluate(overrides, monkeypatch, iterations=2):
    """Trains with an evaluation each iteration; per iteration: whether the evaluation EnvRunner's
    weights were the learner's, the bytes `ray.put` got, the colocated evaluation sync's bytes, the
    evaluation's mean return."""
    cfg = load(QUICKSTART, SMALL + ["evaluation.interval=1", "evaluation.episodes=8"] + overrides)
    counted = object_store_bytes(monkeypatch)
    algo = algorithm_config(cfg).build_algo()
    out = []
    try:
        for _ in range(iterations):
            before = sum(counted)
            if hasattr(algo, "colocated_eval_sync_bytes"):
                algo.colocated_eval_sync_bytes = 0  # set again only by this iteration's evaluation sync
            result = algo.train()
            _, learner = runner_and_learner_modules(algo)
            learned = learner.state_dict()  # RLlib evaluates after the iteration's update
            evaluator = algo.eval_env_runner_group.local_env_runner.module
            same = all(torch.equal(t, learned[k].to(t.dtype)) for k, t in evaluator.state_dict().items())
            out.append((same, sum(counted) - before, getattr(algo, "colocated_eval_sync_bytes", None),
                        result["evaluation"]["env_runners"]["episode_return_mean"]))
    finally:
        algo.stop()
    return out


def test_evaluation_in_the_learners_process_is_colocated_too(ray_local, monkeypatch):
    """`evaluation.interval` set: RLlib's local evaluation EnvRunner gets the learner's weights by the
    same in-place copy (nothing through the object store), and evaluates as with RLlib's sync."""
    colocated = evaluate([], monkeypatch)
    rllib = evaluate(["env_runners.colocated=false"], monkeypatch)
    for same, put_bytes, copied, _ in colocated:
        assert same and put_bytes == 0 and copied > 100_000
    for same, put_bytes, copied, _ in rllib:
        assert same and put_bytes > 100_000 and copied is None  # the weights went through the store
    assert [r[-1] for r in colocated] == [r[-1] for r in rllib]  # the same evaluations


@pytest.mark.parametrize("setting, why", [("env_runners.num_env_runners=2", "env_runners.num_env_runners is 2"),
                                          ("learners.num_learners=2", "learners.num_learners is 2")])
def test_colocated_true_is_refused_where_rollouts_cannot_share_the_learners_process(setting, why):
    with pytest.raises(ConfigError, match=f"env_runners.colocated: .*{why}"):
        load(QUICKSTART, ["env_runners.colocated=true", setting])


def test_weight_sync_benchmark_prints_both_paths_bytes_and_seconds():
    from tests.conftest import run_module

    out = run_module("benchmarks.weight_sync", "--model", "tiny-gpt2", "--vocab", "52", "--reps", "1", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = {line.split(")")[0] + ")": line for line in out.stdout.splitlines() if line.startswith("(")}
    assert "object store      0.0 MB" in lines["(c)"] and "copied 0.4 MB" in lines["(c)"]
    assert "object store      0.4 MB" in lines["(r0)"]
    assert "object store      0.4 MB" in lines["(r)"]


def make_module(inference_only=False, **config):
    from agents.modules import CausalLMActorCritic
    from env.text_env import TokenGenerationEnv

    env_cfg = {"task": {"name": "increasing_numbers", "num_numbers": 10}, "max_prompt_len": 4, "max_new_tokens": 6}
    env = TokenGenerationEnv(env_cfg)
    return CausalLMActorCritic(observation_space=env.observation_space, action_space=env.action_space,
                               inference_only=inference_only,
                               model_config={"model": {"name_or_path": "tiny-gpt2"}, "env": env_cfg, "seed": 0,
                                             "reference_model": True, **config})


def test_lean_sync_sends_inference_weights_once_in_the_rollout_precision():
    from agents.modules import CausalLMActorCritic
    from agents.modules.sync_state import SYNC_BF16

    learner = make_module(rollout_precision="bf16")
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(torch.randn_like(p))
    lean = learner.get_state(inference_only=True)
    assert not any(k.startswith("ref_model.") for k in lean)  # learner-only parts stay
    assert "lm.transformer.wte.weight" in lean and "lm.lm_head.weight" not in lean  # the tied embedding once
    assert set(lean[SYNC_BF16]) == {k for k in lean if k.startswith("lm.")}  # the LM in bf16 bits
    assert all(lean[k].dtype == np.int16 for k in lean[SYNC_BF16]) and lean["value_head.weight"].dtype == np.float32
    CausalLMActorCritic.lean_sync = False
    try:
        before = learner.get_state(inference_only=True)  # RLlib's inference state: fp32, the tie twice
    finally:
        CausalLMActorCritic.lean_sync = True
    sent = lambda state: sum(v.nbytes for k, v in state.items() if k != SYNC_BF16)  # noqa: E731
    assert sent(lean) < 0.51 * sent(before)  # bf16 halves it; the tie (a tiny vocabulary here) a little more
    runner = make_module(inference_only=True, rollout_precision="bf16")
    runner.set_state(lean)
    own, source = runner.state_dict(), learner.state_dict()
    for name, value in own.items():  # equal to the learner's weights in the rollout precision
        assert torch.equal(value, source[name].to(value.dtype)), name
    assert own["lm.lm_head.weight"].data_ptr() == own["lm.transformer.wte.weight"].data_ptr()  # still tied


def test_rollout_sampling_draws_from_the_modules_own_generator():
    """A colocated learner's draws (here: the process's global generator) do not move rollouts,
    and a restored rollout state draws on where the saved one was."""
    from ray.rllib.core.columns import Columns

    from env.text_env import TokenGenerationEnv
    from tests.test_decode_engine import ENV_CFG, PROMPTS

    envs = [TokenGenerationEnv(ENV_CFG) for _ in PROMPTS]
    obs = [e.reset(seed=i, options={"prompt": p})[0] for i, (e, p) in enumerate(zip(envs, PROMPTS))]
    batch = {Columns.OBS: {k: torch.as_tensor(np.stack([o[k] for o in obs])) for k in obs[0]}}
    runs = []
    for disturb in (False, True):
        module = make_module(inference_only=True).eval()
        module.seed_rollouts(7)
        actions = []
        for _ in range(5):
            if disturb:
                torch.rand(1000)
            actions.append(module.act(batch)[Columns.ACTIONS].tolist())
        saved = module.get_rollout_state()
        runs.append((actions, module.act(batch)[Columns.ACTIONS].tolist()))
    assert runs[0] == runs[1]
    restored = make_module(inference_only=True).eval()
    restored.seed_rollouts(123)
    restored.set_rollout_state(saved)
    assert restored.act(batch)[Columns.ACTIONS].tolist() == runs[1][1]
    other = make_module(inference_only=True).eval()
    other.seed_rollouts(123)
    assert [other.act(batch)[Columns.ACTIONS].tolist() for _ in range(6)] != runs[0][0] + [runs[0][1]]


def test_driver_env_runner_loads_no_weights_while_remote_env_runners_sample(ray_local, monkeypatch):
    """With a remote EnvRunner sampling, syncs to the driver's EnvRunner wait until its module is
    used (here `Algorithm.get_module`), which then holds the learner's latest weights."""
    from agents.modules import CausalLMActorCritic

    cfg = load(QUICKSTART, SMALL + ["env_runners.num_env_runners=1", "env_runners.num_cpus_per_env_runner=0.5"])
    algo = algorithm_config(cfg).build_algo()
    try:
        local = algo.env_runner_group.local_env_runner
        driver_module = local.__dict__["_module"]
        counted = object_store_bytes(monkeypatch)
        loads = []
        original = CausalLMActorCritic.set_state
        monkeypatch.setattr(CausalLMActorCritic, "set_state",
                            lambda self, state: (loads.append(self is driver_module), original(self, state))[1])
        rewards = [algo.train()["env_runners"]["episode_return_mean"] for _ in range(2)]
        assert all(np.isfinite(rewards))  # the remote EnvRunner sampled
        assert not any(loads) and local.__dict__["_pending_sync"] is not None
        # each sync put the lean state into the object store: every distinct tensor once (the tie once)
        distinct = sum({t.data_ptr(): t.nbytes for t in driver_module.state_dict().values()}.values())
        syncs = [n for n in counted if n > 100_000]
        assert len(syncs) >= 2 and all(n == distinct for n in syncs), (syncs, distinct)
        assert settle_sync_dtype(algo) is None  # the remote runner settled fp32 (a CPU): float32 it stays
        module = algo.get_module()
        assert module is driver_module and any(loads)
        _, learner = runner_and_learner_modules(algo)
        learned = learner.state_dict()
        assert all(torch.equal(t, learned[k].to(t.dtype)) for k, t in module.state_dict().items())
    finally:
        algo.stop()


def test_auto_rollout_precision_is_bf16_only_on_a_gpu_with_it_and_a_lean_sync_fills_it(monkeypatch):
    import agents.models
    import agents.modules.actor_critic
    from agents.config import rollout_precision
    from agents.models import auto_rollout_dtype

    assert rollout_precision(load(QUICKSTART, [])) == "auto"  # the default, settled by each rollout module
    assert rollout_precision(load(QUICKSTART, ["env_runners.precision=fp32"])) == "fp32"
    assert rollout_precision(load(os.path.join(ROOT, "tune_configs", "dqn_synthetic.yaml"), [])) == "fp32"
    for has_bf16, device, dtype in ((True, "cuda", torch.bfloat16), (False, "cuda", torch.float32),
                                    (True, "cpu", torch.float32)):
        monkeypatch.setattr(agents.models, "gpu_has_bf16", lambda device=None: has_bf16)
        assert auto_rollout_dtype(torch.device(device)) == dtype  # (a torch.device needs no GPU)
    runner = make_module(inference_only=True, rollout_precision="auto")
    runner.settle_rollout_precision()  # on the CPU (a guided or evaluation runner too): as built
    assert all(p.dtype == torch.float32 for p in runner.parameters())
    monkeypatch.setattr(agents.modules.actor_critic, "auto_rollout_dtype", lambda device: torch.bfloat16)
    runner.settle_rollout_precision()  # as on a GPU with bf16: the LM only
    assert all(p.dtype == torch.bfloat16 for p in runner.lm.parameters())
    assert runner.value_head.weight.dtype == torch.float32
    learner = make_module(rollout_precision="auto")
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(torch.randn_like(p))
    runner.set_state(learner.get_state(inference_only=True))  # a remote runner's sync: float32, cast in
    own, source = runner.state_dict(), learner.state_dict()
    for name, value in own.items():
        assert value.dtype == (torch.bfloat16 if name.startswith("lm.") else torch.float32), name
        assert torch.equal(value, source[name].to(value.dtype)), name


class _Group:
    """An EnvRunnerGroup (or LearnerGroup) of the given remote workers, as `settle_sync_dtype` uses it."""

    def __init__(self, workers):
        self.workers = workers

    def num_remote_workers(self):
        return len(self.workers)

    def foreach_env_runner(self, fn, local_env_runner=True):
        return [fn(w) for w in self.workers]

    foreach_learner = foreach_env_runner


def test_remote_runners_that_all_settled_bf16_receive_bf16(monkeypatch):
    """Under precision auto a remote EnvRunner on a GPU with bf16 holds its LM in bf16: once every
    remote runner says so, the learners send bf16 (half the bytes) and a runner is filled exactly as
    by a float32 sync; one fp32 runner (or one not under auto) keeps float32 for all."""
    import types

    import agents.modules.actor_critic
    from agents.modules.sync_state import SYNC_BF16

    def runner_module(settled_bf16: bool):
        module = make_module(inference_only=True, rollout_precision="auto")
        if settled_bf16:
            with monkeypatch.context() as m:
                m.setattr(agents.modules.actor_critic, "auto_rollout_dtype", lambda device: torch.bfloat16)
                module.settle_rollout_precision()
        return module

    def algo(*runners):
        learner = types.SimpleNamespace(module=make_module(rollout_precision="auto"))
        with torch.no_grad():
            for p in learner.module.parameters():
                p.add_(torch.randn_like(p))
        group = _Group([types.SimpleNamespace(module=m) for m in runners])
        return types.SimpleNamespace(env_runner_group=group, learner_group=_Group([learner])), learner.module

    bf16_runner, fp32_runner = runner_module(True), runner_module(False)
    mixed, learner = algo(bf16_runner, fp32_runner)
    assert settle_sync_dtype(mixed) is None and SYNC_BF16 not in learner.get_state(inference_only=True)
    both, learner = algo(bf16_runner, runner_module(True))
    assert settle_sync_dtype(both) == "torch.bfloat16"
    lean = learner.get_state(inference_only=True)
    assert set(lean[SYNC_BF16]) == {k for k in lean if k.startswith("lm.")}  # the LM in bf16 bits
    bf16_runner.set_state(lean)
    own, source = bf16_runner.state_dict(), learner.state_dict()
    for name, value in own.items():
        assert torch.equal(value, source[name].to(value.dtype)), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_colocated_rollouts_on_a_gpu_take_bf16_by_default(ray_local, monkeypatch):
    from agents.models import gpu_has_bf16
    from agents.modules.acting import GREEDY_KEY

    cfg = load(QUICKSTART, SMALL + ["learners.num_gpus_per_learner=1", "evaluation.interval=1",
                                    "evaluation.episodes=8"])
    algo = algorithm_config(cfg).build_algo()
    try:
        result = algo.train()
        runner, _ = runner_and_learner_modules(algo)
        evaluator = algo.eval_env_runner_group.local_env_runner.module  # evaluation too, on the GPU in blocks
        expected = torch.bfloat16 if gpu_has_bf16() else torch.float32
        for module in (runner, evaluator):
            assert next(module.lm.parameters()).device.type == "cuda"
            assert all(p.dtype == expected for p in module.lm.parameters())
        assert algo.colocated_sync_bytes > 0 and algo.colocated_eval_sync_bytes > 0
        algo.colocated_eval_sync_bytes = 0
        result = algo.train()  # this iteration's evaluation synced in place again
        assert algo.colocated_eval_sync_bytes > 0
        assert result["evaluation"]["env_runners"]["num_episodes"] >= 8
        assert ("steps", 3, GREEDY_KEY) in evaluator.kv_cache.engine.graphs
    finally:
        algo.stop()


def test_auto_precision_keeps_the_cpu_learner_in_fp32_and_picks_bf16_on_a_gpu_with_it():
    from agents.config import validate

    assert validate({"task": {"name": "increasing_numbers"}})["training"]["precision"] == "auto"
    auto, bf16 = make_module(train_precision="auto"), make_module(train_precision="bf16")
    with auto.autocast():
        assert not torch.is_autocast_enabled("cpu")  # the CPU path is unchanged
    with bf16.autocast():
        assert torch.is_autocast_enabled("cpu")  # (bf16 asked for by name autocasts on the CPU too)
    assert all(p.dtype == torch.float32 for p in auto.parameters())
    from agents.models import auto_precision

    assert auto_precision("cpu") == "fp32"
    if torch.cuda.is_available():
        assert auto_precision("cuda") == ("bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp32")


def test_evaluation_is_colocated_while_remote_envrunners_train(ray_local, monkeypatch):
    [(same, _, copied, _)] = evaluate(["env_runners.num_env_runners=1", "env_runners.num_cpus_per_env_runner=0.5"],
                                      monkeypatch, iterations=1)
    assert same and copied > 100_000
