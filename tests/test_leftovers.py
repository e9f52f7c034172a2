"""Nothing is left behind: after a training run ends, is interrupted with Ctrl-C, or has its driver
killed with SIGKILL, every process it started (Ray's GCS, raylet, dashboard, agents, workers) is gone,
and a second Ray instance (a server) runs beside it with no port picked by hand."""
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
            "--set", "checkpoint.frequency=1", "--set", "tune.name=run", *sum((["--set", s] for s in sets), [])]
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
            time.sleep(1)
        return "".join(lines), code, procs, ports, _alive(procs)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["sigint", "sigkill"])
def test_an_interrupted_or_killed_run_leaves_no_process_behind(tmp_path, stop):
    proc = _train(tmp_path, "stop.training_iteration=50")
    out, code, procs, ports, left = _stopped_and_gone(proc, stop, at_iteration=2)
    assert procs, out[-3000:]
    names = " ".join(procs.values())
    assert "gcs_server" in names and "raylet" in names and "ray::DashboardAgent" in names, names
    assert not left, f"still running after the driver's exit: {left} (ports they listened on: {ports})"
    iterations = [int(i) for i in re.findall(r"^iter +(\d+) ", out, re.M)]
    assert iterations[:2] == [1, 2] and iterations[-1] < 50, out[-2000:]
    if stop == "sigint":  # Tune stops the trial, and the driver exits on its own
        assert code in (0, 1, 130) and code != -signal.SIGKILL, out[-2000:]
    else:
        assert code == -signal.SIGKILL


@pytest.mark.slow
def test_a_run_beside_a_server_ends_cleanly_and_the_server_keeps_answering(tmp_path):
    """Two Ray instances on one machine (agents.serve and agents.train), no Ray port given to either."""
    from benchmarks.serve_load import Server, build_tiny_checkpoint

    server = Server(build_tiny_checkpoint(str(tmp_path / "tiny")), replicas=1, num_cpus=0.5, max_samples=4, extra=[])
    try:
        out, code, procs, ports, left = _stopped_and_gone(_train(tmp_path, "stop.training_iteration=3"), "end", 2)
        assert code == 0 and "Summary (1 trial" in out, out[-3000:]
        assert not left, f"still running after the run ended: {left} (ports they listened on: {ports})"
        request = urllib.request.Request(server.base + "/v1/completions", method="POST",
                                         data=json.dumps({"prompt": "3 7 12", "max_tokens": 5}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert reply.status == 200 and json.loads(reply.read())["choices"]
        assert server.proc.poll() is None
    finally:
        server.stop()
