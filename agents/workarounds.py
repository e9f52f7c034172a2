"""The places where agents.train works around Ray Tune's, Ray's and W&B's internals, in one module.

Each relies on a private name or an unpublished behaviour of those libraries;
`tests/test_rllib_contract.py` pins every private name used here (and the source lines each
relies on), so an upgrade that renames or re-signs one fails there, loudly, instead of silently
changing behaviour. The unpublished behaviours are checked against the libraries themselves in
tests/test_reproducibility.py (W&B's run file, the driver's memory, a state cut short).

* `forget_encoded_values`, run by `make_log_once_pruner`'s callback: Tune's JSON encoder leaves a
  `log_once` key (`ray.util.debug._logged`) per value it cannot encode, one per metric and save
  of the experiment state; they are dropped, so the driver's memory stays flat over long runs.
* `release_resolved_task_futures`: Tune's actor manager keeps every task future of a trial's actor
  until the actor is removed (`RayActorManager._schedule_tracked_actor_task`, the event manager's
  `_tracked_futures`); each is dropped once it resolved, so results do not pile up in the driver.
* `make_curve_logger` and `make_progress_csv_logger` (with `drop_iterations_from`): Tune's
  TensorBoard and progress.csv loggers (`_trial_writer`, `_trial_result`, `_summary_writer_cls`,
  `_trial_files`, `_setup_trial`), without the iterations a trial restored from a checkpoint repeats.
* `make_wandb_callback` (with `SkipLoggedSteps`, `wandb_logged_steps`, `wandb_run_file_steps`): Ray's
  W&B logger (`_WandbLoggingActor`, its `_wandb`, `_logger_actor_cls`) writing each trial's W&B run
  into the trial's folder, a resumed trial logging to its own run without repeating a step; the
  steps an offline run holds are read from W&B's run file (its record log, read as W&B writes it).
* `replace_restored_callbacks`: a restored Tuner carries the callbacks pickled when the run
  started (`Tuner._local_tuner`); the resumed run prints through this process's instead.

How the experiment is stored (its copy to the storage path, checkpoint deletion, the checks before
a resume) is in `agents.experiment_store`, under the same rules.
"""
from __future__ import annotations

import os
import time


def drop_iterations_from(trial_dir: str, first: int, files=("result.json", "progress.csv")) -> bool:
    """Removes the rows of iteration `first` and later from a trial's result.json and
    progress.csv; True if there were any. A trial restored from a checkpoint repeats the
    iterations after it, and its curve must not show them twice."""
    import csv
    import json

    dropped = False
    path = os.path.join(trial_dir, "result.json")
    if "result.json" in files and os.path.isfile(path):
        with open(path) as f:
            lines = [line for line in f if line.strip()]
        keep = [line for line in lines if json.loads(line).get("training_iteration", 0) < first]
        if len(keep) < len(lines):
            dropped = True
            with open(path, "w") as f:  # Tune's logger appends (O_APPEND): it goes on after these
                f.writelines(keep)
    path = os.path.join(trial_dir, "progress.csv")
    if "progress.csv" in files and os.path.isfile(path):
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        if rows and "training_iteration" in rows[0]:
            col = rows[0].index("training_iteration")
            keep = [rows[0]] + [r for r in rows[1:] if r and int(float(r[col])) < first]
            if len(keep) < len(rows):
                dropped = True
                with open(path, "w", newline="") as f:
                    csv.writer(f).writerows(keep)
    return dropped


# Tune's JSON encoder calls `ray.util.debug.log_once(f"tune_func_encode:{obj}")` for every value
# JSON cannot hold, and log_once keeps each key for the life of the process. Each save of the
# experiment state (every `checkpoint.state_every_s`) encodes every metric's recent values (a
# deque per metric), so the driver gained one key per metric and save: about 80 MB an hour.
ENCODER_LOG_KEY = "tune_func_encode:"


