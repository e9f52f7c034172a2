"""How a run's experiment lives on its storage path: copied there one whole file at a time, its
old checkpoints deleted only once no stored state names them, and checked before a resume.

Like `agents.workarounds`, each of these hooks a private name of Ray Tune's or Ray Train's, pinned
in `tests/test_rllib_contract.py`:

* `store_experiments_safely` installs both fixes below on the driver (once per process):
* `upload_whole_files` (for a local storage path): Tune's background copy of the experiment
  (`_FilesystemSyncer._sync_up_command`) writes each file whole and renames it into place, the top
  folder's files (the experiment's state among them) last and as one (`PLACING`): a driver killed
  at any moment of the copy leaves a state that resumes.
  Copies of one folder in flight at once place their files in the order they were started.
* Deferred checkpoint deletion: Tune's retention (`checkpoint.num_to_keep`) deletes a trial's
  oldest checkpoint as soon as a new one registers (`_CheckpointManager.register_checkpoint`,
  through its module's `_delete_fs_path`), while the experiment state naming the new one reaches
  the storage path later, in the background copy. A driver killed between the two left a stored
  state whose trial checkpoint was gone, and `--resume` failed that trial. The deletion now waits
  for a copy that stored a state saved after it (on any filesystem); what a killed driver left
  undeleted is deleted on `--resume` (`agents.trial_checkpoints.remove_unnamed_checkpoints`).
* `hook_experiment_saves`: a copy reads the top folder's files (the experiment's state, the
  search algorithm's, the callbacks') as one save left them (before, the search algorithm's state,
  a pickle named .json, failed the copy's JSON check and never reached the storage path, so a
  resumed sweep lost the trials not yet made); a scheduler that can (ASHA, `agents.pbt`) is saved
  with them and restored on `--resume` (`TuneController.save_to_dir`, `.resume`).
* `check_experiment_state` finishes a killed copy's renames of the top folder's files, removes its
  partial files, and refuses, in one line, a state cut short by Tune's own copy (storage that is
  not local).

One driver per experiment: `agents.driver_lock`.
"""
from __future__ import annotations

import itertools
import json
import os
import threading
import time

from agents.driver_lock import DRIVER_FILE
from agents.trial_checkpoints import go_back_from_lost_checkpoints, remove_unnamed_checkpoints
from agents.whole_files import PARTIAL_NAME, partial_path, remove_partial_files

def newest_experiment_state(experiment: str) -> str | None:
    """The experiment's newest saved state file, as Tune picks it (by name: the run's start time)."""
    import glob

    return max(glob.glob(os.path.join(glob.escape(experiment), "experiment_state-*.json")), default=None)


def check_experiment_state(experiment: str) -> None:
    """Removes the partial files of a copy that was killed (`upload_whole_files`), and refuses, in
    one line, an experiment whose saved state is empty or cut short (a run of an older version,
    whose copy wrote the files in place, killed during it): Tune would start the run afresh under
    the old name or wait forever for a trial that never starts. First it finishes the renames of a
    copy killed while it put the top folder's files in place (`finish_placing`)."""
    finish_placing(experiment)
    remove_partial_files(experiment, recursive=True)  # what a copy killed midway left beside its targets
    newest = newest_experiment_state(experiment)
    if newest is None:
        return
    try:
        with open(newest) as f:
            json.load(f)
    except (OSError, ValueError):
        raise ValueError(f"--resume: the experiment state {newest} is empty or cut short (the run was killed "
                         "while Tune was copying it to the storage path); there is nothing to resume from") from None


def _excluded(rel: str, exclude) -> bool:
    """Tune's exclusion rule for a file (`_ExcludingLocalFilesystem._should_exclude`): a pattern
    matches the file's path relative to the copied folder."""
    import fnmatch

    return any(fnmatch.fnmatch(rel, pattern) for pattern in exclude or ())


