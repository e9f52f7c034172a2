"""A driver killed at any moment of Tune's copy of the experiment to the storage path leaves a run
that resumes. The copy (agents.experiment_store.upload_whole_files, which the driver installs for a
local storage path) is killed with SIGKILL at every point of it: before each file, halfway through
writing it, and between writing it and renaming it into place. After each kill every file is
whole (the version before the copy or the one after it), Tune loads the experiment and finds
each trial's checkpoint, and one of the kills is resumed with `agents.train --resume` to the end."""
import filecmp
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import QUICKSTART, ROOT, kill_after_iteration
from tests.test_reproducibility import TINY

# Runs the copy from argv[1] to argv[2] in a process that SIGKILLs itself at step argv[3] (a step:
# before a file's copy or write, halfway through writing it, before renaming it into place); prints the
# number of steps and the step before the top folder's journal is put in place when it is not killed.
KILLED_COPY = r"""
import os, shutil, signal, sys
import agents.experiment_store as store

source, target, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
steps = 0

def step():
    global steps
    if steps == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    steps += 1

replace = os.replace
journal_at = None  # the step before the journal of the top folder's renames is put in place

def copyfile(src, dst):
    step()
    with open(src, "rb") as f:
        data = f.read()
    with open(dst, "wb") as f:
        f.write(data[:len(data) // 2])
        f.flush()
        step()
        f.write(data[len(data) // 2:])
    return dst

def write(path, data):  # a file of the top folder, read into memory first
    step()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])
        f.flush()
        step()
        f.write(data[len(data) // 2:])

def replace_step(src, dst):
    global journal_at
    if os.path.basename(dst) == store.PLACING:
        journal_at = steps
    step()
    replace(src, dst)

shutil.copyfile, os.replace, store._write = copyfile, replace_step, write
store.upload_whole_files(source, target)
print(steps, journal_at)
"""


