"""Population Based Training from YAML (`tune.scheduler: pbt`): the config's checks, the
mutations as Tune and RLlib get them, and a run in which the weak trial takes the strong one's
checkpoint and goes on with a perturbed learning rate that its learner really steps with."""
import glob
import json
import math
import os
import types

import numpy as np
import pytest

from agents.config import ConfigError, PBT_MUTABLE, algorithm_config, load, pbt_mutations
from agents.pbt import KeepInBounds
from tests.conftest import QUICKSTART, ROOT, one_line_cli_error
from tests.conftest import run_module as run

PBT_YAML = os.path.join(ROOT, "tune_configs", "pbt_quickstart.yaml")
PBT = ["tune.scheduler=pbt", "tune.num_samples=2", "tune.hyperparam_mutations={training.lr: [1.0e-4, 1.0e-3]}"]


def error(*overrides, path=QUICKSTART) -> str:
    with pytest.raises(ConfigError) as e:
        load(path, list(overrides))
    message = str(e.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("overrides, message", [
    (["tune.hyperparam_mutations={training.lrr: [1.0e-4]}"],
     "tune.hyperparam_mutations.training.lrr: not a hyperparameter of the run (did you mean 'training.lr'?)"),
    (["tune.hyperparam_mutations={reward.kl_coef: [0.0, 0.01]}"],
     "tune.hyperparam_mutations.reward.kl_coef: not mutable by PBT (its KL controller's coefficient is restored"),
    (["tune.hyperparam_mutations={training.num_epochs: [2, 4]}"],
     "tune.hyperparam_mutations.training.num_epochs: not mutable by PBT; it mutates training.lr, "),
    (["tune.hyperparam_mutations={model.name_or_path: [tiny-gpt2]}"],
     "tune.hyperparam_mutations.model.name_or_path: not mutable by PBT"),
    (["tune.hyperparam_mutations={training: [1, 2]}"],
     "tune.hyperparam_mutations.training: name one hyperparameter by its key path, e.g. training.lr"),
    (["tune.hyperparam_mutations={training.lr: {randint: [1, 3]}}"],
     "tune.hyperparam_mutations.training.lr: randint is not a PBT mutation"),
    (["tune.hyperparam_mutations={training.lr: 0.001}"],
     "tune.hyperparam_mutations.training.lr: expected a search space"),
    (["tune.hyperparam_mutations={training.gamma: {uniform: [0.9, 1.1]}}"],
     "tune.hyperparam_mutations.training.gamma: expected a number in [0.0, 1.0], got 1.1"),
    (["tune.hyperparam_mutations={training.lr: {loguniform: [0.0, 1.0e-3]}}"],
     "tune.hyperparam_mutations.training.lr.loguniform: bounds must be > 0"),
    (["tune.hyperparam_mutations={training.lr: []}"], "tune.hyperparam_mutations.training.lr: expected a search space"),
    (["training.lr_end=1.0e-5", "training.lr_decay_steps=1000"],
     "tune.hyperparam_mutations.training.lr: PBT mutates a constant lr; training.lr_end and training.lr_decay_steps"),
    (["tune.hyperparam_mutations={}"], "tune.hyperparam_mutations: PBT needs at least one hyperparameter to mutate"),
    (["tune.num_samples=1"], "tune.num_samples: PBT needs a population of at least 2 trials"),
    (["checkpoint.num_to_keep=2"], "checkpoint.num_to_keep: PBT restores trials from other trials' checkpoints"),
    (["tune.grace_period=3"], "tune.grace_period: only used by tune.scheduler asha (this config's scheduler is 'pbt')"),
    (["tune.quantile_fraction=0.6"], "tune.quantile_fraction: expected a number in (0.0, 0.5], got 0.6"),
    (["tune.perturbation_interval=0"], "tune.perturbation_interval: expected an integer >= 1, got 0"),
])
def test_pbt_config_errors_name_the_field_in_one_line(overrides, message):
    assert error(*PBT, *overrides).startswith(message)


def test_a_key_the_algorithm_does_not_read_is_refused():
    got = error("algorithm=dqn", *PBT, "tune.hyperparam_mutations={training.entropy_coeff: [0.0, 0.01]}",
                path=os.path.join(ROOT, "tune_configs", "dqn_synthetic.yaml"))
    assert got == "tune.hyperparam_mutations.training.entropy_coeff: not used by algorithm 'dqn'"


@pytest.mark.parametrize("key", ["perturbation_interval=5", "hyperparam_mutations={training.lr: [1.0e-3]}",
                                 "quantile_fraction=0.5", "resample_probability=0.5"])
@pytest.mark.parametrize("scheduler", ["fifo", "asha"])
def test_pbt_keys_with_another_scheduler_are_refused(scheduler, key):
    got = error(f"tune.scheduler={scheduler}", f"tune.{key}")
    name = key.split("=")[0]
    assert got == f"tune.{name}: only used by tune.scheduler pbt (this config's scheduler is {scheduler!r})"


def test_the_cli_refuses_an_unmutable_key_in_one_line(capsys):
    from agents.train import main

    err = one_line_cli_error(capsys, main, QUICKSTART, *[f"--set={o}" for o in PBT],
                             "--set", "tune.hyperparam_mutations.env.max_new_tokens=[10, 20]")
    assert err.startswith("error: tune.hyperparam_mutations.env.max_new_tokens: not mutable by PBT")


def test_mutations_reach_the_rllib_config_under_the_names_tune_perturbs():
    """Each mutable key path names the RLlib config key that carries the YAML's value (the key
    PBT perturbs in a trial's config), a key of RLlib's own config."""
    from ray.rllib.algorithms.ppo import PPOConfig

    for i, path in enumerate(PBT_MUTABLE):
        section, key = path.split(".")
        value = 0.4321 + i / 1000  # a value no other key holds
        cfg = load(QUICKSTART, [*PBT, f"{path}={value}"])
        params = algorithm_config(cfg).to_dict()
        assert params[PBT_MUTABLE[path]] == value, path
        assert [k for k, v in params.items() if v == value] == [PBT_MUTABLE[path]], path
        assert PBT_MUTABLE[path] in PPOConfig().to_dict(), path  # a key RLlib's own config has


def test_mutations_as_tune_gets_them_and_the_starting_values():
    from ray.tune.schedulers import PopulationBasedTraining
    from ray.tune.search.sample import Float

    from agents.pbt import make_scheduler

    cfg = load(PBT_YAML)
    mutations, bounds = pbt_mutations(cfg)
    assert set(mutations) == {"lr", "entropy_coeff"}
    assert isinstance(mutations["lr"], Float) and bounds == {"lr": (1e-4, 1e-2)}
    assert mutations["entropy_coeff"] == [0.0, 0.002, 0.005, 0.01]
    assert isinstance(make_scheduler(cfg), PopulationBasedTraining)
    # Set in the YAML: trials start there (here a grid, one trial per value) ...
    assert cfg["training"]["lr"] == {"grid_search": [1e-5, 1e-4, 1e-3, 3e-3]}
    assert cfg["training"]["entropy_coeff"] == 0.005
    # ... not set: each trial starts from a draw of the mutation's space, as Tune does.
    cfg = load(QUICKSTART, [*PBT, "tune.hyperparam_mutations={training.clip_param: {grid_search: [0.1, 0.3]}, "
                                  "training.vf_clip_param: {uniform: [1.0, 5.0]}}"])
    assert cfg["training"]["clip_param"] == {"choice": [0.1, 0.3]}
    assert cfg["training"]["vf_clip_param"] == {"uniform": [1.0, 5.0]}
    assert pbt_mutations(cfg)[0]["clip_param"] == [0.1, 0.3]
    # --set writes the key path as nested sections: the same mutation.
    nested = load(QUICKSTART, [*PBT, "tune.hyperparam_mutations.training.lr=[1.0e-4, 1.0e-3]"])
    assert nested["tune"]["hyperparam_mutations"] == {"training.lr": [1e-4, 1e-3]}


def test_perturbed_values_are_kept_within_the_search_space():
    keep = KeepInBounds({"lr": (1e-4, 1e-2), "gamma": (0.9, 1.0)})
    assert keep({"lr": 1.2e-2, "gamma": 0.99, "other": 7}) == {"lr": 1e-2, "gamma": 0.99, "other": 7}
    assert keep({"lr": 0.8e-4, "gamma": 1.188}) == {"lr": 1e-4, "gamma": 1.0}


def test_pbt_checkpoints_what_it_clones_so_periodic_checkpoints_default_to_off_and_all_are_kept():
    ck = load(PBT_YAML)["checkpoint"]  # neither is set there: not the schema's 10 and 3
    assert ck["frequency"] == 0 and ck["num_to_keep"] is None
    ck = load(PBT_YAML, ["checkpoint.frequency=4", "checkpoint.num_to_keep=5"])["checkpoint"]  # as written
    assert ck["frequency"] == 4 and ck["num_to_keep"] == 5
    assert load(QUICKSTART, PBT)["checkpoint"]["frequency"] == 10  # quickstart.yaml sets 10
    assert load(QUICKSTART)["checkpoint"]["num_to_keep"] == 3  # other schedulers: the schema's default


def test_trials_keep_running_at_perturbations_only_when_the_whole_population_fits():
    from agents.config import population
    from agents.train import population_runs_at_once

    cfg = load(PBT_YAML)  # 4 trials of 0.5 CPU, 4 at a time
    assert population(cfg) == 4
    assert population_runs_at_once(cfg, {"CPU": 2.0})
    assert not population_runs_at_once(cfg, {"CPU": 1.5})  # they take turns: Tune pauses them
    assert not population_runs_at_once(load(PBT_YAML, ["tune.max_concurrent_trials=3"]), {"CPU": 8.0})
    assert population(load(PBT_YAML, ["tune.num_samples=3"])) == 12


def test_a_restored_learner_steps_with_its_configured_constant_lr():
    """A loaded optimizer state carries the lr it was saved with; use_configured_lr (called after
    the learners' set_state) puts the config's back, and leaves a scheduled lr alone."""
    from types import SimpleNamespace

    import torch

    from agents.algorithms.base import use_configured_lr

    def learner(lr):
        optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=3e-3)  # as restored
        return optimizer, SimpleNamespace(
            module={"default_policy": None}, get_optimizers_for_module=lambda mid: [("default_optimizer", optimizer)],
            config=SimpleNamespace(get_config_for_module=lambda mid: SimpleNamespace(lr=lr)))

    optimizer, restored = learner(3.6e-3)
    use_configured_lr(restored)
    assert [g["lr"] for g in optimizer.param_groups] == [3.6e-3]
    optimizer, restored = learner([[0, 1e-3], [1000, 1e-5]])  # a schedule: the restored value stays
    use_configured_lr(restored)
    assert [g["lr"] for g in optimizer.param_groups] == [3e-3]


