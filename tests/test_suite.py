"""benchmarks/suite.py: every (task, algorithm) experiment it would run is a valid config, the
report's statistics are right, and `--quick` produces the report with the expected rows."""
import csv
import math
import os

import pytest

from benchmarks import suite
from tests.conftest import run_module
from tests.test_evaluate import setup  # noqa: F401 (fixture: two tiny GPT-2 directories and review data)

PREPARED = {"data": "/nonexistent/data", "warm_start": "/nonexistent/warm_start"}


@pytest.mark.parametrize("task,algorithm", [(t, a) for t, spec in suite.TASKS.items() for a in spec.pairs])
def test_every_pair_is_a_valid_experiment_with_the_suite_budget(task, algorithm, tmp_path):
    from agents.config import validate

    raw = suite.experiment_config(task, algorithm, budget=12_345, seeds=[0, 1, 2], lr=7e-4, prepared=PREPARED,
                                  runs=str(tmp_path), name=f"{task}-{algorithm}", concurrent=2)
    cfg = validate(raw)
    assert cfg["stop"]["num_env_steps_sampled_lifetime"] == 12_345
    assert cfg["stop"]["training_iteration"] is None and cfg["stop"]["episode_return_mean"] is None
    assert cfg["training"]["lr"] == 7e-4
    assert raw["seed"] == {"grid_search": [0, 1, 2]}
    expected = {"nlpo": "ppo", "ppo_mle": "ppo", "dqn_logits": "dqn", "dqn_mlp": "dqn", "a2c": "a3c"}
    assert cfg["algorithm"] == expected.get(algorithm, algorithm)
    if algorithm == "nlpo":
        assert cfg["sampler"]["masking"] == "learned"
    if algorithm.startswith("dqn"):
        assert cfg["dqn"]["head"] == algorithm.split("_")[1]
    if task.startswith("lock"):
        assert cfg["task"]["name"] == "combination_lock"
        assert cfg["env"]["max_new_tokens"] == (6 if task == "lock_short" else 20)
        if cfg["algorithm"] in ("ppo_pp", "aggrevated", "lols", "dlols"):
            assert cfg["guide"]["callable"] == "agents.guides:combination_lock"
    if suite.TASKS[task].prepare:
        assert cfg["model"]["name_or_path"] == PREPARED["warm_start"]


def test_reward_at_budget_and_steps_to_threshold_read_from_the_curve(tmp_path, monkeypatch):
    curve = [(2000, 0.40), (4000, 0.55), (6000, 0.72), (8000, 0.70), (10000, 0.90), (12000, 0.99)]
    monkeypatch.setattr(suite, "trial_curve", lambda d: curve)
    monkeypatch.setattr(suite, "trial_seed", lambda d: 3)
    row = suite.run_row("increasing", "ppo", "x", budget=9_000, lr=1e-3)
    # The run stops at the iteration that crosses 9,000 (10,000); the last 10% of the budget holds only it.
    assert row["reward_at_budget"] == pytest.approx(0.90)
    assert row["steps_to_threshold"] == 6000 and row["start_reward"] == 0.40 and row["seed"] == 3


def test_mean_and_interval_match_the_t_distribution():
    from scipy import stats

    xs = [0.61, 0.72, 0.66, 0.70, 0.58]
    m, s, half = suite.mean_ci(xs)
    assert m == pytest.approx(sum(xs) / 5)
    assert s == pytest.approx(stats.tstd(xs))
    assert half == pytest.approx(stats.t.ppf(0.975, 4) * stats.sem(xs), rel=1e-3)
    assert math.isnan(suite.mean_ci([0.5])[2])