def _cli(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "agents.train", QUICKSTART, *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _copied_files(experiment) -> set[str]:
    """The files Tune copies from the driver's staging folder: all but the checkpoints (which a
    trial writes to the storage path itself) and the partial file a copy killed midway left."""
    from agents.whole_files import PARTIAL_NAME

    files = set()
    for path in glob.glob(os.path.join(experiment, "**"), recursive=True):
        rel = os.path.relpath(path, experiment)
        if os.path.isfile(path) and not re.search(r"(^|/)checkpoint_\d+/", rel) and not PARTIAL_NAME.search(rel):
            files.add(rel)
    return files


@pytest.fixture(scope="module")
def before_and_after(tmp_path_factory):
    """A run's experiment folder as the storage path held it before a copy (`before`: killed after
    iteration 2 of 3, its copy finished) and after it (`after`: resumed to the end), and the
    driver's staging folder for that copy (`after`'s copied files)."""
    tmp = tmp_path_factory.mktemp("copy_kills")
    common = [*[a for o in TINY for a in ("--set", o)], "--set", "stop.training_iteration=3",
              "--set", "checkpoint.frequency=1", "--set", "generate.num_samples=0", "--set", "tune.dashboard=false",
              "--set", f"tune.storage_path={tmp / 'storage'}", "--set", "tune.name=run",
              "--set", "checkpoint.state_every_s=0.2"]
    lines = kill_after_iteration(_cli(*common), 2, tmp / "storage" / "run")
    assert re.match(r"iter +2 ", lines[-1]), "".join(lines)[-3000:]
    shutil.copytree(tmp / "storage" / "run", tmp / "before")
    resumed = _cli(*common, "--resume")
    out = resumed.communicate(timeout=900)[0]
    assert resumed.returncode == 0, out[-3000:]
    after = tmp / "storage" / "run"
    staging = tmp / "staging"
    for rel in _copied_files(after):
        os.makedirs(os.path.dirname(staging / rel), exist_ok=True)
        shutil.copy2(after / rel, staging / rel)
    return tmp / "before", after, staging


def _storage_before_the_copy(before, after, target):
    """The storage path as the copy finds it: the checkpoints already there (the trials wrote them),
    every copied file as it was before."""
    shutil.copytree(after, target)
    for rel in _copied_files(after) - _copied_files(before):
        os.remove(target / rel)
    for rel in _copied_files(before):
        shutil.copy2(before / rel, target / rel)


def _copy_killed_at(staging, target, kill_at: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", KILLED_COPY, str(staging), str(target), str(kill_at)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def _checkpoints_tune_resumes_from(experiment) -> list[str]:
    """Each trial's latest checkpoint in the experiment state, as Tune loads it."""
    from ray.tune import ExperimentAnalysis

    analysis = ExperimentAnalysis(str(experiment))
    return [t.checkpoint.path if t.checkpoint else None for t in analysis.trials]


@pytest.mark.slow
def test_a_copy_killed_at_any_point_leaves_whole_files_and_a_state_that_resumes(before_and_after, tmp_path):
    from agents.experiment_store import PLACING, check_experiment_state
    from agents.whole_files import PARTIAL

    before, after, staging = before_and_after
    copied = _copied_files(after)
    assert any(r.startswith("experiment_state-") for r in copied) and any(r.endswith("result.json") for r in copied)
    steps, journal_at = map(int, _copy_killed_at(staging, tmp_path / "probe", 10 ** 9).stdout.split())
    # each file copied or written in two halves, then renamed (3 steps); the top folder's journal likewise
    assert steps == 3 * len(copied) + 3 >= 20, (steps, sorted(copied))
    # the top folder's files this copy changes (the experiment's state, the search algorithm's, ...)
    changed_top = {r for r in copied if "/" not in r
                   and not ((before / r).is_file() and filecmp.cmp(before / r, after / r, shallow=False))}
    assert len(changed_top) >= 2 and any(r.startswith("experiment_state-") for r in changed_top), changed_top

    def version(target, rel):
        if (target / rel).is_file() and filecmp.cmp(target / rel, after / rel, shallow=False):
            return "after"
        if (before / rel).is_file() and (target / rel).is_file():
            return "before" if filecmp.cmp(target / rel, before / rel, shallow=False) else "neither"
        return "before" if not (target / rel).exists() else "neither"

    for kill_at in range(steps):
        target = tmp_path / f"killed_at_{kill_at}"
        _storage_before_the_copy(before, after, target)
        result = _copy_killed_at(staging, target, kill_at)
        assert result.returncode == -signal.SIGKILL, (kill_at, result.stderr[-2000:])
        # finishes the renames a kill among the top folder's files left, removes the partial files
        check_experiment_state(str(target))
        assert not glob.glob(os.path.join(target, "**", f"*{PARTIAL}*"), recursive=True)
        assert not (target / PLACING).exists()
        # the top folder's files are all of one save: as before the copy until its journal is in place, then copied
        versions = {rel: version(target, rel) for rel in changed_top}
        assert set(versions.values()) == {"before" if kill_at <= journal_at else "after"}, (kill_at, versions)
        for rel in copied | _copied_files(before):
            got = target / rel
            versions = [v / rel for v in (before, after) if (v / rel).is_file()]
            assert got.is_file() or not (before / rel).is_file(), (kill_at, rel, "lost")
            if got.is_file():
                assert any(filecmp.cmp(got, v, shallow=False) for v in versions), (kill_at, rel, "cut short")
        for state in glob.glob(os.path.join(target, "experiment_state-*.json")):
            with open(state) as f:
                json.load(f)
        checkpoints = _checkpoints_tune_resumes_from(target)
        assert checkpoints and all(c and os.path.isdir(c) and str(target) in c for c in checkpoints), \
            (kill_at, checkpoints)


@pytest.mark.slow
def test_a_run_whose_copy_was_killed_before_its_new_state_resumes_to_the_end(before_and_after, tmp_path):
    """The last point before the top folder's files are renamed into place (the step before their
    journal is): every trial file is the new one, the state the old one (the trial at its
    iteration-2 checkpoint, not finished)."""
    before, after, staging = before_and_after
    journal_at = int(_copy_killed_at(staging, tmp_path / "probe", 10 ** 9).stdout.split()[1])
    target = tmp_path / "storage" / "run"
    _storage_before_the_copy(before, after, target)
    assert _copy_killed_at(staging, target, journal_at).returncode == -signal.SIGKILL
    newest_state = max(glob.glob(os.path.join(target, "experiment_state-*.json")))
    rel = os.path.relpath(newest_state, target)
    assert (before / rel).is_file() and filecmp.cmp(newest_state, before / rel, shallow=False)
    (trial_result,) = [r for r in _copied_files(after) if r.endswith("result.json")]
    assert filecmp.cmp(target / trial_result, after / trial_result, shallow=False)
    common = [*[a for o in TINY for a in ("--set", o)], "--set", "stop.training_iteration=3",
              "--set", "checkpoint.frequency=1", "--set", "generate.num_samples=0", "--set", "tune.dashboard=false",
              "--set", f"tune.storage_path={tmp_path / 'storage'}", "--set", "tune.name=run"]
    resumed = _cli(*common, "--resume")
    out = resumed.communicate(timeout=900)[0]
    assert resumed.returncode == 0, out[-3000:]
    assert re.search(r"^iter +3 ", out, re.M), out[-3000:]
    (result,) = glob.glob(os.path.join(target, "LMPPO_*", "result.json"))
    with open(result) as f:
        iterations = [json.loads(line)["training_iteration"] for line in f if line.strip()]
    assert iterations == [1, 2, 3], iterations


def test_a_resume_finishes_the_renames_a_killed_copy_left_in_its_own_folder_only(tmp_path):
    """A copy killed among the top folder's renames (its journal in place, one file renamed, one
    not): the check before a resume renames the rest; a name that leaves the folder is ignored."""
    from agents.experiment_store import PLACING, check_experiment_state, newest_experiment_state

    experiment, tag = tmp_path / "run", ".partial-12-34"
    experiment.mkdir()
    (tmp_path / "outside").write_text("kept")
    (experiment / f"experiment_state-2026.json{tag}").write_text('{"trial_data": []}')  # not renamed yet
    (experiment / "searcher-state-2026.pkl").write_text("new")  # renamed before the kill
    (experiment / f"escape{tag}").write_text("moved?")
    (experiment / f"other.json{tag}").write_text("a partial file no journal names")
    (experiment / PLACING).write_text(json.dumps([
        [f"searcher-state-2026.pkl{tag}", "searcher-state-2026.pkl"],
        [f"experiment_state-2026.json{tag}", "experiment_state-2026.json"],
        [f"escape{tag}", "../outside"]]))
    check_experiment_state(str(experiment))
    assert newest_experiment_state(str(experiment)) == str(experiment / "experiment_state-2026.json")
    assert (experiment / "searcher-state-2026.pkl").read_text() == "new"
    assert (tmp_path / "outside").read_text() == "kept"
    assert sorted(os.listdir(experiment)) == ["experiment_state-2026.json", "searcher-state-2026.pkl"]


def test_a_rename_that_fails_among_the_top_folders_leaves_them_for_the_resume_to_finish(tmp_path, monkeypatch):
    """An error (not a kill) renaming the top folder's files after their journal is in place leaves
    the journal and the files still to rename, and the check before a resume finishes them: the
    folder never holds the files of two saves. A copy whose experiment state was left out (written
    meanwhile) places none of the top folder's files."""
    import agents.experiment_store as store

    staging, storage = tmp_path / "staging", tmp_path / "storage"
    staging.mkdir()
    storage.mkdir()
    for name in ("basic-variant-state-1.json", "experiment_state-1.json", "tuner.pkl"):
        (staging / name).write_text('{"new": 1}')
        (storage / name).write_text('{"old": 1}')
    replace, renames = os.replace, []

    def failing_replace(src, dst):
        renames.append(os.path.basename(dst))
        if len(renames) == 3:  # the journal, one file, then an error
            raise OSError(5, "Input/output error")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError):
        store.upload_whole_files(str(staging), str(storage))
    monkeypatch.setattr(os, "replace", replace)
    assert renames[0] == store.PLACING and (storage / store.PLACING).exists()
    store.check_experiment_state(str(storage))
    assert sorted(os.listdir(storage)) == ["basic-variant-state-1.json", "experiment_state-1.json", "tuner.pkl"]
    assert all((storage / name).read_text() == '{"new": 1}' for name in os.listdir(storage))

    for name in os.listdir(staging):
        (staging / name).write_text('{"newer": 1}')
    (staging / "experiment_state-0.json").write_text('{"older": 1}')  # a resumed run's: copied down by Tune
    real_read = store._read_whole
    monkeypatch.setattr(store, "_read_whole", lambda source, rel: None if rel == "experiment_state-1.json"
                        else real_read(source, rel))
    assert store.upload_whole_files(str(staging), str(storage)) == []
    assert all((storage / name).read_text() == '{"new": 1}' for name in os.listdir(storage))


def test_a_copy_leaves_out_what_tune_is_still_writing(tmp_path):
    """The driver saves its state and appends results while the copy of the previous save runs:
    a state that does not parse yet keeps the storage's previous one, a result line being
    written is left for the next copy, and a killed copy's partial file is removed on --resume."""
    from agents.experiment_store import check_experiment_state, upload_whole_files
    from agents.whole_files import PARTIAL

    staging, storage = tmp_path / "staging", tmp_path / "storage"
    (staging / "trial").mkdir(parents=True)
    (storage / "trial").mkdir(parents=True)
    (storage / "experiment_state-1.json").write_text('{"trial_data": [1]}')
    (staging / "experiment_state-1.json").write_text('{"trial_data": [1, 2')  # being written
    (staging / "trial" / "result.json").write_text('{"training_iteration": 1}\n{"training_iter')
    (staging / "trial" / "progress.csv").write_text("training_iteration,reward\n1,0.5\n2,0.")
    (staging / "trial" / "params.json").write_text('{"lr": 0.001}')
    upload_whole_files(str(staging), str(storage))
    assert (storage / "experiment_state-1.json").read_text() == '{"trial_data": [1]}'
    assert (storage / "trial" / "result.json").read_text() == '{"training_iteration": 1}\n'
    assert (storage / "trial" / "progress.csv").read_text() == "training_iteration,reward\n1,0.5\n"
    assert (storage / "trial" / "params.json").read_text() == '{"lr": 0.001}'
    (staging / "experiment_state-1.json").write_text('{"trial_data": [1, 2]}')  # written by now
    upload_whole_files(str(staging), str(storage))
    assert (storage / "experiment_state-1.json").read_text() == '{"trial_data": [1, 2]}'
    assert not list(storage.rglob(f"*{PARTIAL}*"))

    (storage / "trial" / f"result.json{PARTIAL}123-456").write_text('{"training_iteration": 1}\n{"tr')
    (storage / ".hidden").mkdir()
    (storage / ".hidden" / f"x{PARTIAL}123-456").write_text("")
    check_experiment_state(str(storage))
    assert not list(storage.rglob(f"*{PARTIAL}*"))
    assert (storage / "trial" / "result.json").read_text() == '{"training_iteration": 1}\n'


def test_tune_deletes_an_old_checkpoint_only_after_storing_a_state_that_no_longer_names_it(tmp_path):
    """Tune's retention (checkpoint.num_to_keep) drops a trial's oldest checkpoint when a new one
    registers; the stored experiment state still names the old one until the next copy. The
    deletion waits for a copy that stored a newer state: not before it, not after a copy that
    left the state out (it did not parse yet), and then by the next copy that stores one."""
    import pyarrow.fs
    from ray.train import Checkpoint, CheckpointConfig
    from ray.train._internal.checkpoint_manager import _CheckpointManager
    from ray.train._internal.session import _TrainingResult
    from ray.train._internal.storage import _FilesystemSyncer

    from agents.experiment_store import store_experiments_safely

    store_experiments_safely()
    staging, storage = tmp_path / "staging", tmp_path / "storage"
    staging.mkdir()
    checkpoints = [storage / "trial" / f"checkpoint_00000{i}" for i in range(3)]
    for path in checkpoints:
        path.mkdir(parents=True)
        (path / "algorithm_state.pkl").write_bytes(b"x")
    manager = _CheckpointManager(CheckpointConfig(num_to_keep=1))
    syncer = _FilesystemSyncer(storage_filesystem=pyarrow.fs.LocalFileSystem())

    def register(path):
        manager.register_checkpoint(_TrainingResult(checkpoint=Checkpoint(str(path)), metrics={}))

    def copy(state: str):
        (staging / "experiment_state-1.json").write_text(state)  # what Tune saves before each copy
        fn, kwargs = syncer._sync_up_command(str(staging), str(storage))
        fn(**kwargs)

    register(checkpoints[0])
    register(checkpoints[1])
    assert checkpoints[0].is_dir()  # dropped, but the stored state (none yet) may name it
    copy('{"trial_data": [1')  # the state was being written: it stays out of this copy
    assert checkpoints[0].is_dir() and not (storage / "experiment_state-1.json").exists()
    copy('{"trial_data": [1]}')
    assert not checkpoints[0].exists() and checkpoints[1].is_dir()
    register(checkpoints[2])
    assert checkpoints[1].is_dir()
    copy('{"trial_data": [2]}')
    assert not checkpoints[1].exists() and checkpoints[2].is_dir()
    assert (storage / "experiment_state-1.json").read_text() == '{"trial_data": [2]}'


@pytest.mark.slow
def test_a_run_killed_as_tune_deletes_an_old_checkpoint_resumes_from_its_newer_one(tmp_path):
    """`checkpoint.num_to_keep: 1`, a checkpoint every iteration: the driver is SIGKILLed the
    moment the third old checkpoint disappears from the storage path. The run resumes from a
    checkpoint past the deleted ones (before deletions waited for the stored state, it failed
    there: "Could not recover from checkpoint as it does not exist on storage anymore") and every
    iteration's row is in result.json once."""
    common = [*[a for o in TINY for a in ("--set", o)], "--set", "stop.training_iteration=7",
              "--set", "checkpoint.frequency=1", "--set", "checkpoint.num_to_keep=1",
              "--set", "generate.num_samples=0", "--set", "tune.dashboard=false",
              "--set", f"tune.storage_path={tmp_path / 'storage'}", "--set", "tune.name=run"]
    killed, seen, gone = _cli(*common), set(), set()
    try:
        while killed.poll() is None and len(gone) < 3:
            now = set(glob.glob(os.path.join(tmp_path, "storage", "run", "LMPPO_*", "checkpoint_*")))
            gone |= seen - now
            seen |= now
            time.sleep(0.002)
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
    assert len(gone) == 3, killed.stdout.read()[-3000:]
    # what a driver killed between storing a state and deleting the checkpoints it no longer names
    # leaves: a checkpoint no stored state names (its deletion was queued in the dead driver)
    (trial,) = glob.glob(os.path.join(tmp_path, "storage", "run", "LMPPO_*"))
    shutil.copytree(max(glob.glob(os.path.join(trial, "checkpoint_*"))), os.path.join(trial, "checkpoint_000000"))
    resumed = _cli(*common, "--resume")
    out = resumed.communicate(timeout=900)[0]
    assert resumed.returncode == 0, out[-3000:]
    first = int(re.findall(r"^iter +(\d+) ", out, re.M)[0])
    assert first >= 4, out[-3000:]  # past the three deleted checkpoints (iterations 1-3)
    (result,) = glob.glob(os.path.join(tmp_path, "storage", "run", "LMPPO_*", "result.json"))
    with open(result) as f:
        iterations = [json.loads(line)["training_iteration"] for line in f if line.strip()]
    assert iterations == list(range(1, 8)), iterations
    # the deletion the killed driver had queued is not lost: one checkpoint is left, as kept
    left = glob.glob(os.path.join(tmp_path, "storage", "run", "LMPPO_*", "checkpoint_*"))
    assert [os.path.basename(p) for p in left] == ["checkpoint_000006"], left


def test_a_copy_stores_the_search_algorithms_and_callbacks_state_files_of_the_same_save(tmp_path):
    """Tune's search algorithm and callbacks save pickles named .json/.pkl beside the experiment's
    state: each reaches the storage path (the search algorithm's did not: it failed a JSON check
    meant for the experiment's state, and a resumed sweep lost the trials not yet made), and a
    save in progress (it holds SAVE_LOCK) finishes before the copy reads the top folder."""
    import pickle
    import threading

    from agents.experiment_store import SAVE_LOCK, upload_whole_files

    staging, storage = tmp_path / "staging", tmp_path / "storage"
    staging.mkdir()
    (staging / "basic-variant-state-1.json").write_bytes(pickle.dumps({"made": 1}))
    (staging / "callback-states-1.pkl").write_bytes(pickle.dumps({"cb": 1}))
    (staging / "experiment_state-1.json").write_text('{"trial_data": [1]}')
    placed = upload_whole_files(str(staging), str(storage))
    assert set(placed) == {"basic-variant-state-1.json", "callback-states-1.pkl", "experiment_state-1.json"}
    assert pickle.loads((storage / "basic-variant-state-1.json").read_bytes()) == {"made": 1}

    def save():  # what Tune's save does, in the order it does it, under the lock
        (staging / "experiment_state-1.json").write_text('{"trial_data": [1, 2]}')
        saved.set()
        release.wait(10)
        (staging / "basic-variant-state-1.json").write_bytes(pickle.dumps({"made": 2}))

    saved, release = threading.Event(), threading.Event()

    def locked_save():
        with SAVE_LOCK:
            save()

    saver = threading.Thread(target=locked_save)
    saver.start()
    saved.wait(10)
    copier = threading.Thread(target=upload_whole_files, args=(str(staging), str(storage)))
    copier.start()
    copier.join(0.3)
    assert copier.is_alive()  # waits for the save to end
    release.set()
    saver.join()
    copier.join(10)
    assert (storage / "experiment_state-1.json").read_text() == '{"trial_data": [1, 2]}'
    assert pickle.loads((storage / "basic-variant-state-1.json").read_bytes()) == {"made": 2}


def test_an_older_copy_still_in_flight_places_nothing_over_a_newer_one(tmp_path):
    """Tune starts a second copy when one runs past its timeout. Should the older one go on after
    the newer one placed its files, it places nothing: an older experiment state over the newer
    one would name checkpoints the newer copy's deletions removed, and older result rows would sit
    under a newer state."""
    from agents.experiment_store import upload_whole_files

    storage = tmp_path / "storage"
    for name, rows in (("old", 1), ("new", 2)):
        (tmp_path / name / "trial").mkdir(parents=True)
        (tmp_path / name / "experiment_state-1.json").write_text(json.dumps({"trial_data": [rows]}))
        (tmp_path / name / "trial" / "result.json").write_text('{"training_iteration": 1}\n' * rows)
    assert len(upload_whole_files(str(tmp_path / "new"), str(storage), order=2)) == 2
    assert upload_whole_files(str(tmp_path / "old"), str(storage), order=1) == []
    assert json.loads((storage / "experiment_state-1.json").read_text()) == {"trial_data": [2]}
    assert (storage / "trial" / "result.json").read_text().count("\n") == 2
    assert len(upload_whole_files(str(tmp_path / "new"), str(storage), order=3)) == 2  # the next one does


def test_a_copy_to_slow_storage_does_not_hold_the_drivers_saves(tmp_path, monkeypatch):
    """The copy reads the top folder's files under SAVE_LOCK (the files of one save) and writes
    them to the storage path outside it: a save waits for the read, not for slow storage."""
    import shutil as shutil_module
    import threading

    import agents.experiment_store as store

    staging, storage = tmp_path / "staging", tmp_path / "storage"
    staging.mkdir()
    (staging / "experiment_state-1.json").write_text('{"trial_data": [1]}')
    writing, release = threading.Event(), threading.Event()

    def slow(write):
        def to_storage(source_or_path, target_or_data):
            target = source_or_path if isinstance(target_or_data, bytes) else target_or_data
            if str(target).startswith(str(storage)):
                writing.set()
                release.wait(10)
            return write(source_or_path, target_or_data)
        return to_storage

    monkeypatch.setattr(shutil_module, "copyfile", slow(shutil_module.copyfile))
    monkeypatch.setattr(store, "_write", slow(store._write))
    copier = threading.Thread(target=store.upload_whole_files, args=(str(staging), str(storage)))
    copier.start()
    try:
        assert writing.wait(10)
        assert store.SAVE_LOCK.acquire(timeout=2), "a save waited for the copy's write to storage"
        store.SAVE_LOCK.release()
    finally:
        release.set()
        copier.join(10)
    assert (storage / "experiment_state-1.json").read_text() == '{"trial_data": [1]}'


@pytest.mark.slow
def test_a_resume_deletes_the_checkpoints_no_trial_names(before_and_after, tmp_path):
    """What a killed driver can leave in a trial's folder besides the checkpoints its stored state
    names (a checkpoint whose deletion was queued, one it was writing) is deleted when the
    experiment is resumed; the named ones stay (`remove_unnamed_checkpoints`)."""
    from ray.tune import ExperimentAnalysis

    from agents.trial_checkpoints import remove_unnamed_checkpoints

    _, after, _ = before_and_after
    experiment = tmp_path / "run"
    shutil.copytree(after, experiment)
    (trial,) = glob.glob(os.path.join(experiment, "LMPPO_*"))
    named = sorted(glob.glob(os.path.join(trial, "checkpoint_*")))
    assert len(named) == 3
    for orphan in ("checkpoint_000007", "checkpoint_000042"):
        shutil.copytree(named[0], os.path.join(trial, orphan))
    trials = ExperimentAnalysis(str(experiment)).trials
    assert sorted(os.path.basename(p) for p in remove_unnamed_checkpoints(trials)) == \
        ["checkpoint_000007", "checkpoint_000042"]
    assert sorted(glob.glob(os.path.join(trial, "checkpoint_*"))) == named


def test_a_checkpoint_another_trial_names_is_kept(tmp_path):
    """PBT restores a trial from another's checkpoint: that trial names it (its latest), so it
    stays though its own trial's retention dropped it; a trial without a folder yet is passed
    over. (Trials here are stand-ins with the attributes the function reads.)"""
    from types import SimpleNamespace

    import pyarrow.fs

    from agents.trial_checkpoints import remove_unnamed_checkpoints

    def trial(name, kept=(), latest=None):
        results = [SimpleNamespace(checkpoint=SimpleNamespace(path=str(tmp_path / p))) for p in kept]
        latest = SimpleNamespace(checkpoint=SimpleNamespace(path=str(tmp_path / latest))) if latest else None
        storage = SimpleNamespace(storage_filesystem=pyarrow.fs.LocalFileSystem(), trial_fs_path=str(tmp_path / name))
        return SimpleNamespace(run_metadata=SimpleNamespace(checkpoint_manager=SimpleNamespace(_checkpoint_results=results)),
                               latest_checkpoint_result=latest, storage=storage)

    for path in ("a/checkpoint_000001", "b/checkpoint_000001", "b/checkpoint_000002", "b/checkpoint_000003"):
        (tmp_path / path).mkdir(parents=True)
    strong = trial("b", kept=["b/checkpoint_000003"], latest="b/checkpoint_000003")
    weak = trial("a", kept=["a/checkpoint_000001"], latest="b/checkpoint_000002")  # cloned from b's
    unstarted = trial("c")
    assert remove_unnamed_checkpoints([strong, weak, unstarted]) == [str(tmp_path / "b" / "checkpoint_000001")]
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.glob("*/checkpoint_*")) == \
        ["a/checkpoint_000001", "b/checkpoint_000002", "b/checkpoint_000003"]