def _whole_copy(source: str, partial: str, rel: str) -> bool:
    """Copies a trial's file `source` to `partial` as a file that is whole in itself, or returns
    False. Tune may be appending to it meanwhile (the driver appends results while the copy of the
    previous save runs): a log of lines (result.json, progress.csv) is cut after its last whole line."""
    import shutil

    try:
        shutil.copyfile(source, partial)
    except FileNotFoundError:  # the staging copy went away meanwhile (a trial's folder removed)
        return False
    if os.path.basename(rel) in ("result.json", "progress.csv"):
        with open(partial, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)
    return True


def _read_whole(source: str, rel: str) -> bytes | None:
    """The bytes of a file of the top folder as a save left it, or None. Saves hold SAVE_LOCK, and
    so does the caller; the experiment's state (JSON) written by a save that did not hold it must
    parse, else it is read again (a few times, then left out of this copy). The others (the search
    algorithm's state, the callbacks') are written whole."""
    for _ in range(5):
        try:
            with open(source, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        if not rel.startswith("experiment_state-"):
            return data
        try:
            json.loads(data)
            return data
        except ValueError:
            time.sleep(0.05)
    return None


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


# Copies of one folder in flight at once (Tune starts another when one runs past its timeout)
# place their files in the order they were started: once a copy has placed a file, an older one
# places nothing more (it would put an older experiment state over the newer one, naming
# checkpoints the newer copy's deletions removed, or older result rows under a newer state).
_PLACE_LOCK = threading.Lock()
_placed_by: dict[str, int] = {}  # storage folder -> the order of the newest copy that placed a file there


def _newest_copy(folder: str, order: int | None) -> bool:
    """Whether the copy `order` may place files in `folder` (no newer copy has); holds _PLACE_LOCK."""
    if order is not None:
        if order < _placed_by.get(folder, 0):
            return False
        _placed_by[folder] = order
    return True


def _place(partial: str, target: str, folder: str, order: int | None) -> bool:
    with _PLACE_LOCK:
        if not _newest_copy(folder, order):
            return False
        os.replace(partial, target)
    return True


# The top folder's files are renamed into place as one: a journal naming them ([[partial, name], ...],
# both in the top folder) is put in place first, then each file, then the journal is removed. A copy
# killed among the renames is finished by `finish_placing` before a resume: the search algorithm's
# state is never newer than the experiment's (the trials it made in between would be lost), nor the
# experiment's newer than the search algorithm's (which would make those trials again).
PLACING = "placing.journal"


def _place_together(written: list[tuple[str, str]], folder: str, tag: str, order: int | None,
                    journaled: list) -> bool:
    """Renames the files `written` ((partial, target), all in one folder) into place as one
    (`PLACING`); `folder`, `order`: as `_place`'s. `journaled` gets True once the journal is in
    place: a rename that fails after it leaves the journal and the partial files it names for
    `finish_placing` (deleting them would leave the folder's files of two saves)."""
    if len(written) == 1:  # one rename is atomic by itself
        return _place(*written[0], folder, order)
    journal = os.path.join(os.path.dirname(written[0][1]), PLACING)
    with _PLACE_LOCK:
        if not _newest_copy(folder, order):
            return False
        _write(journal + tag, json.dumps([[os.path.basename(p), os.path.basename(t)] for p, t in written]).encode())
        os.replace(journal + tag, journal)
        journaled.append(True)
        for partial, target in written:
            os.replace(partial, target)
        os.remove(journal)
    return True


def placing_pending(experiment: str) -> bool:
    """Whether a killed copy's renames wait in the experiment's journal (`PLACING`): its state may
    be there alone."""
    return os.path.isfile(os.path.join(experiment, PLACING))


def finish_placing(experiment: str) -> list[str]:
    """Finishes the renames of a copy killed while it put the top folder's files in place (its
    journal names them; each file renamed already is gone from its partial name). Returns the
    files put in place. Run where no driver copies to `experiment` (before a resume)."""
    journal = os.path.join(experiment, PLACING)
    try:
        with open(journal, "rb") as f:
            pairs = json.loads(f.read())
    except FileNotFoundError:
        return []
    except ValueError:  # placed whole by a rename, so never cut short; damaged otherwise: the old files stand
        pairs = []
    placed = []
    for pair in pairs if isinstance(pairs, list) else ():
        if not (isinstance(pair, list) and len(pair) == 2 and all(
                isinstance(n, str) and n and os.path.basename(n) == n and n not in (".", "..") for n in pair)):
            continue  # only names in the top folder
        partial, name = pair
        if os.path.isfile(os.path.join(experiment, partial)):
            os.replace(os.path.join(experiment, partial), os.path.join(experiment, name))
            placed.append(name)
    os.remove(journal)
    return placed


def upload_whole_files(local_path: str, fs_path: str, exclude=None, order: int | None = None) -> list[str]:
    """Copies a folder (or a file) to a local storage path one whole file at a time: each file is
    written beside its target and renamed over it (`os.replace`, atomic), so a process killed at
    any moment leaves every file either as it was or as it is now, never cut short. The trials'
    files go first and the experiment's state (which names each trial's checkpoint) last: when a
    new state is in place, so is everything it points to, and every result row it implies.
    `order`: this copy's place among the copies started (`_place`). Returns the files put in place
    (relative paths; a file Tune was still writing is left for the next copy)."""
    copies, placed = [], []  # (relative path, source, target)
    if os.path.isfile(local_path):
        copies.append((os.path.basename(fs_path), local_path, fs_path))
    for root, _, names in os.walk(local_path):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), local_path).replace(os.sep, "/")
            if not PARTIAL_NAME.search(name) and not _excluded(rel, exclude) and rel not in (DRIVER_FILE, PLACING):
                copies.append((rel, os.path.join(local_path, rel), os.path.join(fs_path, rel)))

    # a copy of its own per thread: Tune starts another after a copy that ran past its timeout
    tag = partial_path("")
    # the top folder's files (the experiment's state, the search algorithm's, the callbacks', the
    # scheduler's): the experiment's state last, the newest of them last (Tune resumes from it)
    states = sorted((c for c in copies if "/" not in c[0]), key=lambda c: (c[0].startswith("experiment_state-"), c[0]))
    others = sorted(c for c in copies if "/" in c[0])
    # The top folder's files are read first, into memory, as one save left them all (a save holds
    # the lock; the search algorithm's state newer than the experiment's would lose the trials it
    # made meanwhile), and written and put in place last, outside the lock (slow storage does not
    # hold the driver's saves): a stored state is never newer than the trials' files.
    with SAVE_LOCK:
        read = [(rel, target, data) for rel, source, target in states
                if (data := _read_whole(source, rel)) is not None]
    for rel, source, target in others:
        partial = target + tag
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if not _whole_copy(source, partial, rel):
                continue
            if not _place(partial, target, fs_path, order):
                return placed  # a newer copy placed its files: this one's are older
            placed.append(rel)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
    newest = max((rel for rel, _, _ in states if rel.startswith("experiment_state-")), default=None)
    if newest is not None and newest not in {rel for rel, _, _ in read}:
        # the newest experiment state left out (written meanwhile; an older run's, which a resume
        # copied down, may be read): none of the top folder's files
        return placed
    written, journaled = [], []  # the top folder's files, written beside their targets, then put in place as one
    try:
        for rel, target, data in read:
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
            _write(target + tag, data)
            written.append((target + tag, target))
        if written and _place_together(written, fs_path, tag, order, journaled):
            placed += [rel for rel, _, _ in read]
    finally:
        for partial, _ in written if not journaled else ():
            if os.path.exists(partial):
                os.remove(partial)
    return placed