def forget_encoded_values() -> int:
    """Drops the keys Tune's encoder left in the driver's `log_once` registry; returns how many."""
    from ray.util import debug

    stale = [key for key in debug._logged if key.startswith(ENCODER_LOG_KEY)]
    debug._logged.difference_update(stale)
    return len(stale)


# Tune's actor manager adds every task it schedules on a trial's actor (each `train()` call, each
# save) to a per-actor set of futures, and empties that set only when the actor is removed: a
# trial's driver kept the reference to every result it had received, so each result stayed in the
# driver's object store for the trial's life (about 17 KB per quickstart iteration, 35-45 MB an
# hour). `release_resolved_task_futures` drops a future from that set once it has resolved; the
# set then holds only the tasks still running, which is what removing an actor needs.
def release_resolved_task_futures() -> None:
    """Installs the fix on Tune's actor manager (once per process; driver side)."""
    from ray.air.execution._internal.actor_manager import RayActorManager

    original = RayActorManager._schedule_tracked_actor_task
    if getattr(original, "releases_resolved_futures", False):
        return

    def schedule(self, tracked_actor_task, method_name, *, args=None, kwargs=None, _return_future=False):
        task, future = original(self, tracked_actor_task, method_name, args=args, kwargs=kwargs, _return_future=True)
        actor, tracked = task._tracked_actor, self._actor_task_events._tracked_futures
        on_result, on_error = tracked[future]

        def forget():
            futures = self._tracked_actors_to_task_futures.get(actor)
            if futures is not None:
                futures.discard(future)

        def result(value):
            forget()
            return on_result(value)

        def error(exception):
            forget()
            return on_error(exception)

        tracked[future] = (result, error)
        return (task, future) if _return_future else task

    schedule.releases_resolved_futures, schedule.original = True, original
    RayActorManager._schedule_tracked_actor_task = schedule


# Ray 2.60 Tune: a trial that fails while a checkpoint save is in flight leaves a "STOP once the
# save resolves" decision in the controller (`_cached_trial_decisions`), and the experiment state
# saves it. `--resume` (resume_errored) restores it with the state and runs it after the trial's
# first save in the new driver: the errored trial ran one iteration more and was then marked
# finished, exit code 0. Decisions belong to the process that made them; a restored controller
# starts with none.
def drop_restored_trial_decisions() -> None:
    """Installs the fix on Tune's controller (once per process; driver side)."""
    from ray.tune.execution.tune_controller import TuneController

    original = TuneController.__setstate__
    if getattr(original, "drops_trial_decisions", False):
        return

    def setstate(self, state):
        original(self, state)
        self._cached_trial_decisions = {}
        self._queued_trial_decisions = {}

    setstate.drops_trial_decisions, setstate.original = True, original
    TuneController.__setstate__ = setstate


# Ray 2.60 Tune: on Ctrl-C (SIGINT, or SIGUSR1) `tune.run` saves the experiment's state, stops
# the trials and returns, with every trial marked finished; only a log line says it was
# interrupted. The event its signal handler sets (`_setup_signal_catching`) is kept here, so the
# CLI can say so and exit as an interrupted program does.
_INTERRUPTS = []


def note_tune_interrupts() -> None:
    """Keeps each Tune run's interrupt event (once per process; driver side)."""
    import ray.tune.tune as tune_run

    original = tune_run._setup_signal_catching
    if getattr(original, "keeps_events", False):
        return

    def setup():
        event = original()
        _INTERRUPTS.append(event)
        return event

    setup.keeps_events, setup.original = True, original
    tune_run._setup_signal_catching = setup


def tune_interrupted() -> bool:
    """Whether this process's last Tune run was stopped by its signal handler."""
    return bool(_INTERRUPTS) and _INTERRUPTS[-1].is_set()


def make_log_once_pruner(every_s: float = 10.0):
    from ray.tune import Callback

    class ForgetEncodedValues(Callback):
        """Keeps the driver's memory flat over long runs (see `forget_encoded_values`)."""

        def __init__(self):
            self._next = 0.0

        def on_step_end(self, iteration, trials, **info):
            now = time.monotonic()
            if now >= self._next:
                self._next = now + every_s
                forget_encoded_values()

    return ForgetEncodedValues()


