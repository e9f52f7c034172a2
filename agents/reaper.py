"""Stops what is left of a local Ray instance when the process that started it dies.

A driver that starts Ray itself (`ray.init()` with no address: `agents.train` and `agents.serve`
on one machine) stops it in `ray.shutdown()`, also on Ctrl-C. Killed with SIGKILL (the OOM
killer, `kill -9`), it cannot: Ray's GCS and raylet then stop by themselves, but the node's
`ray::DashboardAgent` and `ray::RuntimeEnvAgent` stay alive for good (they notice the raylet is
gone and then wait on the dead GCS to report it), keeping their ports (the dashboard agent's
52365 among them).

`watch_this_process()` starts a small watcher process next to the driver. It notes every
process below the driver once a second; when the driver is gone, it terminates those still
running (the same processes: a process id reused since is left alone), SIGKILL after 5 s. It
ignores SIGINT and SIGTERM, so a Ctrl-C to the terminal's process group leaves it to clean up
after the driver's own shutdown, and it exits when it is done.

    python -m agents.reaper PID    (what watch_this_process runs)
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_S = 1.0
TERM_WAIT_S = 5.0


def watch_this_process() -> subprocess.Popen:
    """Starts the watcher for this process (call it right after `ray.init()` started Ray here)."""
    return subprocess.Popen([sys.executable, "-m", "agents.reaper", str(os.getpid())],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def watch(pid: int, poll_s: float = POLL_S) -> list[int]:
    """Waits for process `pid` to end, then stops the processes that were below it and are still
    running; returns their ids."""
    import psutil

    try:
        driver = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return []
    me = os.getpid()
    seen: dict[int, psutil.Process] = {}
    while True:
        try:
            for child in driver.children(recursive=True):
                if child.pid != me:
                    seen.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            pass
        if not _running(driver):
            break
        time.sleep(poll_s)
    left = [p for p in seen.values() if _running(p)]
    for p in left:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(left, timeout=TERM_WAIT_S)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return [p.pid for p in left]


def _running(process) -> bool:
    """Whether `process` still runs (not ended, not a zombie). One that ends while asked (the GCS
    and the raylet stop by themselves as the driver dies) has ended: asking must not stop the
    watcher before it has stopped the rest."""
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # ZombieProcess included
        return False


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m agents.reaper PID", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch(int(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
