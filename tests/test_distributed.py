"""Scale-out and fault tolerance: several EnvRunners and learners, a killed EnvRunner, a killed trial."""
import glob
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from agents.config import algorithm_config, load
from tests.conftest import QUICKSTART, ROOT, logged_iterations, run_module as run

SMALL = ["training.train_batch_size=512", "training.minibatch_size=128", "env_runners.num_envs_per_env_runner=8"]


def test_trial_resources_match_what_rllib_reserves():
    from agents.algorithms.ppo import LMPPO
    from agents.train import trial_resources

    cases = [
        [],
        ["tune.num_cpus_per_trial=0.66"],  # fractional sweep trials: the in-process learner follows
        ["env_runners.num_env_runners=2", "learners.num_learners=2"],
        ["env_runners.num_env_runners=2", "env_runners.num_cpus_per_env_runner=0.25", "learners.num_learners=2",
         "learners.num_cpus_per_learner=0.25", "tune.num_cpus_per_trial=0.5"],
        ["learners.num_learners=2", "learners.num_gpus_per_learner=1"],
        ["learners.num_gpus_per_learner=0.5", "env_runners.num_env_runners=1", "env_runners.num_gpus_per_env_runner=0.25"],
    ]
    for sets in cases:
        cfg = load(QUICKSTART, sets)
        rllib = LMPPO.default_resource_request(algorithm_config(cfg)).required_resources
        ours = trial_resources(cfg)
        assert ours["CPU"] == pytest.approx(rllib.get("CPU", 0)), sets
        assert ours["GPU"] == pytest.approx(rllib.get("GPU", 0)), sets


def test_a_trial_that_needs_more_than_the_instance_has_is_refused_naming_the_fields():
    from agents.train import check_trial_fits

    cfg = load(QUICKSTART, ["env_runners.num_env_runners=4"])  # the trial's process + 4 EnvRunners
    with pytest.raises(ValueError) as err:
        check_trial_fits(cfg, {"CPU": 2.0})
    assert str(err.value).startswith("one trial needs 5 CPUs") and "this Ray instance has 2" in str(err.value)
    assert "num_cpus_per_env_runner" in str(err.value) and "\n" not in str(err.value)
    check_trial_fits(cfg, {"CPU": 5.0})  # fits exactly
    check_trial_fits(load(QUICKSTART, ["env_runners.num_env_runners=4", "env_runners.num_cpus_per_env_runner=0.25"]),
                     {"CPU": 2.0})  # the fix the message suggests
    with pytest.raises(ValueError, match=r"^one trial needs 1 GPUs"):
        check_trial_fits(load(QUICKSTART, ["learners.num_gpus_per_learner=1"]), {"CPU": 2.0})


def test_env_runners_custom_resources_reach_rllib_and_are_checked():
    from agents.train import check_custom_resources, check_trial_fits

    sets = ["env_runners.num_env_runners=2", "env_runners.num_cpus_per_env_runner=0.25"]
    cfg = load(QUICKSTART, sets + ["env_runners.custom_resources.rollout_node=1"])
    assert algorithm_config(cfg).custom_resources_per_env_runner == {"rollout_node": 1}
    check_custom_resources(cfg)
    check_trial_fits(cfg, {"CPU": 2.0, "rollout_node": 2.0})
    with pytest.raises(ValueError, match=r"^env_runners.custom_resources: 2 EnvRunners x 1 'rollout_node' need 2 "
                                         r"but this Ray instance has 0"):
        check_trial_fits(cfg, {"CPU": 2.0})
    for bad, message in (("CPU=1", "not a custom resource name"), ("rollout_node=-1", "expected a number >= 0"),
                         ("rollout_node=many", "expected a number >= 0")):
        with pytest.raises(ValueError, match=message):
            check_custom_resources(load(QUICKSTART, sets + [f"env_runners.custom_resources.{bad}"]))


@pytest.mark.slow  # starts a local Ray instance through the train CLI
def test_a_trial_too_big_for_the_local_machine_is_refused_in_one_line(tmp_path):
    out = run("agents.train", QUICKSTART, "--set", "env_runners.num_env_runners=4",
              "--set", f"tune.storage_path={tmp_path}", "--set", "tune.dashboard=false", timeout=180)
    assert out.returncode == 2
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and "one trial needs 5 CPUs" in err[0] and "num_cpus_per_env_runner" in err[0], out.stderr
    assert "Traceback" not in out.stderr


