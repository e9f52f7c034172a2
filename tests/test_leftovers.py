"""Nothing is left behind: after a training run ends, is interrupted with Ctrl-C, or has its driver
killed with SIGKILL, every process it started (Ray's GCS, raylet, dashboard, agents, workers) is gone.
The three runs and a server run at the same time, each its own Ray instance, with no port picked by hand."""
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from tests.conftest import QUICKSTART, ROOT


def _tree(pid: int) -> dict[tuple[int, float], str]:
    """(pid, start time) -> name of every process below `pid`."""
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for p in kids:
        try:
            out[(p.pid, p.create_time())] = " ".join(p.cmdline()) or p.name()
        except psutil.NoSuchProcess:
            pass
    return out


def _listening(procs) -> dict[int, list[int]]:
    ports = {}
    for pid, _ in procs:
        try:
            ports[pid] = sorted({c.laddr.port for c in psutil.Process(pid).net_connections(kind="inet")
                                 if c.status == psutil.CONN_LISTEN})
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return {pid: p for pid, p in ports.items() if p}


def _alive(procs: dict) -> dict:
    left = {}
    for (pid, started), name in procs.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                left[pid] = name[:100]
        except psutil.NoSuchProcess:
            pass
    return left


def _train(tmp_path, *sets):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("RAY_ADDRESS", None)
    args = [QUICKSTART, "--set", f"tune.storage_path={tmp_path}", "--set", "generate.num_samples=0",
            "--set", "checkpoint.frequency=1", "--set", "tune.name=run",
            # small iterations: what is checked is what the run leaves behind, not what it learns
            "--set", "training.train_batch_size=512", "--set", "training.minibatch_size=256",
            *sum((["--set", s] for s in sets), [])]
    # Its own session, as a run started from a terminal is; the dashboard on, as by default.
    return subprocess.Popen([sys.executable, "-m", "agents.train", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _stopped_and_gone(proc, stop: str, at_iteration: int):
    """Runs `proc` until iteration `at_iteration` is printed, notes the processes below it, stops it
    as `stop` says (end: let it finish; sigint: Ctrl-C to its process group; sigkill: the driver
    alone); returns (its output, its exit code, the processes it had, those still alive 60 s on)."""
    lines, procs = [], {}
    try:
        for line in proc.stdout:
            lines.append(line)
            if re.match(rf"iter +{at_iteration} ", line):
                procs = _tree(proc.pid)
                ports = _listening(procs)
                if stop == "sigint":
                    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal sends
                elif stop == "sigkill":
                    os.kill(proc.pid, signal.SIGKILL)  # the driver only (OOM killer, kill -9)
        code = proc.wait(timeout=300)
        deadline = time.time() + 60
        while _alive(procs) and time.time() < deadline:
            time.sleep(0.2)  # they end within seconds of the driver: noticed to the fifth of one
        return "".join(lines), code, procs, ports, _alive(procs)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def three_runs_beside_a_server(tmp_path_factory):
    """A server (agents.serve, its own Ray instance) and, beside it and at the same time, three
    training runs (three more Ray instances; no Ray port given to any): one ends normally, one gets
    Ctrl-C at iteration 2, one has its driver killed at iteration 2. Returns each run's
    observations, and whether the server answered a request after them."""
    import threading

    from agents.serve.launch import ServeProcess, untrained_checkpoint

    tmp = tmp_path_factory.mktemp("leftovers")
    checkpoint = untrained_checkpoint(QUICKSTART, str(tmp / "tiny"))
    started = {}

    def serve():  # the server starts as the runs do (all four Ray instances come up at once)
        try:
            started["server"] = ServeProcess(checkpoint, "--num-replicas", "1", "--num-cpus", "0.5",
                                             "--max-samples", "4", cwd=ROOT)
        except Exception as e:
            started["error"] = e

    starting = threading.Thread(target=serve)
    starting.start()
    try:
        runs = {"end": _train(tmp / "end", "stop.training_iteration=3"),
                "sigint": _train(tmp / "sigint", "stop.training_iteration=50"),
                "sigkill": _train(tmp / "sigkill", "stop.training_iteration=50")}
        seen = {}

        def watch(stop):
            seen[stop] = _stopped_and_gone(runs[stop], stop, at_iteration=2)

        threads = [threading.Thread(target=watch, args=(stop,)) for stop in runs]
        for t in threads:
            t.start()
        for t in [starting, *threads]:
            t.join()
        if "error" in started:
            raise started["error"]
        server = started["server"]
        request = urllib.request.Request(server.base + "/v1/completions", method="POST",
                                         data=json.dumps({"prompt": "3 7 12", "max_tokens": 5}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            answered = reply.status == 200 and bool(json.loads(reply.read())["choices"])
        yield {"runs": seen, "server_answered": answered, "server_running": server.proc.poll() is None, "tmp": tmp}
    finally:
        starting.join()
        if "server" in started:
            started["server"].stop()


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["end", "sigint", "sigkill"])
def test_a_run_that_ends_is_interrupted_or_killed_leaves_no_process_behind(three_runs_beside_a_server, stop):
    out, code, procs, ports, left = three_runs_beside_a_server["runs"][stop]
    assert procs, out[-3000:]
    names = " ".join(procs.values())
    assert "gcs_server" in names and "raylet" in names and "ray::DashboardAgent" in names, names
    assert not left, f"still running after the driver's exit: {left} (ports they listened on: {ports})"
    iterations = [int(i) for i in re.findall(r"^iter +(\d+) ", out, re.M)]
    assert iterations[:2] == [1, 2], out[-2000:]
    from agents.resume import unfinished_trials

    # Tune's saved state, as a fresh run under the same name reads it (refused after an interruption)
    assert unfinished_trials(str(three_runs_beside_a_server["tmp"] / stop / "run")) == (0 if stop == "end" else 1)
    if stop == "end":
        assert code == 0 and iterations == [1, 2, 3] and "Summary (1 trial" in out, out[-3000:]
    elif stop == "sigint":  # Tune stops the trial, and the driver exits on its own, saying so
        assert code == 130 and iterations[-1] < 50, out[-2000:]
        assert "interrupted before its stop criteria: go on with the same command and --resume (tune.name run)" in out
    else:
        assert code == -signal.SIGKILL and iterations[-1] < 50


@pytest.mark.slow
def test_a_server_beside_three_runs_keeps_answering(three_runs_beside_a_server):
    """Four Ray instances on one machine at once (a server, three runs), no Ray port given to any."""
    assert three_runs_beside_a_server["server_running"] and three_runs_beside_a_server["server_answered"]


def test_the_watcher_stops_the_rest_when_a_process_ends_as_it_is_asked(monkeypatch):
    """The GCS and the raylet stop by themselves as the driver dies, so one of the processes the
    watcher noted can vanish between its two questions (running? a zombie?): the watcher must
    still stop the others (it used to raise there and leave the node's agents running)."""
    from agents.reaper import watch

    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, time; a = subprocess.Popen(['sleep', '60']); "
         "b = subprocess.Popen(['sleep', '60']); print(a.pid, b.pid, flush=True); time.sleep(1.5)"],
        stdout=subprocess.PIPE, text=True)
    vanishing, other = map(int, parent.stdout.readline().split())
    status = psutil.Process.status

    def vanished(self):
        if self.pid == vanishing:
            raise psutil.NoSuchProcess(self.pid)
        return status(self)

    monkeypatch.setattr(psutil.Process, "status", vanished)
    try:
        stopped = watch(parent.pid, poll_s=0.1)
        assert other in stopped and vanishing not in stopped
        assert not psutil.pid_exists(other) or psutil.Process(other).status() == psutil.STATUS_ZOMBIE
    finally:
        parent.wait()
        for pid in (vanishing, other):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