# held while Tune saves the experiment's state files (hook_experiment_saves wraps the
# save) and while a copy reads them, so a copy takes the files of one save
SAVE_LOCK = threading.Lock()

# (filesystem, path) of each checkpoint the retention dropped, deleted by the first copy that
# stores a state saved after the drop (that state no longer names it)
_DUE: list = []
_DUE_LOCK = threading.Lock()


def _delete_later(fs, fs_path) -> None:
    with _DUE_LOCK:
        _DUE.append((fs, fs_path))


def _copy_then_delete(copy, kwargs: dict, due: list, local_path: str) -> None:
    """Runs Tune's copy of the driver's staging folder (`copy(**kwargs)`), then deletes the
    checkpoints in `due` if the copy stored the newest state the folder holds; else they wait for
    the next copy."""
    import pyarrow.fs
    from ray.train._internal.storage import _delete_fs_path

    try:
        copied = copy(**kwargs)
    except BaseException:
        with _DUE_LOCK:
            _DUE[:0] = due
        raise
    newest = newest_experiment_state(local_path)
    if isinstance(copied, list) and newest and os.path.basename(newest) not in copied:
        with _DUE_LOCK:  # the state did not parse in time and was left for the next copy
            _DUE[:0] = due
        return
    for fs, fs_path in due:
        if fs.get_file_info(fs_path).type != pyarrow.fs.FileType.NotFound:  # a retried copy deleted it
            _delete_fs_path(fs=fs, fs_path=fs_path)


