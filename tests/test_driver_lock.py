"""One driver per experiment: while a run is being trained, a second `agents.train` on the same
experiment (`--resume`, or the same command again) is refused in one line and the live run goes on
unharmed (it goes on until its Ctrl-C, as an interrupted run), a resumed run as much as a new one;
a driver that died leaves nothing that blocks a resume, and a run killed before its first
checkpoint restarts with each iteration logged once."""
import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import QUICKSTART, ROOT, one_line_cli_error
from tests.test_reproducibility import TINY


def _driver_file(experiment, pid, host=None, age=0.0, started=None):
    from agents.driver_lock import DRIVER_FILE

    os.makedirs(experiment, exist_ok=True)
    with open(os.path.join(experiment, DRIVER_FILE), "w") as f:
        json.dump({"pid": pid, "host": host or socket.gethostname(), "heartbeat": time.time() - age,
                   **({"started": started} if started else {})}, f)


def test_a_live_driver_is_told_from_a_dead_one(tmp_path):
    from agents.driver_lock import STALE_S, check_no_live_driver, live_driver

    experiment = str(tmp_path / "run")
    assert live_driver(experiment) is None  # no driver file
    _driver_file(experiment, os.getpid())
    assert f"process {os.getpid()} on {socket.gethostname()}" in live_driver(experiment)
    with pytest.raises(ValueError, match=r"^the run 'run' is being trained now by process \d+ .*stop it first"):
        check_no_live_driver(experiment)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _driver_file(experiment, dead.pid)  # this machine, its process gone: killed without cleaning up
    assert live_driver(experiment) is None
    _driver_file(experiment, 1, host="another-node")  # another machine: judged by its heartbeat
    assert "process 1 on another-node" in live_driver(experiment)
    _driver_file(experiment, 1, host="another-node", age=STALE_S + 1)
    assert live_driver(experiment) is None
    with open(os.path.join(experiment, "driver.lock"), "w") as f:
        f.write('{"pid": 1')  # cut short: no driver
    assert live_driver(experiment) is None


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="process start times are read from Linux's /proc")
def test_a_stopped_driver_on_this_machine_still_holds_its_experiment(tmp_path):
    """A driver stopped with Ctrl-Z (SIGSTOP here) writes no heartbeat, yet comes back when it is
    continued: on this machine its process, the one that wrote the file (its start time), holds
    the experiment however old the file is. Once it is gone, or its number belongs to another
    process, nothing does; another machine's driver silent past STALE_S holds nothing."""
    from agents.driver_lock import STALE_S, _process_start, _process_state, live_driver

    experiment = str(tmp_path / "run")
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        started = _process_start(driver.pid)
        assert started
        os.kill(driver.pid, signal.SIGSTOP)
        _driver_file(experiment, driver.pid, age=STALE_S * 5, started=started)
        held = live_driver(experiment)
        assert held and f"process {driver.pid}" in held and f"`kill -CONT {driver.pid}`" in held, held
        # its number reused by another process: judged by the heartbeat (a live driver in another
        # process namespace under the same host name, as containers sharing a volume can be)
        _driver_file(experiment, driver.pid, age=STALE_S * 5, started=str(int(started) - 1))
        assert live_driver(experiment) is None
        _driver_file(experiment, driver.pid, age=1, started=str(int(started) - 1))
        assert f"process {driver.pid}" in live_driver(experiment)
        _driver_file(experiment, driver.pid, host="another-node", age=STALE_S * 5, started=started)
        assert live_driver(experiment) is None
    finally:
        driver.kill()
        driver.wait()
    _driver_file(experiment, driver.pid, age=0, started=started)
    assert live_driver(experiment) is None
    # killed, and not yet reaped by its parent (a zombie, which signal 0 still finds): dead
    zombie = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        started = _process_start(zombie.pid)
        zombie.kill()
        while _process_state(zombie.pid)[0] != "Z":
            time.sleep(0.01)
        _driver_file(experiment, zombie.pid, age=0, started=started)
        assert live_driver(experiment) is None
    finally:
        zombie.kill()
        zombie.wait()


# takes over the experiment argv[1] as a driver, its check for a live driver slowed down (two
# drivers judging the same dead one's file at once), says whether it holds it, and keeps it a while
TAKE_OVER = r"""
import sys, time
import agents.driver_lock as lock

check = lock.check_no_live_driver

def slow_check(experiment):
    check(experiment)
    time.sleep(1.0)

lock.check_no_live_driver = slow_check
try:
    with lock.DrivingExperiment(sys.argv[1]):
        print("held", flush=True)
        time.sleep(3.0)
except ValueError as e:
    print("refused", e, flush=True)
"""


