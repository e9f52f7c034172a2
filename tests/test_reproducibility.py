"""Reproducible runs: the same seed gives the same curves, and a checkpoint resumes exactly.

Every iteration's mean episode return and learner losses are compared exactly (==, not
approx): on CPU with one process sampling and learning (`num_env_runners: 0`) the runs are
bit-for-bit deterministic. A different seed must give other numbers, so the comparisons can fail.
"""
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from agents.config import algorithm_config, load, read_yaml, validate
from agents.progress import _metric
from tests.conftest import QUICKSTART, ROOT, let_the_storage_copy_finish, logged_iterations

TINY = ["training.train_batch_size=256", "training.minibatch_size=128", "training.num_epochs=2",
        "env_runners.num_envs_per_env_runner=8", "env.max_new_tokens=10"]
A2C = ["algorithm=a3c", "training.train_batch_size=160", "env_runners.num_envs_per_env_runner=8",
       "env.max_new_tokens=10", "env_runners.num_env_runners=0"]
DQN_YAML = os.path.join(ROOT, "tune_configs", "dqn_synthetic.yaml")
DQN = ["training.train_batch_size=64", "dqn.learning_starts=40", "dqn.epsilon_steps=400", "env.max_new_tokens=10",
       "env_runners.num_envs_per_env_runner=4", "evaluation.interval=0", "dqn.target_update_every=100"]
SELF_CRITICAL_YAML = os.path.join(ROOT, "tune_configs", "self_critical_synthetic.yaml")
GUIDE_SPEC = "agents.guides:noisy_increasing_numbers"  # draws from Python's `random`
PPO_PP = ["algorithm=ppo_pp", f"guide.callable={GUIDE_SPEC}", "guide.beta=0.5"]

# What a user compares between runs: the reward curve and the learner's losses.
CURVE_KEYS = ("env_runners/episode_return_mean", "env_runners/num_env_steps_sampled_lifetime",
              "learners/default_policy/policy_loss", "learners/default_policy/vf_loss",
              "learners/default_policy/entropy", "learners/default_policy/total_loss",
              "learners/default_policy/mle_nll", "learners/default_policy/qf_loss",
              "learners/default_policy/td_error_mean", "env_runners/policy_return_mean")


def curve(result: dict) -> dict:
    return {k: v for k in CURVE_KEYS if (v := _metric(result, k)) is not None}


def train(cfg: dict, iterations: int, *, checkpoint_at: int | None = None, path=None):
    """Per-iteration curves of a fresh run; with `checkpoint_at`, also saves a checkpoint then."""
    algo = algorithm_config(cfg).build_algo()
    try:
        curves = []
        for i in range(1, iterations + 1):
            curves.append(curve(algo.train()))
            if i == checkpoint_at:
                algo.save_to_path(str(path))
        return curves
    finally:
        algo.stop()


def resumed(cfg: dict, path, iterations: int):
    """Curves of `iterations` more iterations of a run restored from the checkpoint at `path`."""
    algo = algorithm_config(cfg).build_algo()
    try:
        algo.restore_from_path(str(path))
        return [curve(algo.train()) for _ in range(iterations)]
    finally:
        algo.stop()


def assert_reproducible(cfg: dict, other_seed: dict, iterations: int = 3):
    first, second = train(cfg, iterations), train(cfg, iterations)
    assert all(len(c) >= 3 for c in first), first  # a reward and losses were compared
    assert first == second
    assert train(other_seed, iterations) != first


def ppo_cfg(*overrides, seed=0):
    """The quickstart's config with overrides; as A3C without its PPO-only minibatch keys."""
    raw = read_yaml(QUICKSTART, [*TINY, *overrides, f"seed={seed}"])
    if raw.get("algorithm") == "a3c":
        for key in ("minibatch_size", "num_epochs"):
            raw["training"].pop(key, None)
    return validate(raw)


@pytest.mark.slow
def test_ppo_same_seed_same_curves(ray_local):
    assert_reproducible(ppo_cfg(), ppo_cfg(seed=1))


