"""The summary `agents.train` prints at the end of a run: a sweep with a failed trial exits 1 and
says how many failed; a resumed run's figures cover the iterations before the resume."""
import json
import os
import types

from tests.conftest import QUICKSTART


def _result(trial_id: str, path=None, error=None):
    return types.SimpleNamespace(metrics={"trial_id": trial_id}, error=error, checkpoint=None, path=path,
                                 config={"seed": 0})


class _Grid(list):
    def get_best_result(self, **_):
        raise RuntimeError("no result with the metric")


def _rows(path, rewards: list[float], first: int = 1):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "result.json"), "w") as f:
        for i, r in enumerate(rewards, first):
            f.write(json.dumps({"training_iteration": i, "env_runners": {"episode_return_mean": r}}) + "\n")


def _summarize(grid, tmp_path, capsys, progress=None, resumed=False):
    from agents.config import load
    from agents.progress import make_progress_callback
    from agents.summary import summarize

    cfg = load(QUICKSTART, ["generate.num_samples=0"])
    code = summarize(cfg, grid, progress or make_progress_callback(quiet=True), str(tmp_path / "run"), 1.0,
                     resumed=resumed)
    return code, capsys.readouterr().out


def test_a_sweep_with_one_failed_trial_exits_1_and_says_how_many_failed(tmp_path, capsys):
    code, out = _summarize(_Grid([_result("a_00000"), _result("a_00001", error=RuntimeError("boom"))]),
                           tmp_path, capsys)
    assert code == 1, out
    assert "trial a_00001: FAILED: boom" in out
    assert "1 of 2 trials failed (the others' results above stand)" in out
    code, out = _summarize(_Grid([_result("a_00000"), _result("a_00001")]), tmp_path, capsys)
    assert code == 0 and "trials failed" not in out, out


def test_a_resumed_runs_summary_covers_the_iterations_before_the_resume(tmp_path, capsys):
    """Trial 0 finished before the run was interrupted; trial 1 was resumed at iteration 3. The
    resuming process saw only trial 1's iterations 3-4; the summary reads both trials' rows."""
    from agents.progress import make_progress_callback

    _rows(tmp_path / "t0", [0.2, 0.9, 0.5])
    _rows(tmp_path / "t1", [0.1, 0.3, 0.4, 0.6])
    progress = make_progress_callback(quiet=True)
    trial = types.SimpleNamespace(trial_id="a_00001")
    for i, r in ((3, 0.4), (4, 0.6)):
        progress.on_trial_result(0, [trial], trial, {"training_iteration": i, "env_runners": {"episode_return_mean": r}})
    grid = _Grid([_result("a_00000", path=str(tmp_path / "t0")), _result("a_00001", path=str(tmp_path / "t1"))])
    code, out = _summarize(grid, tmp_path, capsys, progress=progress, resumed=True)
    assert code == 0, out
    assert "trial a_00000: mean episode reward 0.200 (iteration 1) -> 0.500 (iteration 3), best 0.900" in out
    assert "trial a_00001: mean episode reward 0.100 (iteration 1) -> 0.600 (iteration 4), best 0.600" in out
    with open(tmp_path / "run" / "summary.csv") as f:
        rows = f.read()
    assert ",0.5,0.9," in rows and ",0.6,0.6," in rows, rows  # final and best reward per trial


