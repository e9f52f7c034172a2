import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import subprocess  # noqa: E402

import pytest  # noqa: E402

QUICKSTART = os.path.join(ROOT, "tune_configs", "quickstart.yaml")


def run_module(*args, timeout=120):
    """Runs `python -m <args>` from the repository root, offline, and captures its output."""
    env = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="session")
def ray_local():
    """One small local Ray instance for the tests that need it."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR",
                 runtime_env={"env_vars": {"PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"}})
    yield ray
    ray.shutdown()