@pytest.mark.slow
def test_a2c_same_seed_same_curves(ray_local):
    assert_reproducible(ppo_cfg(*A2C), ppo_cfg(*A2C, seed=1))


@pytest.mark.slow
def test_dqn_same_seed_same_curves(ray_local):
    assert_reproducible(load(DQN_YAML, DQN), load(DQN_YAML, [*DQN, "seed=1"]), iterations=4)


@pytest.mark.slow
def test_ppo_pp_with_a_random_callable_guide_same_seed_same_curves(ray_local):
    assert_reproducible(ppo_cfg(*PPO_PP), ppo_cfg(*PPO_PP, seed=1))


@pytest.mark.slow
def test_self_critical_same_seed_same_curves(ray_local):
    small = ["training.train_batch_size=256", "training.minibatch_size=128", "env_runners.num_envs_per_env_runner=8",
             "env.max_new_tokens=10"]
    assert_reproducible(load(SELF_CRITICAL_YAML, small), load(SELF_CRITICAL_YAML, [*small, "seed=1"]))


def _sampled(episodes):
    return [(e.get_observations()["input_ids"][0].tolist(), e.get_actions().tolist(),
             e.get_extra_model_outputs("action_logp").tolist()) for e in episodes]


def _lm_guide(raw: dict, directory) -> str:
    """A tiny causal LM with the task's tokenizer saved in `directory` (an LM guide for `raw`)."""
    from agents.config import env_config
    from agents.models import build_causal_lm
    from env.text_env import TokenGenerationEnv

    tokenizer = TokenGenerationEnv(env_config(validate(raw))).tokenizer
    build_causal_lm({"name_or_path": "tiny-gpt2"}, tokenizer, seed=7, max_positions=16).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("guided", [None, "callable", "lm"])
def test_env_runner_state_restores_the_next_sample_exactly(guided, tmp_path):
    """An EnvRunner built afresh and given another's state samples what that one samples next
    (after a weight sync, as in training): the same prompts, tokens and log-probs,
    including the episodes carried over, the guide's roll-in plans, an LM guide's draws and the
    process generators."""
    from agents.env_runner import ROLLOUT_STATE, FastTokenEnvRunner

    raw = {"task": {"name": "increasing_numbers", "num_numbers": 20}, "model": {"name_or_path": "tiny-gpt2"},
           "env": {"max_prompt_len": 4, "max_new_tokens": 6}, "seed": 3,
           "training": {"train_batch_size": 40, "minibatch_size": 40},
           "env_runners": {"num_env_runners": 0, "num_envs_per_env_runner": 5}}
    if guided == "callable":
        raw.update(algorithm="ppo_pp", guide={"callable": GUIDE_SPEC, "beta": 0.7})
    elif guided == "lm":
        raw.update(algorithm="ppo_pp", guide={"name_or_path": _lm_guide(raw, tmp_path / "guide"), "beta": 0.7})
    config = algorithm_config(validate(raw))
    first = FastTokenEnvRunner(config=config)
    if guided:  # the algorithm sets the roll-in mode each iteration (a runner starts at none)
        from agents.algorithms.guided import _set_guide_mode
        _set_guide_mode(first, "ppo_pp")
    episodes = first.sample()
    if guided:  # the guide took steps
        assert sum(int((e.get_extra_model_outputs("guide_role") != 0).sum()) for e in episodes) > 0
    assert first._rollout.active.any()  # episodes are carried over to the next call
    state = first.get_state()
    assert ROLLOUT_STATE in state
    # Weights arrive between two training calls (and drop the KV caches): a prefill and a cached
    # step round differently in the last bits, so the comparison follows training's order.
    first.set_state(state)
    expected = _sampled(first.sample()) + _sampled(first.sample())

    second = FastTokenEnvRunner(config=config)
    second.set_state(state)
    got = _sampled(second.sample()) + _sampled(second.sample())
    assert got == expected
    fresh = FastTokenEnvRunner(config=config)  # without the state: a run that starts over
    fresh.set_state({k: v for k, v in state.items() if k != ROLLOUT_STATE})
    assert _sampled(fresh.sample()) + _sampled(fresh.sample()) != expected
    for runner in (first, second, fresh):
        runner.stop()