def make_curve_logger():
    from ray.tune.logger import TBXLoggerCallback

    class ContinuousCurves(TBXLoggerCallback):
        """Tune's TensorBoard logger, and a restored trial's curves without repeated iterations.

        When a trial comes back from a checkpoint (a retry, or `--resume` in a new driver)
        its first result repeats an iteration already logged: the rows from there on are
        dropped from result.json and progress.csv before Tune's loggers append, and the
        TensorBoard writer is reopened with `purge_step`, which hides the old events from
        that step on. So too for a trial a new driver restarts from iteration 1 (it had no
        checkpoint): event files of the earlier driver's lie beside this one's.
        """

        def __init__(self):
            super().__init__()
            self._last_iteration, self._own_events = {}, {}

        def log_trial_start(self, trial):
            before = _event_files(trial.local_path)
            super().log_trial_start(trial)
            self._own_events[trial] = _event_files(trial.local_path) - before

        def _earlier_events(self, trial) -> bool:
            """Whether the trial's folders hold event files another writer wrote (a driver before)."""
            folders = {trial.local_path, trial.path if isinstance(trial.path, str) else None} - {None}
            return bool(set().union(*map(_event_files, folders)) - self._own_events.get(trial, set()))

        def log_trial_result(self, iteration, trial, result):
            n = result.get("training_iteration")
            last = self._last_iteration.get(trial)
            if n is not None and (last is None or n <= last):
                if (drop_iterations_from(trial.local_path, n) or (last is not None and n <= last)
                        or (last is None and self._earlier_events(trial))):
                    if trial in self._trial_writer:
                        self._trial_writer[trial].close()
                    trial.init_local_path()
                    self._trial_writer[trial] = self._summary_writer_cls(
                        trial.local_path, flush_secs=30, purge_step=n)
                    self._trial_result[trial] = {}
            if n is not None:
                self._last_iteration[trial] = n
            super().log_trial_result(iteration, trial, result)

    return ContinuousCurves()


def _event_files(folder: str) -> set[str]:
    """The TensorBoard event files' names in a folder."""
    try:
        return {name for name in os.listdir(folder) if name.startswith("events.out.tfevents.")}
    except OSError:
        return set()


def make_progress_csv_logger():
    from ray.tune.logger import CSVLoggerCallback

    class ContinuousProgressCsv(CSVLoggerCallback):
        """Tune's progress.csv logger, without a restored trial's repeated iterations.

        Tune opens progress.csv at a trial's first result in this driver and, for a trial
        with a checkpoint, first copies it back from storage, where it may hold rows past
        that checkpoint (the storage copy is synced on its own schedule). The rows from
        the repeated iteration on are dropped after that copy, before the first append.
        (A trial retried in the same driver keeps its file open and gets no copy; there
        ContinuousCurves drops the rows.)
        """

        def log_trial_result(self, iteration, trial, result):
            if trial not in self._trial_files:
                self._setup_trial(trial)
                n = result.get("training_iteration")
                if n is not None:
                    # Tune's handle appends (O_APPEND): it writes after the rows kept here.
                    drop_iterations_from(trial.local_path, n, files=("progress.csv",))
            super().log_trial_result(iteration, trial, result)

    return ContinuousProgressCsv()


def wandb_logged_steps(folder: str, run_id: str) -> list[int]:
    """The steps logged to W&B run `run_id` in the offline (or synced) run folders under
    `folder`/wandb, oldest run first."""
    import glob

    steps = []
    for path in sorted(glob.glob(os.path.join(folder, "wandb", f"*-{run_id}", f"run-{run_id}.wandb"))):
        steps += wandb_run_file_steps(path)
    return steps


