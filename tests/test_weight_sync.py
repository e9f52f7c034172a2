"""Colocated weight syncs: the local EnvRunner gets the learner's weights by an in-place copy,
with nothing through Ray's object store, and trains exactly as RLlib's sync does."""
import numpy as np
import pytest
import ray
import torch
import tree

from agents.config import algorithm_config, load
from env.validation import ConfigError
from tests.conftest import QUICKSTART

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
    curve, synced = [], []
    try:
        for _ in range(iterations):
            before = sum(counted)
            result = algo.train()
            curve.append(result["env_runners"]["episode_return_mean"])
            runner, learner = runner_and_learner_modules(algo)
            learned = learner.state_dict()
            same = all(torch.equal(t, learned[k].to(t.dtype)) for k, t in runner.state_dict().items())
            synced.append((same, sum(counted) - before, getattr(algo, "colocated_sync_bytes", None)))
    finally:
        algo.stop()
    return curve, synced


def test_colocated_sync_moves_nothing_through_the_object_store_and_trains_as_rllibs_sync(ray_local, monkeypatch):
    colocated, synced = train([], monkeypatch)
    for same, put_bytes, copied in synced:
        assert same  # after every update the EnvRunner's weights are the learner's
        assert put_bytes == 0  # nothing went through the object store
        assert copied > 100_000  # the tiny GPT-2's weights (tied embedding once) were copied in place
    rllib, synced = train(["env_runners.colocated=false"], monkeypatch)
    assert all(same for same, _, _ in synced)
    assert all(put_bytes > 100_000 for _, put_bytes, _ in synced)  # RLlib's sync: the weights, through the store
    np.testing.assert_array_equal(colocated, rllib)  # the same seed gives the same curve


def test_colocated_sync_casts_to_the_rollout_precision_and_keeps_ties(ray_local, monkeypatch):
    _, synced = train(["env_runners.precision=bf16"], monkeypatch, iterations=1)
    assert synced[0][0] and synced[0][1] == 0


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
    assert "object store      0.4 MB" in lines["(r)"]
