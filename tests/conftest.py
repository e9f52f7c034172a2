import glob
import json
import os
import sys
import time

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import subprocess  # noqa: E402

import pytest  # noqa: E402

QUICKSTART = os.path.join(ROOT, "tune_configs", "quickstart.yaml")


def run_module(*args, timeout=120):
    """Runs `python -m <args>` from the repository root, offline, and captures its output."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="session")
def ray_local():
    """One small local Ray instance for the tests that need it."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR",
                 runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    yield ray
    ray.shutdown()


def one_line_cli_error(capsys, main, *argv) -> str:
    """Runs a CLI's main(argv) in-process; asserts exit code 2 and one error line, and returns it."""
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    return err.strip()


def write_jsonl(path, rows) -> str:
    """Writes dicts one JSON object per line; returns the path as a string."""
    import json

    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def logged_iterations(trial_dir: str) -> dict[str, list[int]]:
    """The training iterations a trial's result.json, progress.csv and TensorBoard show, in order."""
    import csv
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with open(os.path.join(trial_dir, "result.json")) as f:
        from_json = [json.loads(line)["training_iteration"] for line in f if line.strip()]
    with open(os.path.join(trial_dir, "progress.csv"), newline="") as f:
        from_csv = [int(row["training_iteration"]) for row in csv.DictReader(f)]
    events = EventAccumulator(trial_dir, size_guidance={"scalars": 0}).Reload()
    tag = "ray/tune/env_runners/episode_return_mean"
    return {"result.json": from_json, "progress.csv": from_csv,
            "tensorboard": [e.step for e in events.Scalars(tag)]}


def served_in_process(policy):
    """The served FastAPI app (agents.serve) in this process, answering with `policy` (an
    agents.serve.Policy): a context manager giving a TestClient."""
    import contextlib

    from fastapi.testclient import TestClient

    from agents.serve import app, replica_policy

    @contextlib.contextmanager
    def serving():
        app.dependency_overrides[replica_policy] = lambda: policy
        try:
            with TestClient(app) as client:
                yield client
        finally:
            app.dependency_overrides.clear()

    return serving()


def suspend_trial_actors(driver_pid: int) -> None:
    """SIGSTOP the run's Ray workers (titled ray::LMPPO, ray::LMDQN, ray::A3C, ... for the trial
    actors of every algorithm, and their EnvRunners and learners): no iteration or checkpoint follows."""
    import psutil

    for proc in psutil.Process(driver_pid).children(recursive=True):
        try:
            if proc.cmdline()[:1] and proc.cmdline()[0].startswith("ray::"):
                proc.suspend()
        except psutil.Error:
            pass


def wait_until_copied(experiment_dir, timeout_s: float = 60.0) -> None:
    """Until the storage copy of the experiment holds a parseable experiment state and no file
    under it changed size for two checks 0.5 s apart."""
    def sizes():
        return {p: os.path.getsize(p) for p in glob.glob(os.path.join(experiment_dir, "**", "*"), recursive=True)
                if os.path.isfile(p)}

    def state_parses():
        for path in glob.glob(os.path.join(experiment_dir, "experiment_state-*.json")):
            try:
                with open(path) as f:
                    json.load(f)
                return True
            except (OSError, ValueError):
                pass
        return False

    deadline, last, stable = time.monotonic() + timeout_s, None, 0
    while time.monotonic() < deadline:
        now = sizes()
        stable = stable + 1 if now == last and state_parses() else 0
        if stable >= 2:
            return
        last = now
        time.sleep(0.5)


def kill_after_iteration(proc, iteration: int, experiment_dir, line=r"iter +{} ") -> list[str]:
    """Reads a training CLI's output (`proc`, started in a session of its own) up to its line for
    `iteration` (the regular expression `line`), lets the storage copy finish, and SIGKILLs the
    driver and Ray (the process group); returns the lines read."""
    import re
    import signal

    lines = []
    try:
        for text in proc.stdout:
            lines.append(text)
            if re.match(line.format(iteration), text):
                let_the_storage_copy_finish(proc.pid, experiment_dir)
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return lines


def let_the_storage_copy_finish(driver_pid: int, experiment_dir) -> None:
    """Before a test SIGKILLs a training run: Tune copies the experiment (its state, the trial
    files) from the driver's staging directory to the storage path in a background thread after
    each checkpoint, and a SIGKILL in the middle of that copy leaves empty files there that
    nothing can resume from (`agents.train --resume` then stops in one line). Freezes the trial
    actors, so no iteration or checkpoint follows, and waits for the copy to finish."""
    suspend_trial_actors(driver_pid)
    wait_until_copied(experiment_dir)


# The command lines (generate, evaluate, export, serve) refuse bad input before heavy imports.
HEAVY = ("fastapi", "ray", "torch", "transformers")
# `python -m MODULE ARGS...` as `python -c PROBE MODULE ARGS...`, then, at exit, which of HEAVY it imported
PROBE = ("import atexit, runpy, sys; "
         f"atexit.register(lambda: print(sorted(set({HEAVY!r}) & set(sys.modules)))); "
         "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)")


def assert_refused_lightly(module: str, cases: list[tuple[list, str]]) -> None:
    """Runs `python -m module *argv` for every case's argv at once (from the repository root,
    offline), and checks that each exits 2 with its error line (the whole of stderr; after the usage
    lines for an error of argparse's, "PROG: error: ...", given as its start), having imported none
    of HEAVY."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", PROBE, module, *map(str, argv)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for argv, _ in cases]
    for (argv, expected), proc in zip(cases, procs):
        out, err = proc.communicate(timeout=120)
        err = err.strip().splitlines()
        assert proc.returncode == 2, (argv, err)
        if expected.startswith("error:"):
            assert err == [expected], (argv, err)
        else:
            assert err[-1].startswith(expected) and not any("Traceback" in line for line in err), (argv, err)
        assert out.strip().splitlines()[-1:] == ["[]"], (argv, out)  # the HEAVY modules it imported


def run_directory(tmp_path) -> tuple[str, str]:
    """A run (trial) directory holding one checkpoint with a policy file, and that checkpoint."""
    from agents.saved_policy import MODULE_SUBDIR

    checkpoint = tmp_path / "run" / "checkpoint_000001"
    (checkpoint / MODULE_SUBDIR).mkdir(parents=True)
    (checkpoint / MODULE_SUBDIR / "module_state.pt").write_bytes(b"")
    return str(tmp_path / "run"), str(checkpoint)
