"""Sweeps: the sampler sweep as the README runs it with a small budget (concurrent trials, dashboards,\ntable), and ASHA stopping a trial that cannot learn."""
import csv
import glob
import json
import os
import re

import pytest

from tests.conftest import QUICKSTART
from tests.conftest import run_module as run

SMALL_BUDGET = ["--set", "stop.training_iteration=3", "--set", "tune.grace_period=1",
                "--set", "training.train_batch_size=256", "--set", "training.minibatch_size=128"]


@pytest.mark.slow
def test_sampler_sweep_runs_trials_concurrently_with_event_files_wandb_and_summary(tmp_path):
    # learned masking's own syncs: tests/test_sampler_policy.py; mirostat's mask size reaches the results here
    samplers = "{grid_search: [{name: none}, {name: mirostat, tau: 4.0}]}"
    out = run("agents.train", "tune_configs/sampler_sweep.yaml", *SMALL_BUDGET,
              "--set", f"sampler={samplers}", "--set", f"tune.storage_path={tmp_path}",
              "--set", "tune.wandb=true", "--set", "generate.num_samples=0", timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"^Ray dashboard: http://\S+:\d+$", out.stdout, re.M)
    assert "W&B: logging every trial" in out.stdout and "(offline" in out.stdout

    trial_dirs = sorted(d for d in glob.glob(str(tmp_path / "sampler_sweep" / "LMPPO_*")) if os.path.isdir(d))
    assert len(trial_dirs) == 4  # 2 samplers x 2 learning rates
    spans = []
    for d in trial_dirs:
        assert glob.glob(os.path.join(d, "events.out.tfevents.*")), d  # TensorBoard
        assert glob.glob(os.path.join(d, "wandb", "offline-run-*")), d  # W&B, offline, no API key
        results = [json.loads(line) for line in open(os.path.join(d, "result.json"))]
        spans.append((results[0]["timestamp"] - results[0]["time_this_iter_s"], results[-1]["timestamp"]))
        learner = results[-1]["learners"]["default_policy"]
        if "mirostat" in d:
            assert 1 <= learner["mask_size"] <= 52  # mask size reaches the dashboards
    # Several trials ran at the same time on the 2 cores.
    spans.sort()
    assert any(spans[i + 1][0] < spans[i][1] for i in range(len(spans) - 1)), spans

    with open(tmp_path / "sampler_sweep" / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4
    assert {r["sampler"] for r in rows} == {"none", "mirostat"}
    assert {float(r["lr"]) for r in rows} == {1e-3, 3e-4}
    assert all(r["status"] == "ok" and r["best_reward"] for r in rows)
    table = out.stdout.split("best setting per sampler")[1]
    for name in ("none", "mirostat"):
        assert re.search(rf"^\s+{name}\s", table, re.M), table


# Two trials in grid order, one at a time: PPO sampling freely, and PPO restricted to greedy rollouts
# (top_k 1: the untrained model repeats itself, scores 0 and has nothing to learn from). ASHA (grace
# period 1, halving) records the good trial at each rung; the greedy one falls below it at iteration
# 1 and is stopped there, long before the 4-iteration limit. Its state saved often, for the kills below.
_ASHA_SWEEP = [QUICKSTART, "--set", "sampler={grid_search: [{name: none}, {name: top_k, k: 1}]}",
               "--set", "stop.training_iteration=4", "--set", "tune.scheduler=asha", "--set", "tune.grace_period=1",
               "--set", "tune.reduction_factor=2", "--set", "tune.max_concurrent_trials=1",
               "--set", "tune.num_cpus_per_trial=0.5", "--set", "training.train_batch_size=256",
               "--set", "training.minibatch_size=128", "--set", "env_runners.num_envs_per_env_runner=8",
               "--set", "generate.num_samples=0", "--set", "tune.name=asha", "--set", "tune.dashboard=false",
               "--set", "checkpoint.state_every_s=0.1"]


@pytest.mark.slow
def test_a_sweep_killed_before_its_second_trial_was_made_resumes_both_and_asha_keeps_its_rungs(tmp_path):
    """The sweep above, a checkpoint every iteration, killed (SIGKILL, driver and Ray) after the good
    trial's iteration 2, before Tune made the second trial. `--resume` makes and runs it (Tune's
    search algorithm state reaches the storage path, and the restored search space resolves), and
    ASHA's rungs come back with the experiment: the good trial goes on from its checkpoint without
    reporting iterations 1-2 again, and the weak one is still stopped at iteration 1 against them.
    Before: the second trial was lost (or failed to start), and with empty rungs it ran all 4."""
    import subprocess
    import sys

    from agents.experiment_store import SCHEDULER_FILE, newest_experiment_state
    from tests.conftest import ROOT, kill_after_iteration

    args = [*_ASHA_SWEEP, "--set", "checkpoint.frequency=1", "--set", f"tune.storage_path={tmp_path}"]
    experiment = tmp_path / "asha"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    killed = subprocess.Popen([sys.executable, "-m", "agents.train", *args], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    kill_after_iteration(killed, 2, experiment, line=r"(\[\S+\] )?iter +{} ")
    with open(newest_experiment_state(str(experiment))) as f:
        assert len(json.load(f)["trial_data"]) == 1  # the second trial not made yet
    with open(experiment / SCHEDULER_FILE) as f:
        assert any(rung for bracket in json.load(f)["rungs"] for rung in bracket)  # the good trial's rungs
    out = run("agents.train", *args, "--resume", timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (experiment / "summary.csv").is_file(), out.stdout[-3000:]  # two trials
    with open(experiment / "summary.csv") as f:
        rows = {r["sampler"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"none", "top_k"} and all(r["status"] == "ok" for r in rows.values()), rows
    assert int(rows["none"]["iterations"]) == 4, rows
    assert int(rows["top_k"]["iterations"]) == 1, rows  # stopped at the first rung, as without the kill
    # the good trial's lines (the first in grid order) go on from its checkpoint
    resumed = [int(i) for i in re.findall(r"^\[\S+_00000\] iter +(\d+) ", out.stdout, re.M)]
    assert resumed and min(resumed) >= 2, out.stdout[-3000:]


@pytest.mark.slow
def test_asha_resumed_after_the_good_trial_finished_still_stops_the_weak_one_at_its_first_rung(tmp_path):
    """The same sweep killed once the good trial has finished (it cannot record its rungs again):
    `--resume` restores ASHA's rungs with the experiment's state, so the weak trial is stopped at
    iteration 1 as in the uninterrupted run (with empty rungs it ran all 4)."""
    import signal
    import subprocess
    import sys
    import time

    from agents.experiment_store import newest_experiment_state
    from tests.conftest import ROOT

    args = [*_ASHA_SWEEP, "--set", "checkpoint.frequency=0", "--set", f"tune.storage_path={tmp_path}"]
    experiment = tmp_path / "asha"

    def statuses():
        try:
            with open(newest_experiment_state(str(experiment))) as f:
                return [json.loads(t[0])["status"] for t in json.load(f)["trial_data"]]
        except (TypeError, OSError, ValueError, KeyError):
            return []

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    killed = subprocess.Popen([sys.executable, "-m", "agents.train", *args], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 600
        while killed.poll() is None and time.time() < deadline and "TERMINATED" not in statuses():
            time.sleep(0.02)
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
    assert statuses().count("TERMINATED") == 1 and len(statuses()) <= 2, statuses()  # the weak trial not ended
    out = run("agents.train", *args, "--resume", timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (experiment / "summary.csv").is_file(), out.stdout[-3000:]  # two trials
    with open(experiment / "summary.csv") as f:
        rows = {r["sampler"]: r for r in csv.DictReader(f)}
    assert int(rows["none"]["iterations"]) == 4, rows  # from its result.json: it finished before the kill
    assert int(rows["top_k"]["iterations"]) == 1, rows  # stopped at the first rung, as without the kill
    assert all(r["status"] == "ok" for r in rows.values()) and float(rows["top_k"]["final_reward"]) < float(
        rows["none"]["final_reward"])
    # the trials' own logs agree: the weak trial reported one iteration
    trial_dirs = [d for d in glob.glob(str(experiment / "LMPPO_*")) if os.path.isdir(d)]
    logged = sorted(len(open(os.path.join(d, "result.json")).read().splitlines()) for d in trial_dirs)
    assert logged == [1, 4], logged


def test_asha_from_the_config_stops_a_trial_below_the_rung_and_fifo_has_no_scheduler():
    """The scheduler agents.train hands Tune, fed results as Tune reports them (flattened keys)."""
    from types import SimpleNamespace

    from ray.tune.schedulers import TrialScheduler

    from agents.config import load
    from agents.pbt import make_scheduler

    assert make_scheduler(load(QUICKSTART, ["tune.scheduler=fifo"])) is None
    metric = "env_runners/episode_return_mean"

    def decisions(mode, rewards):
        cfg = load(QUICKSTART, ["tune.scheduler=asha", "tune.grace_period=1", "tune.reduction_factor=2",
                                "stop.training_iteration=4", f"tune.mode={mode}"])
        scheduler = make_scheduler(cfg)
        trials = {name: SimpleNamespace(trial_id=name) for name in rewards}
        for trial in trials.values():
            scheduler.on_trial_add(None, trial)
        out = {name: [] for name in rewards}
        for it in range(1, 5):  # one trial after the other reports iteration it
            for name, curve in rewards.items():
                if out[name][-1:] != [TrialScheduler.STOP]:
                    out[name].append(scheduler.on_trial_result(
                        None, trials[name], {"training_iteration": it, metric: curve[it - 1]}))
        return out

    good, weak = [0.40, 0.45, 0.50, 0.55], [0.10, 0.10, 0.10, 0.10]
    got = decisions("max", {"good": good, "weak": weak})
    assert got["good"] == [TrialScheduler.CONTINUE] * 3 + [TrialScheduler.STOP]  # stopped by max_t only
    assert got["weak"] == [TrialScheduler.STOP]  # below the good trial at the first rung (grace period 1)
    got = decisions("min", {"good": good, "weak": weak})  # tune.mode min: the low curve is now the better one
    assert got["weak"] == [TrialScheduler.CONTINUE] * 3 + [TrialScheduler.STOP]


def test_asha_rungs_saved_and_restored_decide_as_before(tmp_path):
    """ResumableASHA's save and restore (what agents.experiment_store calls at each save of the
    experiment's state and after --resume re-added the trials): a restored scheduler stops a trial
    below the rung the saved one recorded, as the saved one does."""
    from types import SimpleNamespace

    from ray.tune.schedulers import TrialScheduler

    from agents.config import load
    from agents.pbt import make_scheduler

    metric = "env_runners/episode_return_mean"
    cfg = load(QUICKSTART, ["tune.scheduler=asha", "tune.grace_period=1", "tune.reduction_factor=2",
                            "stop.training_iteration=4"])
    before = make_scheduler(cfg)
    good, weak = SimpleNamespace(trial_id="good"), SimpleNamespace(trial_id="weak")
    before.on_trial_add(None, good)
    for it, reward in ((1, 0.4), (2, 0.45), (3, 0.5), (4, 0.55)):
        before.on_trial_result(None, good, {"training_iteration": it, metric: reward})
    before.on_trial_complete(None, good, {"training_iteration": 4, metric: 0.55})
    before.save(str(tmp_path / "scheduler_state.json"))
    after = make_scheduler(cfg)  # a new driver's, from the same config
    after.on_trial_add(None, weak)
    after.restore(str(tmp_path / "scheduler_state.json"))
    assert after.on_trial_result(None, weak, {"training_iteration": 1, metric: 0.1}) == TrialScheduler.STOP
    fresh = make_scheduler(cfg)  # what --resume had before: empty rungs let the weak trial go on
    fresh.on_trial_add(None, weak)
    assert fresh.on_trial_result(None, weak, {"training_iteration": 1, metric: 0.1}) == TrialScheduler.CONTINUE