def _learner_states(algo):
    def weights(learner):
        module = learner.module["default_policy"].unwrapped()
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}

    def coef(learner):
        return learner.kl_penalty.controller.coef

    return algo.learner_group.foreach_learner(weights), algo.learner_group.foreach_learner(coef)


def _values(results):
    # foreach_learner returns plain values or RLlib call results, depending on the version.
    return [getattr(r, "get", lambda: r)() for r in results]


@pytest.mark.slow
def test_two_env_runners_and_two_learners_stay_in_sync_and_raise_the_reward(ray_local):
    cfg = load(QUICKSTART, SMALL + [
        "env_runners.num_env_runners=2", "env_runners.num_cpus_per_env_runner=0.25",
        "learners.num_learners=2", "learners.num_cpus_per_learner=0.25",
        "reward.kl_adaptive=true", "reward.kl_target=1.0",  # the adaptive coefficient must agree too
    ])
    algo = algorithm_config(cfg).build_algo()
    try:
        before, _ = _learner_states(algo)
        before = _values(before)[0]
        returns = []
        for it in range(30):
            result = algo.train()
            returns.append(result["env_runners"]["episode_return_mean"])
            if it in (0, 29):
                weights, coefs = (_values(x) for x in _learner_states(algo))
                assert len(weights) == 2
                for k in weights[0]:
                    assert torch.equal(weights[0][k], weights[1][k]), f"learners differ in {k} after update {it + 1}"
                assert coefs[0] == coefs[1], coefs
                moved = [k for k in weights[0] if not torch.equal(weights[0][k], before[k])]
                assert moved, "no update reached the weights"
        assert result["env_runners"]["num_episodes_lifetime"] > 0
        # Both EnvRunners sampled, with the learners' weights.
        runner_weights = algo.env_runner_group.foreach_env_runner(
            lambda r: {k: v.clone() for k, v in r.module.state_dict().items()}, local_env_runner=False)
        assert len(runner_weights) == 2
        learner = weights[0]
        for rw in runner_weights:
            shared = [k for k in rw if k in learner]
            assert shared and all(torch.equal(rw[k], learner[k]) for k in shared)
    finally:
        algo.stop()
    first, last = returns[0], np.mean(returns[-3:])
    assert first < 0.45  # near the random policy's score
    assert last > first + 0.1, returns


@pytest.mark.slow
def test_a_killed_env_runner_is_restarted_and_training_goes_on(ray_local):
    cfg = load(QUICKSTART, SMALL + ["env_runners.num_env_runners=2", "env_runners.num_cpus_per_env_runner=0.25"])
    algo = algorithm_config(cfg).build_algo()
    try:
        algo.train()
        group = algo.env_runner_group
        pids = group.foreach_env_runner(lambda r: os.getpid(), local_env_runner=False)
        assert len(set(pids)) == 2
        os.kill(pids[0], signal.SIGKILL)
        steps = [algo.train()["env_runners"]["num_env_steps_sampled_lifetime"] for _ in range(4)]
        assert all(b > a for a, b in zip(steps, steps[1:])), steps  # every iteration still sampled
        deadline = time.time() + 60
        while group.num_healthy_remote_workers() < 2 and time.time() < deadline:
            algo.train()
        assert group.num_healthy_remote_workers() == 2
        assert group.num_remote_worker_restarts() >= 1
        new_pids = group.foreach_env_runner(lambda r: os.getpid(), local_env_runner=False)
        assert pids[0] not in new_pids and len(set(new_pids)) == 2
    finally:
        algo.stop()