def test_a_sweep_over_another_sections_value_keeps_its_settings_apart_and_samples_the_best_one(tmp_path, capsys):
    """guide.beta searched with two seeds each: the table has one row per beta (not one row of four
    "seeds"), summary.csv has the beta of each trial, and the samples come from the best setting's
    best trial, not from the trial with the best last reward."""
    import csv

    from agents.config import load
    from agents.progress import make_progress_callback
    from agents.summary import sweep_table

    import enum

    class Compile(str, enum.Enum):
        FORWARD_TRAIN = "forward_train"

    # (beta, seed) -> rewards by iteration: beta 0.9 is better on average over its seeds, but the
    # single best last reward is beta 0.0's seed 1
    runs = {(0.0, 0): [0.1, 0.2], (0.0, 1): [0.1, 0.8], (0.9, 0): [0.5, 0.7], (0.9, 1): [0.6, 0.7]}
    progress, grid = make_progress_callback(quiet=True), []
    for n, ((beta, seed), rewards) in enumerate(runs.items()):
        trial = types.SimpleNamespace(trial_id=f"g_0000{n}")
        for i, r in enumerate(rewards, 1):
            progress.on_trial_result(0, [trial], trial, {"training_iteration": i,
                                                         "env_runners": {"episode_return_mean": r}})
        # a trial restored by --resume holds its config JSON round-tripped: lists for tuples, values for enums
        restored = n % 2 == 1
        config = {"seed": seed, "lr": 1e-3, "_model_config": {"seed": seed, "guide": {"beta": beta, "mix": 0.5}},
                  "policies": [None, None] if restored else (None, None),
                  "what_to_compile": "forward_train" if restored else Compile.FORWARD_TRAIN}
        grid.append(types.SimpleNamespace(metrics={"trial_id": trial.trial_id}, error=None, path=None, config=config,
                                          checkpoint=types.SimpleNamespace(path=str(tmp_path / f"ck{n}"))))
    cfg = load(QUICKSTART, ["generate.num_samples=0"])
    path, top = sweep_table(cfg, grid, progress, str(tmp_path / "run"))
    out = capsys.readouterr().out
    header, row = (line.split() for line in out.split("best setting per sampler")[1].splitlines()[1:3])
    assert header[:5] == ["sampler", "masking", "params", "guide.beta", "seeds"], out
    # (no params: that column is blank) beta 0.9 over its 2 seeds: best 0.7 (0.5 for beta 0), final 0.7, spread 0
    assert row == ["none", "-", "0.9", "2", "0.7", "0.7", "0", "-"], out
    with open(path, newline="") as f:
        assert [(r["trial"], r["guide.beta"]) for r in csv.DictReader(f)] == [
            ("g_00000", "0.0"), ("g_00001", "0.0"), ("g_00002", "0.9"), ("g_00003", "0.9")]
    assert top.metrics["trial_id"] == "g_00002"  # beta 0.9's best reward (0.7; seed 1's ties it later)


def test_a_sweeps_progress_lines_name_the_trial_from_the_first_one_on(capsys):
    """A sweep run one trial at a time has one trial made when the first reports: its lines carry
    the trial's id all the same (as its later trials' do); a single run's lines carry none."""
    from agents.progress import make_progress_callback

    trial = types.SimpleNamespace(trial_id="s_00000")
    result = {"training_iteration": 1, "env_runners": {"episode_return_mean": 0.5}, "time_total_s": 3.0}
    for planned, prefix in ((2, "[s_00000] iter    1 "), (1, "iter    1 ")):
        make_progress_callback(trials=planned).on_trial_result(0, [trial], trial, result)
        assert capsys.readouterr().out.startswith(prefix)


def test_a_sweep_table_shows_searched_values_under_their_yaml_names_with_no_column_for_what_they_set(
        tmp_path, capsys):
    """training.lr_end and reward.kl_coef searched: RLlib's config holds them as the lr schedule's
    end and ref_kl_coef, and kl_coef > 0 turns the reference model on. The table and summary.csv
    show lr_end and kl_coef with the trials' values, and no column for the schedule or the
    reference model (they follow from those two)."""
    import csv

    from agents.config import load
    from agents.progress import make_progress_callback
    from agents.summary import sweep_table

    progress, grid = make_progress_callback(quiet=True), []
    settings = [(lr_end, kl, seed) for lr_end in (1e-4, 0.0) for kl in (0.0, 0.1) for seed in (0, 1)]
    for n, (lr_end, kl, seed) in enumerate(settings):
        trial = types.SimpleNamespace(trial_id=f"s_{n:05d}")
        reward = 0.5 + (0.3 if lr_end else 0.0) + kl + 0.01 * seed
        progress.on_trial_result(0, [trial], trial, {"training_iteration": 1, "env_runners": {"episode_return_mean": reward}})
        config = {"seed": seed, "lr": [[0, 1e-3], [5000, lr_end]], "ref_kl_coef": kl,
                  "_model_config": {"seed": seed, "reference_model": kl > 0}}
        grid.append(types.SimpleNamespace(metrics={"trial_id": trial.trial_id}, error=None, path=None, config=config,
                                          checkpoint=None))
    cfg = load(QUICKSTART, ["generate.num_samples=0", "training.lr_decay_steps=5000",
                            "training.lr_end={grid_search: [1.0e-4, 0.0]}", "reward.kl_coef={grid_search: [0.0, 0.1]}"])
    path, _ = sweep_table(cfg, grid, progress, str(tmp_path / "run"))
    out = capsys.readouterr().out
    header, row = (line.split() for line in out.split("best setting per sampler")[1].splitlines()[1:3])
    assert header[:6] == ["sampler", "masking", "params", "lr_end", "kl_coef", "seeds"], out
    assert row[2:5] == ["0.0001", "0.1", "2"], out  # the best setting, over its two seeds
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["lr_end"], r["kl_coef"]) for r in rows] == [(str(a), str(b)) for a, b, _ in settings]
    assert not {"lr", "reference_model", "ref_kl_coef"} & set(rows[0]), list(rows[0])