@pytest.mark.slow
def test_quick_suite_writes_summary_report_and_plots(tmp_path):
    out = tmp_path / "suite"
    r = run_module("benchmarks.suite", "--quick", "--tasks", "increasing", "lock", "--seeds", "2",
                   "--out", str(out), timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(out / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    pairs = sorted({(r["task"], r["algorithm"]) for r in rows})
    assert pairs == [("increasing", "ppo"), ("increasing", "reinforce"), ("lock", "ppo"), ("lock", "ppo_pp")]
    for task, algorithm in pairs:
        mine = [r for r in rows if (r["task"], r["algorithm"]) == (task, algorithm)]
        assert sorted(int(r["seed"]) for r in mine) == [0, 1]
        for r in mine:
            assert int(r["env_steps"]) >= suite.TASKS[task].quick_budget
            assert 0.0 <= float(r["reward_at_budget"]) <= 1.0
    report = (out / "report.md").read_text()
    for task, algorithm in pairs:
        assert f"\n| {algorithm} | 2 |" in report.split(f"## {task}")[1].split("## ")[0]
    assert "Guided RL >= PPO when exploration is hard" in report  # lock: ppo_pp vs ppo
    assert os.path.getsize(out / "curves_increasing.png") > 5000 and os.path.getsize(out / "curves_lock.png") > 5000
    assert (out / "configs" / "lock-ppo_pp.yaml").is_file()


def fake_tuning(tmp_path, monkeypatch, reward_of_lr) -> list:
    """suite.main without Ray: each experiment 'runs' one trial per lr of its grid, and a run's
    reward at budget is reward_of_lr(lr). Returns the list of (lr, seeds) of every experiment."""
    import ray

    seen = []

    def fake_run(raw, configs):  # one trial per lr of the grid, as Tune writes them
        lr, seeds = raw["training"]["lr"], raw["seed"]
        seen.append((lr, seeds))
        dirs = []
        for i, value in enumerate(lr["grid_search"] if isinstance(lr, dict) else [lr]):
            d = tmp_path / "trials" / f"{raw['tune']['name']}-{i}"
            d.mkdir(parents=True, exist_ok=True)
            (d / "params.json").write_text(__import__("json").dumps({"lr": value, "seed": seeds}))
            dirs.append(str(d))
        return dirs

    monkeypatch.setattr(suite, "run_experiment", fake_run)
    monkeypatch.setattr(suite, "run_row", lambda task, algo, d, budget, lr: {
        "task": task, "algorithm": algo, "seed": 0, "lr": lr, "env_steps": budget, "start_reward": 0.3,
        "reward_at_budget": reward_of_lr(lr), "steps_to_threshold": None, "threshold": 0.7, "trial_dir": d})
    monkeypatch.setattr(suite, "plot", lambda rows, out: [])
    monkeypatch.setattr(ray, "init", lambda **kw: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    return seen


def test_tune_keeps_the_best_lr_on_its_own_seed_and_reported_runs_use_it(tmp_path, monkeypatch):
    """--tune runs lr x {1/3, 1, 3} on the tuning seed and writes the best; a later run reads it."""
    seen = fake_tuning(tmp_path, monkeypatch, lambda lr: 0.6 if abs(lr - 3e-3) < 1e-9 else 0.5)  # 3 x YAML's lr wins
    tuned = tmp_path / "tuned.json"
    args = ["--quick", "--tasks", "increasing", "--algorithms", "ppo", "--out", str(tmp_path), "--tuned", str(tuned)]
    assert suite.main([*args, "--tune"]) == 0
    assert [s for _, s in seen] == [suite.TUNING_SEED]  # never a reported seed
    assert sorted(seen[0][0]["grid_search"]) == pytest.approx([1e-3 / 3, 1e-3, 3e-3])
    tuning = suite.read_rows(str(tmp_path / "tuning.csv"))  # every tuning run is kept, apart from the reported ones
    assert sorted(r["lr"] for r in tuning) == pytest.approx([1e-3 / 3, 1e-3, 3e-3])
    assert __import__("json").loads(tuned.read_text()) == {"increasing/ppo": pytest.approx(3e-3)}
    seen.clear()
    assert suite.main(args) == 0
    assert seen == [(pytest.approx(3e-3), {"grid_search": [0, 1]})]


def test_tune_tie_keeps_the_yaml_lr(tmp_path, monkeypatch):
    """Rewards equal to 3 decimals (e.g. a lock no lr opens) leave the YAML's lr in place."""
    fake_tuning(tmp_path, monkeypatch, lambda lr: 0.0 if lr > 5e-4 else 0.0004)
    tuned = tmp_path / "tuned.json"
    args = ["--quick", "--tasks", "lock", "--algorithms", "ppo", "--out", str(tmp_path), "--tuned", str(tuned), "--tune"]
    assert suite.main(args) == 0
    assert __import__("json").loads(tuned.read_text()) == {"lock/ppo": pytest.approx(1e-3)}


def test_language_quality_is_the_policys_perplexity_of_the_references_and_the_warm_starts_of_its_text(setup):
    """The sentiment task's quality columns, against per-sequence log-probs computed directly."""
    from agents.evaluate import distinct_n
    from tests.test_evaluate import _logprob

    warm, policy = setup["dirs"]

    def ppl(model_dir, contexts, targets):
        scored = [_logprob(model_dir, c, t) for c, t in zip(contexts, targets) if t]
        return math.exp(-sum(lp for lp, _ in scored) / sum(n for _, n in scored))

    figures, prompts, refs, gens = suite.language_quality(policy, warm, setup["env_config"], max_examples=8)
    assert len(prompts) == len(refs) == len(gens) == 8
    assert all(r and not r.startswith(p) for p, r in zip(prompts, refs))  # the rest of the review, after the prompt
    assert figures["ref_perplexity"] == pytest.approx(ppl(policy, prompts, refs), rel=1e-4)
    assert figures["gen_perplexity"] == pytest.approx(ppl(warm, prompts, gens), rel=1e-4)
    assert figures["distinct_2"] == pytest.approx(distinct_n(gens, 2))
    own = suite.language_quality(warm, warm, setup["env_config"], max_examples=8)[0]
    assert own["ref_perplexity"] == pytest.approx(ppl(warm, prompts, refs), rel=1e-4)  # the policy's, not the warm start's
    assert own["ref_perplexity"] != pytest.approx(figures["ref_perplexity"], rel=1e-3)


def test_runs_stopped_before_the_budget_are_not_written(tmp_path, monkeypatch, capsys):
    """An interrupted suite (Ctrl-C: Tune stops the trials and returns) must not record the
    shortened runs as if they had reached the budget."""
    fake_tuning(tmp_path, monkeypatch, lambda lr: 0.5)
    monkeypatch.setattr(suite, "run_row", lambda task, algo, d, budget, lr: {
        "task": task, "algorithm": algo, "seed": 0, "lr": lr, "env_steps": budget // 2, "start_reward": 0.3,
        "reward_at_budget": 0.0, "steps_to_threshold": None, "threshold": 0.7, "trial_dir": d})
    args = ["--quick", "--tasks", "increasing", "--algorithms", "ppo", "--out", str(tmp_path),
            "--tuned", str(tmp_path / "tuned.json")]
    assert suite.main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: [increasing/ppo]") and "stopped before the budget" in err
    assert not (tmp_path / "summary.csv").exists()
    assert suite.main([*args, "--tune"]) == 1
    assert not (tmp_path / "tuned.json").exists() and not (tmp_path / "tuning.csv").exists()