def _descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every process below `pid`."""
    table = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    children, args = {}, {}
    for line in table.splitlines():
        parts = line.split(None, 2)
        p, pp = int(parts[0]), int(parts[1])
        children.setdefault(pp, []).append(p)
        args[p] = parts[2] if len(parts) > 2 else ""
    out, todo = {}, [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out[c] = args[c]
            todo.append(c)
    return out


@pytest.mark.slow
def test_a_failed_trial_is_retried_from_its_last_checkpoint(tmp_path):
    args = [QUICKSTART, "--set", "stop.training_iteration=7", "--set", "checkpoint.frequency=2",
            "--set", "tune.max_failures=1", "--set", f"tune.storage_path={tmp_path}", "--set", "tune.name=retry",
            "--set", "generate.num_samples=0", "--set", "tune.dashboard=false"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "agents.train", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines, killed = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if killed is None and re.match(r"iter +3 ", line):
                trials = [p for p, a in _descendants(proc.pid).items() if a.startswith("ray::LMPPO")]
                assert len(trials) == 1, _descendants(proc.pid)
                killed = trials[0]
                os.kill(killed, signal.SIGKILL)  # the trial's process dies mid-run
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = "".join(lines)
    assert killed is not None, out
    assert proc.returncode == 0, out[-3000:]
    iterations = [int(i) for i in re.findall(r"^iter +(\d+) ", out, re.M)]
    # Up to iteration 3 (or 4) before the kill, then again from the checkpoint at 2 (or 4), up to 7.
    restart = next(i for i in range(1, len(iterations)) if iterations[i] <= iterations[i - 1])
    assert iterations[:restart] == list(range(1, restart + 1)), iterations
    assert iterations[restart] in (3, 5) and iterations[restart:] == list(range(iterations[restart], 8)), iterations
    assert "FAILED" not in out
    (trial_dir,) = [d for d in glob.glob(str(tmp_path / "retry" / "LMPPO_*")) if os.path.isdir(d)]
    for where, its in logged_iterations(trial_dir).items():
        assert its == list(range(1, 8)), (where, its)


def test_sequence_minibatches_give_every_learner_the_step_count_rllib_asks_for():
    from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch

    from agents.algorithms.sequence_batching import SEQ_ID, sequence_minibatches

    lengths = [5, 3, 7, 2, 6]  # a learner's shard: whole sequences of uneven length
    seq = np.repeat(np.arange(len(lengths)), lengths)
    batch = MultiAgentBatch({"p": SampleBatch({SEQ_ID: torch.as_tensor(seq), "x": torch.arange(len(seq))})},
                            env_steps=len(seq))

    def cut(**kw):
        return [m.policy_batches["p"] for m in sequence_minibatches(
            batch, minibatch_size=8, shuffle=True, rng=np.random.default_rng(0), **kw)]

    def whole_sequences(mini):
        ids = mini[SEQ_ID].numpy()
        return all((ids == i).sum() == lengths[i] for i in set(ids.tolist()))

    epochs = cut(num_epochs=2)
    assert all(whole_sequences(m) for m in epochs)
    per_epoch = sorted(np.concatenate([m["x"].numpy() for m in epochs]).tolist())
    assert per_epoch == sorted(list(range(len(seq))) * 2)  # each step twice in two epochs
    # Several learners: exactly num_total_minibatches steps, whatever the shard holds.
    for total in (1, 4, 9):
        minis = cut(num_epochs=2, num_total_minibatches=total)
        assert len(minis) == total and all(whole_sequences(m) for m in minis)


def test_sequences_left_over_from_an_epoch_join_its_last_minibatch_unless_half_a_minibatch():
    from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch

    from agents.algorithms.sequence_batching import SEQ_ID, sequence_minibatches

    def sizes(lengths, minibatch_size):
        seq = np.repeat(np.arange(len(lengths)), lengths)
        batch = MultiAgentBatch({"p": SampleBatch({SEQ_ID: torch.as_tensor(seq), "x": torch.arange(len(seq))})},
                                env_steps=len(seq))
        minis = sequence_minibatches(batch, num_epochs=1, minibatch_size=minibatch_size, shuffle=False,
                                     rng=np.random.default_rng(0))
        return [len(m.policy_batches["p"]) for m in minis]

    assert sizes([20] * 65, 1280) == [1300]  # 20 steps left over: no Adam step of their own
    assert sizes([20] * 96, 1280) == [1280, 640]  # half a minibatch left over: a minibatch
    assert sizes([20] * 95, 1280) == [1900]  # just under half: joins the last one
    assert sizes([20] * 5, 1280) == [100]  # an epoch smaller than a minibatch is one
    assert sizes([5, 3, 7, 2, 6], None) == [23]  # no minibatch size: the whole epoch
