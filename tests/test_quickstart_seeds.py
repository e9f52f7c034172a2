"""benchmarks/quickstart_seeds.py: the seed list it parses, and what one short run reports."""
import pytest

from agents.config import load
from benchmarks.quickstart_seeds import AT, THRESHOLDS, run, seeds_arg
from tests.conftest import QUICKSTART


def test_seed_lists_are_ranges_and_commas():
    assert seeds_arg("0-7") == list(range(8))
    assert seeds_arg("3") == [3]
    assert seeds_arg("0,3-5,9") == [0, 3, 4, 5, 9]


def test_a_short_run_reports_the_reward_when_it_reaches_each_threshold(ray_local, monkeypatch):
    import benchmarks.quickstart_seeds as qs

    cfg = load(QUICKSTART, ["training.train_batch_size=128", "training.minibatch_size=64",
                            "env_runners.num_envs_per_env_runner=8", "training.num_epochs=1"])
    monkeypatch.setattr(qs, "THRESHOLDS", (0.0, 2.0))  # reached at once, never reached
    monkeypatch.setattr(qs, "AT", (2, 9))
    r = run(cfg, iters=3, until=0)
    assert r["iterations"] == 3 and 0.0 <= r["final"] <= 1.0
    assert r["reached"][0.0][0] == 1 and 2.0 not in r["reached"]
    assert set(r["at"]) == {2}  # iteration 9 was never run
    r = run(cfg, iters=3, until=-1.0)  # any reward reaches it: the run stops after one iteration
    assert r["iterations"] == 1
    assert THRESHOLDS == (0.85, 0.9, 0.93) and AT == (40, 100, 160)