def store_experiments_safely() -> None:
    """Installs the whole-file copy (a local storage path) and the deferred checkpoint deletion
    (any storage) on Tune's background copy of the experiment (once per process; driver side)."""
    import pyarrow.fs
    import ray.train._internal.checkpoint_manager as checkpoint_manager
    from ray.train._internal.storage import _FilesystemSyncer

    if not getattr(checkpoint_manager._delete_fs_path, "deferred", False):
        _delete_later.deferred, _delete_later.original = True, checkpoint_manager._delete_fs_path
        checkpoint_manager._delete_fs_path = _delete_later
    original = _FilesystemSyncer._sync_up_command
    if getattr(original, "whole_files", False):
        return

    def sync_up_command(self, local_path, uri, exclude=None):
        # the state saved just before this copy was made after every deletion queued so far
        with _DUE_LOCK:
            due, _DUE[:] = list(_DUE), []
        fs = self.storage_filesystem
        if fs is not None and not isinstance(fs, pyarrow.fs.LocalFileSystem):
            copy, kwargs = original(self, local_path, uri, exclude)
        else:
            copy, kwargs = upload_whole_files, {"local_path": local_path, "fs_path": uri, "exclude": exclude,
                                                "order": next(sync_up_command.started)}
        return _copy_then_delete, {"copy": copy, "kwargs": kwargs, "due": due, "local_path": local_path}

    sync_up_command.whole_files, sync_up_command.original = True, original
    sync_up_command.started = itertools.count(1)  # the copies' order (`_place`)
    _FilesystemSyncer._sync_up_command = sync_up_command


# The stop criteria a `--resume` goes on with where they differ from the run's first ones (train
# longer, or less); [] otherwise. Set by `apply_resume_stop` before each run in this process, with
# where its lines go (`_RESUME_SAY`).
_RESUME_STOP: list = []
_RESUME_SAY: list = [None]


def _meets(criteria: dict, result: dict | None) -> bool:
    """Whether `result` (a trial's, nested) meets any of the stop `criteria` (keys as Tune's
    flattened ones, "env_runners/episode_return_mean"), as `Trial.should_stop` judges them."""
    from ray.tune.utils import flatten_dict

    flat = flatten_dict(result or {}, delimiter="/")
    return any(key in flat and flat[key] >= value for key, value in criteria.items())


def goes_on(trial, stop: dict) -> bool:
    """Whether a restored trial that ended goes on under the stop criteria `stop`: it ended by
    meeting its own, has a checkpoint to go on from, and does not meet `stop`."""
    from ray.tune.experiment import Trial

    return (trial.status == Trial.TERMINATED and trial.checkpoint is not None
            and _meets(trial.stopping_criterion, trial.last_result) and not _meets(stop, trial.last_result))