def test_of_two_drivers_taking_over_a_dead_ones_file_at_once_one_holds_it(tmp_path):
    experiment = tmp_path / "run"
    experiment.mkdir()
    _driver_file(str(experiment), 4_000_000, host="another-node", age=600.0)  # dead: silent for 10 min
    drivers = [subprocess.Popen([sys.executable, "-c", TAKE_OVER, str(experiment)], cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    said = sorted(d.communicate(timeout=120)[0].strip() for d in drivers)
    assert said[0] == "held" and said[1].startswith("refused the run 'run' is being trained now by process "), said


def test_a_driver_stopped_while_taking_over_does_not_hang_the_next_one(tmp_path, monkeypatch):
    import fcntl

    import agents.driver_lock as lock

    experiment = tmp_path / "run"
    _driver_file(str(experiment), 4_000_000, host="another-node", age=600.0)  # dead
    monkeypatch.setattr(lock, "TAKEOVER_WAIT_S", 0.3)
    held = os.open(experiment, os.O_RDONLY)  # as a driver stopped inside its takeover
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(ValueError, match=r"^the run 'run' is being taken over by another driver now"):
            lock.DrivingExperiment(str(experiment)).__enter__()
    finally:
        os.close(held)
    with lock.DrivingExperiment(str(experiment)):  # once it lets go: taken over
        with open(experiment / lock.DRIVER_FILE) as f:
            assert json.load(f)["pid"] == os.getpid()


def test_the_driver_file_is_held_and_rewritten_while_the_run_goes_and_removed_after(tmp_path, monkeypatch):
    import agents.driver_lock as lock

    monkeypatch.setattr(lock, "HEARTBEAT_S", 0.05)
    experiment = str(tmp_path / "run")
    with lock.DrivingExperiment(experiment):
        with open(os.path.join(experiment, lock.DRIVER_FILE)) as f:
            first = json.load(f)
        assert first["pid"] == os.getpid() and first["started"] == lock._process_start(os.getpid())
        time.sleep(0.3)
        with open(os.path.join(experiment, lock.DRIVER_FILE)) as f:
            assert json.load(f)["heartbeat"] > first["heartbeat"]
        with pytest.raises(ValueError, match="is being trained now"):
            lock.DrivingExperiment(experiment).__enter__()  # a second one in the same process
    assert not os.path.exists(os.path.join(experiment, lock.DRIVER_FILE))


def _cli(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "agents.train", QUICKSTART, *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.slow
def test_a_second_driver_on_a_live_resumed_run_is_refused_and_the_run_goes_on(tmp_path, capsys):
    """The live run is a resumed one (Tune's resume copies the experiment's files into the new
    driver's staging folder, and its copies put them back: a lock file among them came back with a
    frozen heartbeat, and the live run looked dead a minute later). Its heartbeat only advances,
    and a second `--resume`, or the same command again, is refused in one line naming it.
    The run was killed before its first checkpoint (checkpoint.frequency 0): the resume restarts
    the trial from iteration 1, and TensorBoard (whose events from the killed driver lie in a file
    of their own beside the new one's), result.json and progress.csv each show every iteration
    once, up to the last one the live run printed before its Ctrl-C."""
    from tests.conftest import kill_after_iteration, logged_iterations

    common = [*[a for o in TINY for a in ("--set", o)], "--set", "stop.training_iteration=2000",
              "--set", "checkpoint.frequency=0", "--set", "checkpoint.at_end=false", "--set", "generate.num_samples=0",
              "--set", "tune.dashboard=false", "--set", f"tune.storage_path={tmp_path}", "--set", "tune.name=live",
              "--set", "checkpoint.state_every_s=0.2"]
    killed = kill_after_iteration(_cli(*common), 3, tmp_path / "live")
    assert re.match(r"iter +3 ", killed[-1]), "".join(killed)[-3000:]
    live, lines = _cli(*common, "--resume"), []
    try:
        for line in live.stdout:
            lines.append(line)
            if re.match(r"iter +\d+ ", line):
                break
        beats = []
        for _ in range(24):  # 12 s: the experiment's state is copied every 0.2 s meanwhile
            with open(tmp_path / "live" / "driver.lock") as f:
                driver = json.load(f)
            assert driver["pid"] == live.pid, driver
            beats.append(driver["heartbeat"])
            time.sleep(0.5)
        assert beats == sorted(beats) and beats[-1] - beats[0] >= 5, beats
        from agents.train import main

        for extra in (["--resume"], []):  # another --resume; the same command again (this process)
            err = one_line_cli_error(capsys, main, QUICKSTART, *common, *extra)
            assert f"is being trained now by process {live.pid} " in err, err
        os.killpg(live.pid, signal.SIGINT)  # Ctrl-C: the live run stops as an interrupted one
        lines += live.stdout.readlines()
        assert live.wait(timeout=600) == 130, "".join(lines)[-3000:]
    finally:
        if live.poll() is None:
            os.killpg(live.pid, signal.SIGKILL)
            live.wait()
    out = "".join(lines)
    iterations = [int(i) for i in re.findall(r"^iter +(\d+) ", out, re.M)]
    assert iterations == list(range(iterations[0], iterations[0] + len(iterations))), out[-3000:]
    assert iterations[0] == 1 and iterations[-1] < 2000, out[-3000:]  # no checkpoint: from the start
    assert "interrupted before its stop criteria" in out and "Traceback" not in out, out[-3000:]
    assert not os.path.exists(tmp_path / "live" / "driver.lock")
    (trial_dir,) = [d for d in glob.glob(str(tmp_path / "live" / "LMPPO_*")) if os.path.isdir(d)]
    assert len(glob.glob(os.path.join(trial_dir, "events.out.tfevents.*"))) >= 2  # the killed driver's too
    for where, its in logged_iterations(trial_dir).items():
        assert its == iterations, (where, its, iterations)