RESUMABLE = {
    "ppo": [],
    "a2c": A2C,
    "ppo_pp": PPO_PP,
    "ppo_mirostat_mle": "mle",
}


def mle_cfg(seed=0):
    """PPO + the MLE term on a task with references, acting through mirostat (state per row)."""
    return validate({"algorithm": "ppo", "seed": seed, "task": {"name": "sort_numbers", "num_numbers": 20, "length": 5},
                     "model": {"name_or_path": "tiny-gpt2"}, "env": {"max_prompt_len": 5, "max_new_tokens": 6},
                     "training": {"train_batch_size": 256, "minibatch_size": 128, "num_epochs": 2,
                                  "mle_coef": 0.5, "mle_batch_size": 4},
                     "sampler": {"name": "mirostat", "tau": 3.0, "learning_rate": 0.5},
                     "env_runners": {"num_env_runners": 0, "num_envs_per_env_runner": 8}})


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESUMABLE))
def test_restored_checkpoint_continues_exactly_as_the_uninterrupted_run(ray_local, tmp_path, name):
    """Checkpoint after iteration 2; a new algorithm restored from it gives iterations 3-5 exactly as
    the run that went on (carried episodes, env and guide generators, MLE draws, sampler state)."""
    cfg = mle_cfg() if RESUMABLE[name] == "mle" else ppo_cfg(*RESUMABLE[name])
    uninterrupted = train(cfg, 5, checkpoint_at=2, path=tmp_path / "ckpt")
    again = resumed(cfg, tmp_path / "ckpt", 3)
    assert again == uninterrupted[2:]
    if name == "ppo_mirostat_mle":
        assert "learners/default_policy/mle_nll" in again[0]


def test_resumed_wandb_run_logs_only_the_steps_it_does_not_hold(tmp_path, monkeypatch):
    """W&B offline: a first run logs iterations 1-5 and dies; the resumed run (same id) is handed
    iterations 4-8 again from the checkpoint: the run files hold 1..8, each once."""
    import wandb

    from agents.workarounds import SkipLoggedSteps, wandb_logged_steps

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    kwargs = dict(project="repro", id="trial0001", dir=str(tmp_path), resume="allow", reinit=True)
    first = SkipLoggedSteps(wandb, str(tmp_path))
    started = time.time()
    run = first.init(**kwargs)
    for step in range(1, 6):
        first.log({"episode_return_mean": step / 10}, step=step)
    run.finish()
    wandb.teardown()  # the W&B service has written the run file
    assert wandb_logged_steps(str(tmp_path), "trial0001") == [1, 2, 3, 4, 5]

    # W&B names a run's directory by its start time to the second: a resumed run started within
    # the same second as the first would share (and overwrite) its directory. A real resume comes
    # at least an iteration later; this one waits for the next second.
    time.sleep(max(0.0, started + 1.1 - time.time()))
    again = SkipLoggedSteps(wandb, str(tmp_path))
    run = again.init(**kwargs)
    assert again.last_logged == 5
    for step in range(4, 9):
        again.log({"episode_return_mean": step / 10}, step=step)
    run.finish()
    wandb.teardown()  # the W&B service has written the run file
    assert sorted(wandb_logged_steps(str(tmp_path), "trial0001")) == list(range(1, 9))
    assert wandb_logged_steps(str(tmp_path), "other") == []