def test_a_checkpoints_list_of_files_finds_a_file_cut_short_changed_or_missing(tmp_path):
    """`write_manifest` / `damaged`: what a resume and a loaded policy check a checkpoint with."""
    from agents.whole_files import MANIFEST, damaged, write_manifest

    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "weights.pkl").write_bytes(b"w" * 1000)
    (tmp_path / "state.pkl").write_bytes(b"s" * 10)
    assert damaged(str(tmp_path)) is None  # no list: written before there was one
    write_manifest(str(tmp_path))
    assert damaged(str(tmp_path)) is None and json.loads((tmp_path / MANIFEST).read_text())["policy/weights.pkl"][0] == 1000
    (tmp_path / "added.json").write_text("{}")  # a file added since is not looked at
    assert damaged(str(tmp_path)) is None
    (tmp_path / "policy" / "weights.pkl").write_bytes(b"w" * 999 + b"x")  # same size, other bytes
    assert damaged(str(tmp_path)) == "policy/weights.pkl changed since it was saved"
    assert damaged(str(tmp_path), "policy") == "policy/weights.pkl changed since it was saved"
    (tmp_path / "policy" / "weights.pkl").write_bytes(b"w" * 100)
    assert damaged(str(tmp_path)) == "policy/weights.pkl holds 100 bytes of 1,000"
    (tmp_path / "policy" / "weights.pkl").write_bytes(b"w" * 1000)
    os.remove(tmp_path / "state.pkl")
    assert damaged(str(tmp_path)) == "state.pkl is missing"
    assert damaged(str(tmp_path), "policy") is None  # only the policy's files: they are whole
    (tmp_path / MANIFEST).write_text('{"state.pk')
    assert damaged(str(tmp_path)) == f"its {MANIFEST} cannot be read"
    (tmp_path / MANIFEST).write_text('{"state.pkl": 5}')  # JSON, not a list of files
    assert damaged(str(tmp_path)) == f"its {MANIFEST} cannot be read"