def wandb_run_file_steps(path: str) -> list[int]:
    """The history steps in one W&B run file (`run-<id>.wandb`: W&B's record log, 32 KiB blocks
    of chunks with a 7-byte header, each record a protobuf `Record`). A file cut short by a
    killed process gives the records before the cut."""
    import struct

    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    steps, pos, block, record = [], 7, 32768, b""  # after the file header (":W&B", version)
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        if pos + 7 + n > len(data):
            break
        record += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # a full record, or the last chunk of one
            rec = wandb_internal_pb2.Record()
            try:
                rec.ParseFromString(record)
            except Exception:  # noqa: BLE001 - a torn record at a kill: stop at it
                break
            record = b""
            if rec.WhichOneof("record_type") == "history":
                steps.append(int(rec.history.step.num))
    return steps


class SkipLoggedSteps:
    """`wandb` for Ray's W&B logging actor, logging only steps after those the run already has:
    `init` finds the last one (W&B's resumed step count online, the trial's earlier offline run
    files offline) and `log` drops results of iterations up to it (a resumed trial repeats the
    iterations after its checkpoint)."""

    def __init__(self, wandb, folder: str):
        self._wandb, self._folder, self.last_logged = wandb, folder, 0

    def init(self, *args, **kwargs):
        earlier = wandb_logged_steps(kwargs.get("dir") or self._folder, kwargs["id"]) if kwargs.get("id") else []
        run = self._wandb.init(*args, **kwargs)
        self.last_logged = max([int(getattr(run, "starting_step", 0) or 0) - 1, 0, *earlier])
        return run

    def log(self, data, step=None, **kwargs):
        if step is not None and step <= self.last_logged:
            return None
        return self._wandb.log(data, step=step, **kwargs)

    def __getattr__(self, name):
        return getattr(self._wandb, name)


def make_wandb_callback(cfg: dict, name: str):
    from ray.air.integrations.wandb import WandbLoggerCallback, _WandbLoggingActor

    online = os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") == "online"
    mode = os.environ.get("WANDB_MODE") or ("online" if online else "offline")
    os.environ["WANDB_MODE"] = mode  # Ray's callback reads it to skip the API-key check offline
    print(f"W&B: logging every trial to project {os.environ.get('WANDB_PROJECT', cfg['tune']['wandb_project'])!r} "
          f"({mode}{'; upload later with `wandb sync <trial dir>/wandb/offline-run-*`' if mode == 'offline' else ''})",
          flush=True)
    class ResumingWandbLogger(_WandbLoggingActor):
        """Ray's W&B logging actor, resuming the trial's W&B run without logging a step twice."""

        def __init__(self, logdir, *args, **kwargs):
            super().__init__(logdir, *args, **kwargs)
            self._wandb = SkipLoggedSteps(self._wandb, logdir)

    class TrialDirWandb(WandbLoggerCallback):
        """W&B runs go straight into each trial's own folder when storage is local.

        Ray starts the logging process in the trial's driver staging folder, which is copied
        to storage when the trial ends; the last trials to end finish their W&B run after
        that copy, so their offline runs would stay behind in Ray's session folder. A
        restored trial resumes its W&B run (same id) and skips the steps it already holds.
        """

        _logger_actor_cls = ResumingWandbLogger

        def log_trial_start(self, trial):
            import pyarrow.fs

            if isinstance(trial.storage.storage_filesystem, pyarrow.fs.LocalFileSystem):
                os.makedirs(trial.path, exist_ok=True)
                self.kwargs["dir"] = trial.path
            else:
                self.kwargs.pop("dir", None)
            super().log_trial_start(trial)

    return TrialDirWandb(project=os.environ.get("WANDB_PROJECT", cfg["tune"]["wandb_project"]), group=name,
                         mode=mode, resume="allow", excludes=["_model_config", "env_config"])


def replace_restored_callbacks(tuner, callbacks: list) -> None:
    """A Tuner restored with `Tuner.restore` carries the callbacks pickled at the start of the run;
    this process's `callbacks` replace them, so progress lines and the summary cover the resumed
    iterations (no public way to set them exists)."""
    tuner._local_tuner.get_run_config().callbacks = callbacks
