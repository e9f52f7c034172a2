"""Start the policy server from Python and wait for it: `ServeProcess` runs `python -m agents.serve`
as a child process (in its own process group, with a private local Ray instance, on a free
loopback port), returns once the server prints its URL, and stops it as Ctrl-C does. The load
benchmark (benchmarks/serve_load.py) and the tests start their servers this way; a script or a
notebook can too:

    from agents.serve.launch import ServeProcess

    server = ServeProcess("PATH", "--num-replicas", "2")
    try:
        ...  # POST to server.base + "/v1/completions"
    finally:
        server.stop()

`untrained_checkpoint` saves the policy an experiment config builds, with its initial weights,
where a checkpoint of `agents.train` keeps it: a policy to serve without training one first (what
a request costs does not depend on training). `free_port` and `OutputLines` are the pieces
`ServeProcess` is built from.
"""
from __future__ import annotations

import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time


def untrained_checkpoint(config: str, path: str, overrides=()) -> str:
    """The policy the experiment config `config` builds (with `overrides`, "key=value" as `--set`
    takes them) with its initial weights, saved in `path` where a training checkpoint keeps it;
    returns `path`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from agents.config import algorithm_config, load
    from agents.saved_policy import MODULE_SUBDIR
    from env.text_env import TokenGenerationEnv

    algo_config = algorithm_config(load(config, list(overrides)))
    module = algo_config.get_rl_module_spec(env=TokenGenerationEnv(algo_config.env_config)).build()
    module.save_to_path(os.path.join(path, MODULE_SUBDIR))
    return path


_HANDED_OUT: set[int] = set()


def gives_flag(args, flag: str) -> bool:
    """Whether the command-line arguments `args` give `flag` (as `--flag V` or `--flag=V`)."""
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(count: int = 1) -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, not handed out before by this process
    (with `count` > 1: the first of `count` such ports in a row, as `--direct-port` takes). It is
    drawn from 20000 up to the system's ephemeral range, which is where nothing else picks ports at
    random: the system's own picks (a `bind` to port 0, as Ray's processes do for their
    agents and metrics as they start) come from the ephemeral range, and Ray's workers take
    10002-19999. A port from the ephemeral range could be taken by a starting Ray instance between
    this check and the server's own bind."""
    low, high = 20000, _ephemeral_range()[0] - 1
    candidates = list(range(low, high + 1)) if high > low else []
    random.SystemRandom().shuffle(candidates)  # not the seeded global generator
    for port in candidates[:200]:
        run = range(port, port + count)
        if run[-1] > high or any(p in _HANDED_OUT or not _bindable(p) for p in run):
            continue
        _HANDED_OUT.update(run)
        return port
    if count > 1:
        raise RuntimeError(f"no {count} free ports in a row found in {low}-{high}")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room below the ephemeral range
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OutputLines:
    """A process's output lines, read on a thread; `wait_for` a line matching a pattern (all lines
    read so far are in `seen`)."""

    def __init__(self, stream):
        self.queue: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream):
        for line in stream:
            self.queue.put(line)
        self.queue.put(None)

    def wait_for(self, pattern: str, timeout: float):
        """The first match of `pattern` in a line not seen yet, or None at the timeout or the end."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                line = self.queue.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                self.queue.put(None)
                return None
            self.seen.append(line)
            m = re.search(pattern, line)
            if m:
                return m
        return None


class ServeProcess:
    """`python -m agents.serve --checkpoint CHECKPOINT --host HOST --port PORT ARGS...` in its own
    process group (with the Ray processes it starts) and a private local Ray instance (RAY_ADDRESS
    is not passed on); `port` defaults to a free one. Waits up to `start_timeout` seconds for the
    line with its URL: `url` is the /generate URL, `base` the URL without a route; with
    `--direct-port` in `args`, `direct` lists the base URLs of the replicas' own ports (else it is
    empty). A server that has not started by then is stopped, and RuntimeError carries its output.
    Its stdout is read into `lines` (an `OutputLines`), its stderr written to `stderr_path`
    (default: a temporary file)."""

    def __init__(self, checkpoint: str, *args: str, host: str = "127.0.0.1", port: int | None = None,
                 start_timeout: float = 300, stderr_path: str | None = None, cwd: str | None = None):
        self.stderr_path = stderr_path
        tries = 1 if port is not None else 3  # a port of its own pick taken meanwhile: pick another
        for attempt in range(tries):
            self.port = free_port() if port is None else port
            self._start(checkpoint, args, host, cwd)
            try:
                self.base = self.wait_for(r"at (http://\S+)/generate", start_timeout).group(1)
                self.direct = (re.findall(r"http://\S+", self.wait_for(r"replicas' own ports.*", 90).group(0))
                               if gives_flag(args, "--direct-port") else [])
                break
            except RuntimeError:
                taken = "--port: cannot listen" in self.output()
                self.stop()
                if not (taken and attempt + 1 < tries):
                    raise
        self.url = self.base + "/generate"

    def _start(self, checkpoint: str, args: tuple, host: str, cwd: str | None) -> None:
        env = {**os.environ}
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.pop("RAY_ADDRESS", None)  # a private Ray instance, as on a user's machine
        self.stderr = open(self.stderr_path, "w+") if self.stderr_path else tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agents.serve", "--checkpoint", str(checkpoint), "--host", host,
             "--port", str(self.port), *args],
            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
            start_new_session=True,  # its own process group, with the Ray processes it starts
        )
        self.lines = OutputLines(self.proc.stdout)

    def output(self) -> str:
        """What the server has printed so far: the stdout lines read, then the end of its stderr."""
        try:
            self.stderr.flush()
            self.stderr.seek(0)
            err = self.stderr.read()[-3000:]
        except ValueError:  # closed: the server was stopped
            err = ""
        return f"{''.join(self.lines.seen)}\nstderr:\n{err}"

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """The first match of `pattern` in a line of its stdout not seen yet; RuntimeError with the
        server's output if none comes within `timeout` seconds (or the server exits)."""
        m = self.lines.wait_for(pattern, timeout)
        if m is None:
            raise RuntimeError(f"no {pattern!r} in the server's output within {timeout}s:\n{self.output()}")
        return m

    def stop(self, timeout: float = 60) -> int | None:
        """Ctrl-C (SIGINT to its process group: Serve and Ray shut down), then SIGKILL to whatever
        of the group is left after `timeout` seconds; the server's exit status."""
        try:
            os.killpg(self.proc.pid, signal.SIGINT)  # what Ctrl-C sends
            self.proc.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
        self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL to its process group: the server and every Ray process it started."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.stderr.close()