def _cli(args, **kwargs):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    return subprocess.Popen([sys.executable, "-m", "agents.train", QUICKSTART, *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, **kwargs)


def _result_curves(experiment_dir) -> dict[int, dict]:
    (trial_dir,) = [d for d in glob.glob(os.path.join(experiment_dir, "LMPPO_*")) if os.path.isdir(d)]
    with open(os.path.join(trial_dir, "result.json")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return trial_dir, rows[0]["trial_id"], {r["training_iteration"]: curve(r) for r in rows}


@pytest.mark.slow
def test_run_killed_after_a_checkpoint_and_resumed_matches_the_uninterrupted_run(tmp_path):
    """`agents.train` killed (SIGKILL, driver and Ray) after iteration 5, resumed with --resume from
    its last checkpoint: every iteration's reward and losses equal those of a run never killed
    (so the restored policy is the trained one), result.json, progress.csv and TensorBoard hold
    each iteration once, and the resumed W&B (offline) run logs no iteration the killed run's
    files already hold. Then the finished run is trained longer (`--resume` with a later
    stop.training_iteration) with its newest checkpoint damaged: it goes back to the one before,
    and the iterations it runs again and adds equal the uninterrupted longer run's."""
    common = [*[a for o in TINY for a in ("--set", o)], "--set", "stop.training_iteration=6",
              "--set", "checkpoint.frequency=2", "--set", "generate.num_samples=0", "--set", "tune.dashboard=false",
              "--set", f"tune.storage_path={tmp_path}", "--set", "tune.wandb=true",
              # the experiment state (what --resume starts from) saved often enough that the kill
              # after iteration 5 finds a checkpoint in it however fast the iterations run
              "--set", "checkpoint.state_every_s=0.2"]
    whole = _cli([*common, "--set", "tune.name=whole", "--set", "stop.training_iteration=7"])
    out = whole.communicate(timeout=900)[0]
    assert whole.returncode == 0, out[-3000:]

    killed = _cli([*common, "--set", "tune.name=killed"])
    seen = []
    try:
        for line in killed.stdout:
            m = re.match(r"iter +(\d+) ", line)
            if m:
                seen.append(int(m.group(1)))
                if seen[-1] == 5:
                    let_the_storage_copy_finish(killed.pid, tmp_path / "killed")
                    break
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
    assert seen == [1, 2, 3, 4, 5]
    resumed_run = _cli([*common, "--set", "tune.name=killed", "--resume"])
    out = resumed_run.communicate(timeout=900)[0]
    assert resumed_run.returncode == 0, out[-3000:]
    assert "other code than it started with" not in out  # the same code resumed it (versions.json)
    printed = [int(i) for i in re.findall(r"^iter +(\d+) ", out, re.M)]
    # after the checkpoint of iteration 2 or 4, once per iteration, up to the stop
    assert printed and printed[0] in (3, 5) and printed == list(range(printed[0], 7)), out[-3000:]
    # the summary covers the iterations before the resume too
    assert re.search(r"mean episode reward [\d.]+ \(iteration 1\) -> [\d.]+ \(iteration 6\)", out), out[-3000:]

    _, _, expected = _result_curves(tmp_path / "whole")
    trial_dir, trial_id, got = _result_curves(tmp_path / "killed")
    assert sorted(got) == list(range(1, 7)) and sorted(expected) == list(range(1, 8))
    for i in range(1, 7):
        assert got[i] == expected[i], (i, got[i], expected[i])
    assert got[6] != got[5]  # the curve moves: equal rows are not a constant
    # The curve users look at has each iteration once: the repeated ones replaced the lost ones.
    for where, its in logged_iterations(trial_dir).items():
        assert its == list(range(1, 7)), (where, its)

    from agents.workarounds import wandb_logged_steps, wandb_run_file_steps

    # W&B's offline writer keeps its last partial 32 KiB block in memory, so a SIGKILL loses the
    # newest records (often all of the killed run's): what the run files hold must have no
    # iteration twice, and the resumed run starts after the last one the killed run kept.
    runs = sorted(glob.glob(os.path.join(trial_dir, "wandb", f"offline-run-*-{trial_id}", "run-*.wandb")))
    assert len(runs) == 2, runs
    killed_steps, resumed_steps = (wandb_run_file_steps(r) for r in runs)
    steps = killed_steps + resumed_steps
    assert steps == wandb_logged_steps(trial_dir, trial_id)
    assert len(steps) == len(set(steps)) and set(steps) <= set(range(1, 7)), (killed_steps, resumed_steps)
    assert all(s > max(killed_steps, default=0) for s in resumed_steps), (killed_steps, resumed_steps)
    assert resumed_steps, "the resumed run logged nothing to W&B"

    # Train longer, the newest checkpoint (iteration 6) damaged meanwhile (its policy's weights cut
    # short, e.g. by a full disk): found by the list of files its save wrote last, refused by
    # generate, and the trial goes on from the one before (iteration 4), its iterations 5-7 equal
    # to the uninterrupted run's (before: an unpickling error in the trial at every resume).
    from agents.generate import load_policy
    from agents.saved_policy import MODULE_SUBDIR
    from agents.whole_files import MANIFEST

    checkpoints = sorted(glob.glob(os.path.join(trial_dir, "checkpoint_*")))
    assert all(os.path.isfile(os.path.join(c, MANIFEST)) for c in checkpoints), checkpoints
    weights = os.path.join(checkpoints[-1], MODULE_SUBDIR, "module_state.pkl")
    size = os.path.getsize(weights)
    os.truncate(weights, 100)
    with pytest.raises(ValueError, match=rf"^--checkpoint: {re.escape(checkpoints[-1])} is damaged: "
                                         rf"{MODULE_SUBDIR}/module_state.pkl holds 100 bytes of {size:,}$"):
        load_policy(checkpoints[-1])
    from tests.conftest import assert_refused_lightly  # serve: before Ray, torch or Serve are imported

    assert_refused_lightly("agents.serve", [(["--checkpoint", checkpoints[-1]], (
        f"error: --checkpoint: {checkpoints[-1]} is damaged: {MODULE_SUBDIR}/module_state.pkl holds 100 bytes of {size:,}"))])
    longer = _cli([*common, "--set", "tune.name=killed", "--set", "stop.training_iteration=7", "--resume"])
    out = longer.communicate(timeout=900)[0]
    assert longer.returncode == 0, out[-3000:]
    assert "--resume: the run goes on with other stop criteria: stop.training_iteration 6 -> 7" in out, out[-3000:]
    assert "--resume: 1 of 1 ended trials go on to the new stop criteria\n" in out, out[-3000:]
    assert (f"'s checkpoint {os.path.basename(checkpoints[-1])} is damaged ({MODULE_SUBDIR}/module_state.pkl holds "
            f"100 bytes of {size:,}) in {trial_dir}; it goes on from its newest one left, "
            f"{os.path.basename(checkpoints[-2])} (iteration 4)") in out, out[-3000:]
    assert re.findall(r"^iter +(\d+) ", out, re.M) == ["5", "6", "7"], out[-3000:]
    _, _, got = _result_curves(tmp_path / "killed")
    assert sorted(got) == list(range(1, 8)), sorted(got)
    for i in range(5, 8):
        assert got[i] == expected[i], (i, got[i], expected[i])
    for where, its in logged_iterations(trial_dir).items():
        assert its == list(range(1, 8)), (where, its)


def test_saving_the_experiment_state_does_not_grow_the_driver():
    # Tune saves each trial's recent metric values (deques, numpy scalars) through its JSON
    # encoder every few seconds; each distinct value used to stay in the driver for good.
    import collections
    import json

    import numpy as np
    from ray.tune.utils.serialization import TuneFunctionEncoder
    from ray.util import debug

    from agents.workarounds import make_log_once_pruner

    pruner = make_log_once_pruner(every_s=0.0)
    debug._logged.add("an unrelated warning")
    sizes = []
    for save in range(5):
        for metric in range(200):
            json.dumps({"last-5": collections.deque([save * 1000 + metric + 0.5], maxlen=5),
                        "last": np.float32(save * 1000 + metric)}, cls=TuneFunctionEncoder)
        pruner.on_step_end(iteration=save, trials=[])
        sizes.append(len(debug._logged))
    assert sizes == [sizes[0]] * 5, sizes
    assert "an unrelated warning" in debug._logged  # Ray's other one-time warnings stay once


def _driver_refs_during_a_long_trial(tmp_path, name: str) -> tuple[int, int]:
    """(references the driver holds at iteration 100 of a 120-iteration trial, iterations reported)."""
    import ray
    from ray import tune

    class Count(tune.Trainable):
        def step(self):
            return {"payload": [float(self.iteration)] * 500}  # a result of a few KB, as a trainer's is

    seen = {}

    class Probe(tune.Callback):
        def on_trial_result(self, iteration, trials, trial, result, **info):
            seen["last"] = result["training_iteration"]
            if result["training_iteration"] == 100:
                seen["refs"] = len(ray._private.worker.global_worker.core_worker.get_all_reference_counts())

    tune.Tuner(Count, run_config=tune.RunConfig(name=name, storage_path=str(tmp_path), verbose=0, callbacks=[Probe()],
                                                stop={"training_iteration": 120})).fit()
    return seen["refs"], seen["last"]


def test_a_long_trial_does_not_keep_its_results_in_the_driver(ray_local, tmp_path, monkeypatch):
    # Tune's actor manager kept a reference to every task it had run on a trial's actor (one per
    # iteration) until the trial ended: the driver grew by a result per iteration.
    from ray.air.execution._internal.actor_manager import RayActorManager

    from agents.workarounds import release_resolved_task_futures

    release_resolved_task_futures()
    patched = RayActorManager._schedule_tracked_actor_task
    refs, last = _driver_refs_during_a_long_trial(tmp_path, "fixed")
    assert last == 120 and refs < 20, refs
    monkeypatch.setattr(RayActorManager, "_schedule_tracked_actor_task", patched.original)
    refs, last = _driver_refs_during_a_long_trial(tmp_path, "stock")
    assert last == 120 and refs >= 100, refs  # Ray's own behaviour; when this fails, Ray fixed it upstream


def test_resume_refuses_an_experiment_state_cut_short_in_one_line(tmp_path):
    """A driver killed while Tune copied its experiment to the storage path leaves empty files;
    --resume says so instead of starting afresh or waiting for a trial that never starts."""
    from agents.experiment_store import check_experiment_state

    state = tmp_path / "experiment_state-2026-11-24_12-41-31.json"
    state.write_text("")
    with pytest.raises(ValueError, match="empty or cut short"):
        check_experiment_state(str(tmp_path))
    state.write_text('{"trial_data": []}')
    check_experiment_state(str(tmp_path))  # a whole state passes


@pytest.mark.slow
def test_a_resume_whose_newest_checkpoint_is_gone_goes_on_from_the_one_before(tmp_path, capsys):
    """The newest checkpoint of a finished run deleted (by hand, a lost disk), then trained longer
    with --resume: the trial goes on from the checkpoint before it, says so in one line, and its
    curve holds each iteration once (before: the trial failed at every resume, "does not exist on
    storage anymore"). A damaged newest checkpoint: the kill test's last step."""
    import shutil

    from agents.train import main

    common = [*[a for o in TINY for a in ("--set", o)], "--set", "checkpoint.frequency=1", "--set",
              "generate.num_samples=0", "--set", "tune.dashboard=false", "--set", f"tune.storage_path={tmp_path}",
              "--set", "tune.name=run"]
    assert main([QUICKSTART, *common, "--set", "stop.training_iteration=3"]) == 0
    (trial_dir,) = [d for d in glob.glob(str(tmp_path / "run" / "LMPPO_*")) if os.path.isdir(d)]
    checkpoints = sorted(glob.glob(os.path.join(trial_dir, "checkpoint_*")))
    shutil.rmtree(checkpoints[-1])
    capsys.readouterr()
    assert main([QUICKSTART, *common, "--set", "stop.training_iteration=4", "--resume"]) == 0
    out = capsys.readouterr().out
    assert (f"'s checkpoint {os.path.basename(checkpoints[-1])} is gone from {trial_dir}; it goes on from its "
            f"newest one left, {os.path.basename(checkpoints[-2])} (iteration 2)") in out, out[-3000:]
    assert re.findall(r"^iter +(\d+) ", out, re.M) == ["3", "4"], out[-3000:]
    for where, its in logged_iterations(trial_dir).items():
        assert its == [1, 2, 3, 4], (where, its)