def apply_resume_stop(stop: dict | None, say=None) -> None:
    """`--resume` with stop criteria other than the run's first ones (`stop`: Tune's flattened
    keys; None: the run's own): every trial, restored or made later by the search algorithm, takes
    `stop`, and a trial that ended by meeting its criteria and does not meet these goes on from its
    last checkpoint. A trial that ended otherwise (a scheduler stopped it: ASHA, PBT's ends) stays
    ended, as does one with no checkpoint. A trial whose newest checkpoint is gone goes back to an
    older one (`go_back_from_lost_checkpoints`). `say(line)`: how many go on, and which go back. Hooks
    `TuneController._restore_trials` and `.add_trial` (once per process; driver side)."""
    from ray.tune.execution.tune_controller import TuneController
    from ray.tune.experiment import Trial

    _RESUME_STOP[:] = [] if stop is None else [dict(stop), say]
    _RESUME_SAY[0] = say
    if getattr(TuneController._restore_trials, "applies_stop", False):
        return
    original_restore, original_add = TuneController._restore_trials, TuneController.add_trial

    def restore_trials(self, experiment_state):
        trials = original_restore(self, experiment_state)
        go_back_from_lost_checkpoints([trial for trial in trials if trial.status != Trial.TERMINATED], _RESUME_SAY[0])
        if not _RESUME_STOP:
            return trials
        stop, say = _RESUME_STOP
        ended = [trial for trial in trials if trial.status == Trial.TERMINATED]
        going = [trial for trial in ended if goes_on(trial, stop)]
        go_back_from_lost_checkpoints(going, say)
        for trial in going:
            trial.set_status(Trial.PAUSED)  # resumed from its checkpoint, as an interrupted trial is
        if say and any(trial.stopping_criterion != stop for trial in ended):  # said where they differ
            others = "" if len(going) == len(ended) else (" (the others ended before their own stop, by a scheduler, "
                                                          "meet the new one, or have no checkpoint)")
            say(f"--resume: {len(going)} of {len(ended)} ended trials go on to the new stop criteria{others}")
        return trials

    def add_trial(self, trial):
        # an ended trial keeps the criteria it ended by (a later resume judges it by them)
        if _RESUME_STOP and trial.status != Trial.TERMINATED:
            trial.stopping_criterion = dict(_RESUME_STOP[0])
        return original_add(self, trial)

    restore_trials.applies_stop, restore_trials.original = True, original_restore
    add_trial.original = original_add
    TuneController._restore_trials, TuneController.add_trial = restore_trials, add_trial


SCHEDULER_FILE = "scheduler_state.json"  # a scheduler's own state (agents.pbt's ResumableASHA)


def hook_experiment_saves() -> None:
    """Each save of the experiment's state (`TuneController.save_to_dir`: the experiment's, the
    search algorithm's and the callbacks' files) holds SAVE_LOCK, so a copy reads the files of one
    save. Tune saves no scheduler with them (`_scheduler_alg` is left out): a scheduler that says
    it `saves_with_experiment` is saved beside them, and restored by `--resume` after the trials are
    back (`TuneController.resume`). Installed once per process; driver side."""
    from ray.tune.execution.tune_controller import TuneController

    original_save, original_resume = TuneController.save_to_dir, TuneController.resume
    if getattr(original_save, "saves_scheduler", False):
        return

    def save_to_dir(self):
        with SAVE_LOCK:
            original_save(self)
            if getattr(self._scheduler_alg, "saves_with_experiment", False):
                self._scheduler_alg.save(os.path.join(self._storage.experiment_driver_staging_path, SCHEDULER_FILE))

    def resume(self, resume_config):
        original_resume(self, resume_config)
        remove_unnamed_checkpoints(self.get_trials())
        # the experiment's .json files are in the staging folder by now (Tune's resume copied them)
        saved = os.path.join(self._storage.experiment_driver_staging_path, SCHEDULER_FILE)
        if getattr(self._scheduler_alg, "saves_with_experiment", False) and os.path.isfile(saved):
            self._scheduler_alg.restore(saved)

    save_to_dir.saves_scheduler, save_to_dir.original = True, original_save
    resume.original = original_resume
    TuneController.save_to_dir, TuneController.resume = save_to_dir, resume