def test_a_trial_that_ran_iterations_again_is_summarized_from_its_stored_curve(tmp_path, capsys):
    """A trial restored from its checkpoint within the run (a retry under max_failures, a PBT
    exploit) runs iterations 2-3 again; its result.json keeps the second run of each. The summary's
    best and last rewards are those of that curve, not of the rows the rerun replaced (0.9)."""
    from agents.progress import make_progress_callback

    progress, trial = make_progress_callback(quiet=True), types.SimpleNamespace(trial_id="a_00000")
    for i, r in ((1, 0.2), (2, 0.9), (3, 0.3), (2, 0.4), (3, 0.5)):  # as this process saw them
        progress.on_trial_result(0, [trial], trial, {"training_iteration": i, "env_runners": {"episode_return_mean": r}})
    _rows(tmp_path / "t0", [0.2, 0.4, 0.5])
    code, out = _summarize(_Grid([_result("a_00000", path=str(tmp_path / "t0"))]), tmp_path, capsys, progress=progress)
    assert code == 0 and "trial a_00000: mean episode reward 0.200 (iteration 1) -> 0.500 (iteration 3), best 0.500" \
        in out, out
    # on a storage path read through its own filesystem (a bucket's path is no local one)
    import pyarrow.fs

    bucket = pyarrow.fs.SubTreeFileSystem(str(tmp_path / "bucket"), pyarrow.fs.LocalFileSystem())
    _rows(tmp_path / "bucket" / "exp" / "t0", [0.2, 0.4, 0.6])
    stored = types.SimpleNamespace(metrics={"trial_id": "a_00000"}, error=None, checkpoint=None, path="exp/t0",
                                   config={"seed": 0}, filesystem=bucket)
    code, out = _summarize(_Grid([stored]), tmp_path, capsys, progress=progress)
    assert "-> 0.600 (iteration 3), best 0.600" in out, out
    # a stored curve behind what this process saw (its last rows not copied yet) is not taken
    _rows(tmp_path / "t1", [0.2])
    code, out = _summarize(_Grid([_result("a_00000", path=str(tmp_path / "t1"))]), tmp_path, capsys, progress=progress)
    assert "-> 0.600 (iteration 3), best 0.600" in out, out


def test_a_random_search_keeps_a_column_for_each_value_it_searches(tmp_path, capsys):
    """training.lr drawn at random (each trial its own), guide.beta and guide.alpha from two values
    (equal in each trial, by chance): every trial is a setting of its own, and all three columns
    show (a value that happens to follow from another is still one the run searched)."""
    import csv

    from agents.config import load
    from agents.progress import make_progress_callback
    from agents.summary import sweep_table

    progress, grid = make_progress_callback(quiet=True), []
    for n, (lr, beta) in enumerate([(1.3e-4, 0.0), (4.1e-4, 0.9), (2.2e-3, 0.0), (7.7e-4, 0.9)]):
        trial = types.SimpleNamespace(trial_id=f"r_{n:05d}")
        progress.on_trial_result(0, [trial], trial, {"training_iteration": 1, "env_runners": {"episode_return_mean": lr}})
        batch = 1024 * (1 + n % 2)  # searched too, and RLlib writes it again per learner: one column
        config = {"seed": 0, "lr": lr, "train_batch_size": batch, "train_batch_size_per_learner": batch,
                  "_model_config": {"seed": 0, "guide": {"beta": beta, "alpha": beta}}}
        grid.append(types.SimpleNamespace(metrics={"trial_id": trial.trial_id}, error=None, path=None, config=config,
                                          checkpoint=None))
    cfg = load(QUICKSTART, ["generate.num_samples=0", "training.lr={loguniform: [1.0e-4, 3.0e-3]}",
                            "training.train_batch_size={choice: [1024, 2048]}"])
    path, _ = sweep_table(cfg, grid, progress, str(tmp_path / "run"))
    out = capsys.readouterr().out
    header = out.split("best setting per sampler")[1].splitlines()[1].split()
    assert header[:8] == ["sampler", "masking", "params", "lr", "train_batch_size", "guide.alpha", "guide.beta",
                          "seeds"], out
    with open(path, newline="") as f:
        assert [(r["lr"], r["guide.beta"]) for r in csv.DictReader(f)] == [
            ("0.00013", "0.0"), ("0.00041", "0.9"), ("0.0022", "0.0"), ("0.00077", "0.9")]
