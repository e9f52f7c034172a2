"""One driver per experiment: `with DrivingExperiment(experiment):` holds a lock file in the
experiment's folder with a heartbeat, and a second driver (another `--resume`, or the same command
in a second terminal) is refused in one line while the first is alive (`check_no_live_driver`). No
private name of Ray's."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time

from agents.whole_files import write_whole

# One driver per experiment: a second one (another --resume, or the same command in a second
# terminal) would write into the live trials' folders and a newer experiment state beside theirs.
# {"pid", "host", "started", "heartbeat"}: the driver training the experiment now. Not .json:
# Tune's resume copies the experiment's .json and .pkl files into the driver's staging folder,
# whose files its copies put back, so a .json lock would come back with a frozen heartbeat.
DRIVER_FILE = "driver.lock"
HEARTBEAT_S = 5.0  # how often the driver rewrites it
STALE_S = 60.0  # a file not rewritten for this long is a dead driver's (on another machine)


def live_driver(experiment: str) -> str | None:
    """A description of the driver training `experiment` now, or None. On this machine: its
    process is alive (not a zombie) and, where it is the one that wrote the file (its start
    time), however long ago it last wrote it (a driver stopped with Ctrl-Z, or starved, still
    holds the experiment); otherwise (start times unknown, the number another process's now, or
    another machine): the file was rewritten within STALE_S."""
    try:
        with open(os.path.join(experiment, DRIVER_FILE)) as f:
            driver = json.load(f)
        pid, host, age = int(driver["pid"]), str(driver["host"]), time.time() - float(driver["heartbeat"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host == socket.gethostname():
        state = _process_state(pid)
        if not _alive(pid) or (state and state[0] in "ZX"):  # gone, or a zombie its parent has not reaped
            return None
        started = driver.get("started")
        if started is not None and state and state[1] == started:  # the process that wrote the file
            stopped = f"; stopped or starved? `kill -CONT {pid}` or end it" if age > STALE_S else ""
            return f"process {pid} on {host} (its last sign {max(age, 0):.0f}s ago{stopped})"
        # else its number may be another process's now: judged by its heartbeat, as on another machine
    if age > STALE_S:
        return None
    return f"process {pid} on {host} (its last sign {max(age, 0):.0f}s ago)"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _process_state(pid: int) -> tuple[str, str] | None:
    """The process's state letter (R, S, T stopped, Z zombie, ...) and when it started, in the
    kernel's clock ticks since boot (Linux's /proc); None where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the name, which may hold anything
        return fields[0].decode("ascii", "replace"), fields[19].decode("ascii", "replace")
    except (OSError, IndexError):
        return None


def _process_start(pid: int) -> str | None:
    state = _process_state(pid)
    return state[1] if state else None


def check_no_live_driver(experiment: str) -> None:
    """Refuses, in one line, an experiment another live driver is training."""
    driver = live_driver(experiment)
    if driver:
        raise ValueError(f"the run {os.path.basename(experiment)!r} is being trained now by {driver}: stop it "
                         f"first, or use another tune.name (a driver that died leaves {DRIVER_FILE} in the "
                         f"experiment, stale after {STALE_S:.0f}s)")


TAKEOVER_WAIT_S = 10.0  # how long a driver waits for another one taking over the experiment


@contextlib.contextmanager
def _one_at_a_time(experiment: str):
    """Holds an exclusive lock on the experiment's folder (`flock`) for the block, where the
    filesystem has one: on this machine, of the drivers taking over a dead driver's file at once,
    one takes it and the others then find it live. One still held after TAKEOVER_WAIT_S (a driver
    stopped in the block) is refused in one line. Without one (some network filesystems), the
    block runs unlocked."""
    try:
        import fcntl

        fd = os.open(experiment, os.O_RDONLY)
    except (ImportError, OSError):
        yield
        return
    try:
        deadline = time.monotonic() + TAKEOVER_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ValueError(f"the run {os.path.basename(experiment)!r} is being taken over by another "
                                     "driver now: try again in a moment") from None
                time.sleep(0.05)
            except OSError:  # no locks on this filesystem
                break
        yield
    finally:
        os.close(fd)  # and the lock with it


class DrivingExperiment:
    """`with DrivingExperiment(experiment):` holds the experiment's driver file for the block,
    rewriting it every HEARTBEAT_S seconds from a thread; refuses an experiment a live driver holds."""

    def __init__(self, experiment: str):
        self.path = os.path.join(experiment, DRIVER_FILE)
        self.experiment = experiment
        self._stop = threading.Event()
        self._thread = None

    def _write(self, exclusive: bool = False) -> None:
        """Rewrites the driver file (whole, then renamed into place); `exclusive`: creates it, and
        raises FileExistsError where it exists (two drivers starting at once: one gets it)."""
        state = {"pid": os.getpid(), "host": socket.gethostname(), "started": _process_start(os.getpid()),
                 "heartbeat": time.time()}
        write_whole(self.path, lambda f: f.write(json.dumps(state).encode()), exclusive=exclusive)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._write()
            except OSError:  # the storage is away for a moment: the next beat tries again
                pass

    def __enter__(self):
        os.makedirs(self.experiment, exist_ok=True)
        try:
            self._write(exclusive=True)
        except FileExistsError:  # a live driver's (refused), or a dead one's (taken over)
            with _one_at_a_time(self.experiment):  # two taking over a dead one's at once: one gets it
                check_no_live_driver(self.experiment)
                self._write()
        self._thread = threading.Thread(target=self._beat, name="experiment-driver-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        try:
            os.remove(self.path)
        except OSError:
            pass
        return False