def test_a_resume_goes_back_past_damaged_checkpoints_in_the_order_the_trial_saved_them(tmp_path):
    """A trial's checkpoints in save order, its iterations restarted by a PBT exploit (5, 6, then 2,
    3, 4); the two newest are damaged: it goes on from the third newest (iteration 2), not from the
    one with the highest iteration, and its list keeps the save order."""
    import types

    import pyarrow.fs

    from agents.trial_checkpoints import go_back_from_lost_checkpoints
    from agents.whole_files import write_manifest

    results = []
    for n, it in enumerate((5, 6, 2, 3, 4)):
        folder = tmp_path / f"checkpoint_{n:06d}"
        folder.mkdir()
        (folder / "state.pkl").write_bytes(b"x" * 50)
        write_manifest(str(folder))
        results.append(types.SimpleNamespace(checkpoint=types.SimpleNamespace(path=str(folder)),
                                             metrics={"training_iteration": it}))
    for damaged_one in results[3:]:
        os.truncate(os.path.join(damaged_one.checkpoint.path, "state.pkl"), 10)
    manager = types.SimpleNamespace(_checkpoint_results=list(results), _latest_checkpoint_result=results[-1])
    trial = types.SimpleNamespace(trial_id="t_00000", latest_checkpoint_result=results[-1],
                                  run_metadata=types.SimpleNamespace(checkpoint_manager=manager),
                                  storage=types.SimpleNamespace(storage_filesystem=pyarrow.fs.LocalFileSystem()))
    said = []
    go_back_from_lost_checkpoints([trial], said.append)
    assert manager._latest_checkpoint_result is results[2] and manager._checkpoint_results == results[:3]
    assert said == [f"--resume: trial t_00000's checkpoint checkpoint_000004 is damaged (state.pkl holds 10 bytes of "
                    f"50) in {tmp_path}; it goes on from its newest one left, checkpoint_000002 (iteration 2)"]