@pytest.mark.slow
def test_pbt_run_clones_the_strong_trials_checkpoint_into_the_weak_one_with_a_perturbed_lr(tmp_path):
    """Two trials of the PBT example, shrunk: lr 3e-3 and lr 1e-7 (which barely moves the policy).
    Every 2 iterations a trial that gets there is ranked against the other's last score: the
    strong one, on top, is saved by PBT (checkpoint.frequency is 0, and all are kept); the weak one, below, takes
    the strong one's last PBT checkpoint (iteration c) and its lr times 0.8 or 1.2
    (resample_probability 0). Which perturbation that is depends on when each trial gets there
    (the weak trial's actor may start seconds later; the strong one must not have finished, and
    must have been saved at a perturbation where the weak one had a score): 14 iterations leave
    room for a lag of a few iterations.

    On CPU with one process the project's checkpoints resume bit for bit, so at iteration c + 1
    the cloned trial samples exactly what the strong trial sampled then: same weights, env and
    RNG state. Its learner must step differently, though: with the strong trial's lr (which the
    restored optimizer state carries, and RLlib replaces only after the first update) its
    losses would be identical too."""
    out = run("agents.train", PBT_YAML, "--set", "training.lr={grid_search: [3.0e-3, 1.0e-7]}",
              "--set", "tune.hyperparam_mutations={training.lr: {loguniform: [1.0e-4, 1.0e-2]}}",
              "--set", "tune.perturbation_interval=2", "--set", "tune.resample_probability=0",
              "--set", "stop.training_iteration=14", "--set", "tune.max_concurrent_trials=2",
              "--set", "training.train_batch_size=512", "--set", "env_runners.num_envs_per_env_runner=8",
              "--set", "generate.num_samples=0", "--set", f"tune.storage_path={tmp_path}", "--set", "tune.name=pbt",
              "--set", "tune.dashboard=false", timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    experiment = tmp_path / "pbt"
    trials = {}
    for d in glob.glob(str(experiment / "LMPPO_*")):
        rows = {r["training_iteration"]: r for r in map(json.loads, open(os.path.join(d, "result.json")))}
        # Its first lr (PBT rewrites params.json with the config it gives a trial).
        trials["strong" if rows[1]["config"]["lr"] == 3e-3 else "weak"] = (d, rows)
    (strong_dir, strong), (_, weak) = trials["strong"], trials["weak"]
    assert sorted(strong) == list(range(1, 15))
    # The weak trial's curve: its own iterations 1..w, then the clone's from k = c + 1 on, c being
    # the iteration of the strong trial's checkpoint it took (c > w when the strong trial ran ahead;
    # the project drops the repeated iterations of a restored trial from result.json).
    w = max(i for i, r in weak.items() if r["config"]["lr"] == 1e-7)
    k = min(i for i, r in weak.items() if r["config"]["lr"] != 1e-7)
    c = k - 1
    assert sorted(weak) == list(range(1, w + 1)) + list(range(k, 15)) and c >= w, sorted(weak)

    # PBT's log: first, the weak trial cloned the strong one, from its lr 3e-3 to a perturbed one.
    with open(experiment / "pbt_global.txt") as f:
        exploits = [json.loads(line) for line in f]
    target, donor, _, _, donor_config, new_config = exploits[0]
    assert target.startswith("1_") and donor.startswith("0_") and donor_config["lr"] == 3e-3
    new_lr = new_config["lr"]
    assert any(math.isclose(new_lr, 3e-3 * f) for f in (0.8, 1.2)), new_lr
    assert os.path.exists(experiment / f"pbt_policy_{weak[1]['trial_id']}.txt")
    # PBT saved the strong trial at a perturbation: a checkpoint besides the final one.
    assert len(glob.glob(os.path.join(strong_dir, "checkpoint_*"))) >= 2
    # Both trials fit at once, so only a trial that cloned another restarted (no pause at a
    # perturbation; a clone's restored rows can replace an earlier clone's, hence <=).
    restarts = [i for _, rows in trials.values() for i, r in rows.items()
                if i > 1 and r["iterations_since_restore"] == 1]
    assert 1 <= len(restarts) <= len(exploits), (restarts, exploits)

    assert w % 2 == 0 and c % 2 == 0 and weak[c + 1]["iterations_since_restore"] == 1, (w, c)
    reward = "episode_return_mean"
    assert weak[w]["env_runners"][reward] < strong[w]["env_runners"][reward]
    # It runs the perturbed config, and its learner reports that lr.
    assert weak[c + 1]["config"]["lr"] == new_lr
    assert weak[c + 1]["learners"]["default_policy"]["default_optimizer_learning_rate"] == new_lr
    # It continued from the strong trial's checkpoint: it sampled what the strong trial sampled.
    for key in (reward, "num_env_steps_sampled_lifetime"):
        assert weak[c + 1]["env_runners"][key] == strong[c + 1]["env_runners"][key], key
    assert weak[c + 1]["env_runners"][reward] > weak[w]["env_runners"][reward]
    # ... and its updates used the new lr from the first minibatch on: same batch, other losses.
    for key in ("policy_loss", "entropy", "total_loss"):
        assert weak[c + 1]["learners"]["default_policy"][key] != strong[c + 1]["learners"]["default_policy"][key], key


@pytest.mark.parametrize("key", ["grace_period=3", "reduction_factor=2"])
def test_asha_keys_with_the_fifo_scheduler_are_refused_in_one_line(key):
    with pytest.raises(ConfigError) as err:
        load(QUICKSTART, ["tune.scheduler=fifo", f"tune.{key}"])
    name = key.split("=")[0]
    assert str(err.value) == f"tune.{name}: only used by tune.scheduler asha (this config's scheduler is 'fifo')"


@pytest.mark.slow
def test_a_pbt_run_killed_mid_way_resumes_and_finishes_every_trial(tmp_path):
    """The shrunk PBT example killed (SIGKILL, driver and Ray) after its trials passed a
    perturbation, then `--resume`d: the run finishes, each trial reaches the stop iteration, and
    the resumed trials go on from their checkpoints (not from iteration 1); then trained longer."""
    import re
    import signal
    import subprocess
    import sys

    from tests.conftest import let_the_storage_copy_finish

    # The second trial's actor may start seconds after the first, and a clone restarts from a
    # checkpoint: on a loaded 2-core machine the first trial has been seen 5 iterations ahead
    # when the second one printed its third. STOP leaves room for a lag of up to 8.
    STOP = 12
    args = [PBT_YAML, "--set", "training.lr={grid_search: [3.0e-3, 1.0e-7]}",
            "--set", "tune.hyperparam_mutations={training.lr: {loguniform: [1.0e-4, 1.0e-2]}}",
            "--set", "tune.perturbation_interval=2", "--set", "tune.resample_probability=0",
            "--set", f"stop.training_iteration={STOP}", "--set", "tune.max_concurrent_trials=2",
            "--set", "training.train_batch_size=512", "--set", "env_runners.num_envs_per_env_runner=8",
            "--set", "generate.num_samples=0", "--set", f"tune.storage_path={tmp_path}", "--set", "tune.name=pbt",
            "--set", "tune.dashboard=false", "--set", "checkpoint.state_every_s=0.2",
            # with the PBT default (0) the run killed here had no checkpoint on storage (checked),
            # and its --resume started the trials over: periodic checkpoints are what it resumes from
            "--set", "checkpoint.frequency=2"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    killed = subprocess.Popen([sys.executable, "-m", "agents.train", *args], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    reached = {}  # trial -> last iteration printed
    try:
        for line in killed.stdout:
            m = re.search(r"\[(\S+)\] iter +(\d+) ", line)
            if m:
                reached[m.group(1)] = int(m.group(2))
                if len(reached) == 2 and min(reached.values()) >= 3:  # both past their checkpoint at 2
                    let_the_storage_copy_finish(killed.pid, tmp_path / "pbt")
                    break
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
    assert len(reached) == 2 and max(reached.values()) < STOP, reached  # killed before the end
    with open(tmp_path / "pbt" / "scheduler_state.json") as f:  # PBT's own state, for the resume
        saved = json.load(f)["trials"]
    assert len(saved) == 2 and all(t["last_score"] is not None for t in saved.values()), saved
    out = run("agents.train", *args, "--resume", timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    after = [int(i) for i in re.findall(r"iter +(\d+) ", out.stdout)]
    assert after and min(after) > 1, after  # went on from checkpoints

    def finals():
        last = []
        for trial_dir in glob.glob(str(tmp_path / "pbt" / "LMPPO_*")):
            with open(os.path.join(trial_dir, "result.json")) as f:
                last.append([json.loads(line) for line in f if line.strip()][-1]["training_iteration"])
        return last

    assert finals() == [STOP, STOP]
    # Train longer: both trials go on; the first new result of each is a perturbation, and a weak
    # trial that gets there first clones the strong one's checkpoint saved before this resume (its
    # restore failed when PBT's state came back without the result the checkpoint was saved at).
    out = run("agents.train", *args, "--resume", "--set", f"stop.training_iteration={STOP + 2}", timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "--resume: 2 of 2 ended trials go on to the new stop criteria" in out.stdout
    assert finals() == [STOP + 2, STOP + 2]


def test_pbts_trial_states_saved_and_restored_by_trial_id(ray_local, tmp_path):
    """KeepRunningPBT's save and restore (what agents.experiment_store calls at each save of the
    experiment's state and after --resume added the trials again): each trial's last score, last
    perturbation and the checkpoint an exploiting trial clones come back to the new driver's trial
    objects (matched by id); a checkpoint deleted since, or a save still under way, comes back as none."""
    import time

    import ray
    from ray.train import Checkpoint
    from ray.tune.schedulers.pbt import _PBTTrialState

    from agents.pbt import make_scheduler

    class FakeTrial:  # what PBT's per-trial state reads of a Trial
        def __init__(self, trial_id, latest_checkpoint_result=None):
            self.trial_id, self.experiment_tag = trial_id, trial_id
            self.latest_checkpoint_result = latest_checkpoint_result

    cfg = load(PBT_YAML)
    before = make_scheduler(cfg)
    kept, gone = tmp_path / "checkpoint_000002", tmp_path / "checkpoint_000001"
    kept.mkdir()
    for trial_id, score, checkpoint, at in (("a", 0.9, kept, 6), ("b", 0.2, gone, 4)):
        state = before._trial_state[FakeTrial(trial_id)] = _PBTTrialState(FakeTrial(trial_id))
        state.last_score, state.last_checkpoint, state.last_perturbation_time = score, Checkpoint(str(checkpoint)), at
        # the result the checkpoint was saved at, as Tune's results hold it (numpy numbers, the trial's config)
        state.last_result = {"training_iteration": at, "time_total_s": np.float64(at * 1.5),
                             "env_runners": {"episode_return_mean": np.float32(score)}, "config": {"lr": object()},
                             "config/lr": 1e-3}  # (Tune flattens the config into a result too)
    # c's checkpoint is a save PBT scheduled (a top trial's, not cloned yet): kept once it is done,
    # with the save's result; d's save is still under way, e's failed: none (e's said once)
    class Save:  # what PBT holds for a scheduled save: a future of the save's checkpoint and result
        def __init__(self, future):
            self.future, self.resolved = future, 0

        def resolve(self, block=True):  # as Tune's: None for a save not done, or one that failed
            assert not block  # a save of the experiment's state waits for none
            self.resolved += 1
            try:
                return ray.get(self.future, timeout=1e-9)
            except Exception:
                return None

    @ray.remote(num_cpus=0)
    def save_under_way():
        time.sleep(60)

    @ray.remote(num_cpus=0)
    def failed_save():
        raise RuntimeError("the trial died while it saved")

    saved_c = tmp_path / "checkpoint_000003"
    saved_c.mkdir()
    failed = Save(failed_save.remote())
    ray.wait([failed.future])
    saves = {"c": Save(ray.put(types.SimpleNamespace(checkpoint=Checkpoint(str(saved_c)),
                                                     metrics={"training_iteration": 8}))),
             "d": Save(save_under_way.remote()), "e": failed}
    for trial_id, checkpoint in saves.items():
        state = before._trial_state[FakeTrial(trial_id)] = _PBTTrialState(FakeTrial(trial_id))
        state.last_score, state.last_checkpoint, state.last_perturbation_time = 0.5, checkpoint, 8
        state.last_result = {"training_iteration": 8, (1, 2): "a key JSON cannot hold"}
    before._num_perturbations, before._num_checkpoints = 3, 5
    try:
        for _ in range(2):  # each save of the experiment's state
            before.save(str(tmp_path / "scheduler_state.json"))
    finally:
        ray.cancel(saves["d"].future, force=True)
    assert failed.resolved == 1 and saves["d"].resolved == 0
    after = make_scheduler(cfg)  # a new driver's, its trials added again as new objects
    # b cloned a checkpoint saved before an earlier resume by a version that kept no result with
    # it: its restore read none and failed. It gets an empty one (the iteration is in the
    # checkpoint's own state), and goes on.
    cloned = types.SimpleNamespace(metrics=None)
    for trial_id, checkpoint_result in (("a", None), ("b", cloned), ("c", None), ("d", None), ("e", None)):
        after._trial_state[FakeTrial(trial_id, checkpoint_result)] = _PBTTrialState(FakeTrial(trial_id))
    after.restore(str(tmp_path / "scheduler_state.json"))
    assert cloned.metrics == {}
    got = {t.trial_id: s for t, s in after._trial_state.items()}
    assert (got["a"].last_score, got["a"].last_perturbation_time, got["a"].last_checkpoint.path) == (0.9, 6, str(kept))
    assert (got["b"].last_score, got["b"].last_perturbation_time, got["b"].last_checkpoint) == (0.2, 4, None)
    assert (after._num_perturbations, after._num_checkpoints) == (3, 5)
    assert (got["c"].last_checkpoint.path, got["c"].last_result) == (str(saved_c), {"training_iteration": 8})
    assert got["d"].last_checkpoint is None and got["e"].last_checkpoint is None
    # A trial cloning "a" after the resume restores its checkpoint with this result (Tune's PBT gives
    # it as the checkpoint's metrics: without it the clone's restore failed on None), so the clone's
    # iterations go on from a's.
    assert got["a"].last_result == {"training_iteration": 6, "time_total_s": 9.0,
                                    "env_runners": {"episode_return_mean": pytest.approx(0.9)}}
    # A state saved without the results (an older one): its checkpoints are not cloned until each
    # trial's next perturbation saves another.
    with open(tmp_path / "scheduler_state.json") as f:
        older = json.load(f)
    for saved in older["trials"].values():
        del saved["last_result"]
    with open(tmp_path / "scheduler_state.json", "w") as f:
        json.dump(older, f)
    after.restore(str(tmp_path / "scheduler_state.json"))
    assert [s.last_checkpoint for s in after._trial_state.values()] == [None] * 5
    assert [s.last_score for s in after._trial_state.values()] == [0.9, 0.2, 0.5, 0.5, 0.5]
