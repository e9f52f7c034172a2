"""Every algorithm on tasks where they should differ, several seeds each, one report.

    python -m benchmarks.suite [--quick] [--tasks T ...] [--algorithms A ...] [--seeds N]
                               [--out DIR] [--tune] [--tuned FILE] [--report-only]

Tasks (all offline, built-in tiny models, CPU-sized):
  increasing  the increasing-numbers task, per-token reward: dense progress, easy exploration (control)
  lock        combination_lock: reward only for writing a 3-number pattern (random exploration
              sees it in about 1 episode of 7,000); a scripted guide knows the pattern
  lock_short  the same lock in 6 tokens instead of 20 (random: 1 episode of 31,000), so that a
              guide roll-in, 1..5 tokens, often stops inside the pattern and leaves the policy
              the rest to write
  sentiment   the offline review task: a warm-started tiny GPT-2, VADER reward, KL to the warm start
  sort        sort_numbers with a warm-started tiny T5 (seq2seq), sentence BLEU against the sorted list

Each (task, algorithm) runs its seeds as one Ray Tune experiment (so a cluster runs it
unchanged) from the same YAML a user would train with (`tune_configs/...`, named per pair in
`TASKS` below), with the stop criterion replaced by a fixed budget of env steps. Per run it records
the reward at the budget (the mean sampled reward over the last 10% of the budget; for guided
algorithms the episodes the policy wrote alone, with no guide token; AggreVaTeD is not in the
suite because every one of its episodes has guide tokens) and the env steps at
which the reward first reached the task's threshold. On the sentiment task it also keeps each
run's final checkpoint and measures the policy's language quality on the test split: the
references' perplexity under the policy, its own continuations' perplexity under the warm
start, and their distinct-2 (`language_quality`). It writes, under --out:

  summary.csv            one row per run (task, algorithm, seed, lr, reward at budget, steps to threshold, ...)
  quality_reference.json the warm start's own language-quality figures
  report.md              per task: mean and 95% interval over seeds; the claim comparisons
  curves_<task>.png      mean reward against env steps per algorithm, shaded 95% band
  configs/               the exact config of every experiment (train any of them with `tokenmdp train`)
  runs/                  the Tune experiments (result.json per run)

Learning rates: `--tune` runs each pair with the YAML's lr x {1/3, 1, 3} on a separate seed
(1000), one Tune experiment per pair (under tuning/, every run's row in tuning.csv), and writes
the best (reward at budget, to 3 decimals; a tie keeps the YAML's lr) to --tuned (default
benchmarks/suite_tuned.json); reported runs read that file (pairs missing from it keep the
YAML's lr). The tuning runs are never among the reported ones. Nothing here passes or fails:
it measures.
"""
from __future__ import annotations

import argparse
import copy
import csv
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

TUNING_SEED = 1000
TUNE_FACTORS = (1 / 3, 1.0, 3.0)
FINAL_FRACTION = 0.1  # "reward at the budget": mean over the results in the last 10% of the budget


@dataclass
class Pair:
    """One algorithm on one task: the YAML it starts from and what the suite changes in it."""
    config: str
    overrides: list = field(default_factory=list)


@dataclass
class Task:
    about: str
    threshold: float
    budget: int         # env steps per run (full)
    quick_budget: int   # env steps per run (--quick)
    pairs: dict         # algorithm -> Pair
    common: list = field(default_factory=list)  # overrides for every algorithm of the task
    prepare: str | None = None  # name of a function below that builds data / a warm start
    quality: bool = False  # measure the final policy's language quality (perplexities, distinct-2)

    def overrides(self, algorithm: str, prepared: dict) -> list:
        out = []
        for o in (*self.common, *self.pairs[algorithm].overrides):
            for key, value in prepared.items():  # <name> placeholders: data, warm_start, algorithm, switch
                o = o.replace(f"<{key}>", str(value))
            out.append(o)
        return out


NLPO = "sampler={name: top_p, p: 0.9, masking: learned, sync_every: 10}"
# The quickstart as the suite measured it (2026-11-24): 16 rows, 2,048-step batches like the other
# synthetic configs, lambda 0.95 (the shipped quickstart since steps 64 rows, 5,120 and 1.0).
QUICKSTART_AS_MEASURED = ["env_runners.num_envs_per_env_runner=16", "training.train_batch_size=2048",
                          "training.minibatch_size=512", "training.lambda=0.95"]
SYNTHETIC = {  # the synthetic tasks' algorithms: their own tuned YAMLs
    "ppo": Pair("tune_configs/quickstart.yaml", QUICKSTART_AS_MEASURED),
    "nlpo": Pair("tune_configs/quickstart.yaml", [*QUICKSTART_AS_MEASURED, NLPO]),
    "a2c": Pair("tune_configs/a3c_synthetic.yaml",  # A3C's config in one process: synchronous A2C
                ["env_runners.num_env_runners=0", "-env_runners.num_cpus_per_env_runner",
                 "env_runners.num_envs_per_env_runner=64", "-training.lr_end", "-training.lr_decay_steps",
                 "training.train_batch_size=2048"]),
    "reinforce": Pair("tune_configs/reinforce_synthetic.yaml"),
    "self_critical": Pair("tune_configs/self_critical_synthetic.yaml"),
    "ppo_pp": Pair("tune_configs/ppo_pp_synthetic.yaml"),
    "lols": Pair("tune_configs/lols_synthetic.yaml"),
    "dlols": Pair("tune_configs/dlols_synthetic.yaml", ["-guide.switch_fraction", "guide.switch_iteration=<switch>"]),
    "dqn_logits": Pair("tune_configs/dqn_synthetic.yaml", ["dqn.head=logits", "-evaluation"]),
    "dqn_mlp": Pair("tune_configs/dqn_synthetic.yaml", ["dqn.head=mlp", "-evaluation"]),
}
SENTIMENT_PATHS = ["model.name_or_path=<warm_start>", "task.dataset.train=<data>/train.jsonl",
                   "task.dataset.validation=<data>/validation.jsonl", "task.dataset.test=<data>/test.jsonl"]
LOCK_GUIDE = "guide.callable=agents.guides:combination_lock"
# A2C on a PPO config: one gradient step per batch, no minibatches or clipping.
A2C_SETS = ["algorithm=a3c", "-training.minibatch_size", "-training.num_epochs"]

TASKS = {
    "increasing": Task(
        "increasing_numbers (50 numbers, 20 tokens), per-token reward; random policy about 0.37",
        threshold=0.7, budget=60_000, quick_budget=4_096, pairs=SYNTHETIC,
        common=["env.dense_reward=true"]),
    "lock": Task(
        "combination_lock (pattern of 3 of 50 numbers in 20 tokens); random policy about 1.4e-4",
        threshold=0.5, budget=60_000, quick_budget=4_096,
        pairs={"ppo": SYNTHETIC["ppo"],
               **{k: Pair(SYNTHETIC[k].config, [*SYNTHETIC[k].overrides, LOCK_GUIDE])
                  for k in ("ppo_pp", "dlols")}},
        common=["task.name=combination_lock", "env.dense_reward=true"]),
    "lock_short": Task(
        "combination_lock in 6 tokens: random policy about 3.2e-5; a guide roll-in (1..5 tokens) stops "
        "inside the pattern 2 times in 5",
        threshold=0.5, budget=60_000, quick_budget=4_096, pairs={},  # the lock's pairs, filled in below
        common=["task.name=combination_lock", "env.dense_reward=true", "env.max_new_tokens=6"]),
    "sentiment": Task(
        "offline reviews, warm-started tiny GPT-2, VADER reward, KL 0.02 to the warm start",
        threshold=0.8, budget=24_576, quick_budget=2_048, prepare="prepare_sentiment",
        pairs={
            "ppo": Pair("tune_configs/sentiment_offline.yaml"),
            "nlpo": Pair("tune_configs/sentiment_offline.yaml", [NLPO]),
            "ppo_mle": Pair("tune_configs/sentiment_offline.yaml", ["training.mle_coef=0.1"]),
            "reinforce": Pair("tune_configs/reinforce_sentiment_offline.yaml"),
            "self_critical": Pair("tune_configs/self_critical_sentiment_offline.yaml"),
            "dlols": Pair("tune_configs/dlols_sentiment_offline.yaml",
                          ["guide.name_or_path=<warm_start>", "-guide.switch_fraction",
                           "guide.switch_iteration=<switch>"]),
        },
        common=SENTIMENT_PATHS, quality=True),
    "sort": Task(
        "sort_numbers (5 of 20 numbers), warm-started tiny T5, sentence BLEU",
        threshold=0.6, budget=20_480, quick_budget=1_024, prepare="prepare_sort",
        pairs={
            "ppo": Pair("tune_configs/seq2seq_sort_numbers.yaml"),
            "a2c": Pair("tune_configs/seq2seq_sort_numbers.yaml", A2C_SETS),
        },
        common=["model.name_or_path=<warm_start>"]),
}
TASKS["lock_short"].pairs = TASKS["lock"].pairs
QUICK_ALGORITHMS = {"increasing": ["ppo", "reinforce"], "lock": ["ppo", "ppo_pp"], "lock_short": ["ppo_pp"],
                    "sentiment": ["ppo"], "sort": ["ppo"]}

# The source papers' directional claims, as comparisons of (task, algorithm) pairs.
CLAIMS = [
    ("Guided RL >= PPO when exploration is hard (RLGF)", "lock", "reward", [("ppo_pp", "ppo"), ("dlols", "ppo")]),
    ("Guided RL >= PPO when exploration is hard (RLGF)", "lock_short", "reward",
     [("ppo_pp", "ppo"), ("dlols", "ppo")]),
    ("Guided RL on the control task (exploration easy)", "increasing", "reward", [("ppo_pp", "ppo"), ("dlols", "ppo")]),
    ("Learned masking (NLPO) lowers the variance across seeds (CS224N report)", "*", "std", [("nlpo", "ppo")]),
    ("Logits-initialised DQN head >= MLP head (CS224N report)", "increasing", "reward", [("dqn_logits", "dqn_mlp")]),
    ("Self-critical >= REINFORCE with a mean baseline (SCST)", "*", "reward", [("self_critical", "reinforce")]),
    ("Mixed MLE+RL raises the reward like RL", "sentiment", "reward", [("ppo_mle", "ppo")]),
    ("Mixed MLE+RL keeps the references' perplexity (lower is better)", "sentiment", "ref_perplexity",
     [("ppo_mle", "ppo")]),
    ("Mixed MLE+RL keeps its generations fluent (perplexity under the warm start)", "sentiment",
     "gen_perplexity", [("ppo_mle", "ppo")]),
    ("RL beats its warm start", "sentiment", "start", [("ppo", "ppo")]),
    ("RL beats its warm start", "sort", "start", [("ppo", "ppo"), ("a2c", "a2c")]),
]


# -- preparation --------------------------------------------------------------------------

def _call(args: list[str]) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"error: {' '.join(args)} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")


def prepare_sentiment(folder: str, quick: bool) -> dict:
    data, warm = os.path.join(folder, "data"), os.path.join(folder, "warm_start")
    if not os.path.isfile(os.path.join(warm, "config.json")):
        _call([sys.executable, "-m", "env.tasks.review_corpus", data, "--seed", "0"])
        _call([sys.executable, "-m", "agents.pretrain", "tune_configs/pretrain_reviews.yaml",
               "--set", f"output_dir={warm}", "--set", f"data.dataset.train={data}/train.jsonl",
               "--set", f"data.dataset.validation={data}/validation.jsonl"])
    return {"data": data, "warm_start": warm}


def prepare_sort(folder: str, quick: bool) -> dict:
    data, warm = os.path.join(folder, "data"), os.path.join(folder, "warm_start")
    if not os.path.isfile(os.path.join(warm, "config.json")):
        _call([sys.executable, "-m", "env.tasks.sort_numbers", data])
        _call([sys.executable, "-m", "agents.pretrain", "tune_configs/pretrain_seq2seq_sort_numbers.yaml",
               "--set", f"output_dir={warm}", "--set", f"data.dataset.train={data}/train.jsonl",
               "--set", f"data.dataset.validation={data}/validation.jsonl",
               "--set", f"model.tokenizer={data}/tokenizer"])
    return {"data": data, "warm_start": warm}


# -- language quality of a final policy (tasks with `quality`) ------------------------------

QUALITY_COLUMNS = ["ref_perplexity", "gen_perplexity", "distinct_2"]


def language_quality(path: str, warm_start: str, env_config: dict | None = None,
                     max_examples: int = 200) -> tuple[dict, list[str], list[str], list[str]]:
    """The language quality of a policy (a checkpoint, or the warm start itself with the
    checkpoints' `env_config`) on the task's test split, first `max_examples` prompts:
    `ref_perplexity`: the reference continuations' perplexity under the policy (does it still
    model the language?); `gen_perplexity`: one sampled continuation per prompt, its perplexity
    under the warm start (is what it writes still fluent?); `distinct_2` of those continuations.
    Returns (figures, prompts as the env cut them, references, generations)."""
    import torch

    from agents.evaluate import Model, distinct_n, perplexity, rollout
    from env.tasks import make_task
    from env.text_env import TokenGenerationEnv

    model, warm = Model(path), Model(warm_start)
    env_config = model.env_config or env_config
    task = make_task(env_config["task"], max_new_tokens=env_config["max_new_tokens"])
    examples = task.examples("test")[:max_examples]
    cfg = {**env_config, "split": "test", "tokenizer": model.tokenizer_spec, "encoder_decoder": model.seq2seq}
    with torch.no_grad():
        gens = rollout(model.policy, cfg, examples, greedy=False, seed=0)
        env = TokenGenerationEnv(cfg)
        prompts = [env.reset(options={"prompt": ex["prompt"]})[1]["prompt"] for ex in examples]
        refs = [task.targets(ex)[0] for ex in examples]
        figures = {"ref_perplexity": perplexity(model.lm, model.tokenizer, prompts, refs),
                   "gen_perplexity": perplexity(warm.lm, warm.tokenizer, prompts, gens),
                   "distinct_2": distinct_n(gens, 2)}
    return figures, prompts, refs, gens


def checkpoint_env_config(checkpoint: str) -> dict:
    from agents.evaluate import Model

    return Model(checkpoint).env_config


def final_checkpoint(trial_dir: str) -> str | None:
    found = sorted(glob.glob(os.path.join(trial_dir, "checkpoint_*")))
    return found[-1] if found else None


# -- configs ------------------------------------------------------------------------------

def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """`a.b=value` sets (YAML value), `-a.b` removes a key."""
    from agents.config import parse_override

    raw = copy.deepcopy(raw)
    for text in overrides:
        if text.startswith("-"):
            keys = text[1:].split(".")
            node = raw
            for k in keys[:-1]:
                node = node.get(k) or {}
            node.pop(keys[-1], None) if isinstance(node, dict) else None
            continue
        keys, value = parse_override(text)
        node = raw
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return raw


def experiment_config(task: str, algorithm: str, *, budget: int, seeds: list[int], lr: float | None,
                      prepared: dict, runs: str, name: str, concurrent: int, checkpoint: bool = False) -> dict:
    """The raw (unvalidated) YAML dict of one experiment: the pair's YAML, the task's and the
    pair's changes, and the suite's budget, seeds and storage (a checkpoint at the end only
    with `checkpoint`)."""
    from agents.config import read_yaml

    t = TASKS[task]
    raw = read_yaml(os.path.join(ROOT, t.pairs[algorithm].config))
    batch = int(raw.get("training", {}).get("train_batch_size") or 2048)
    fields = {**prepared, "algorithm": algorithm, "switch": max(1, budget // batch // 5)}
    raw = apply_overrides(raw, t.overrides(algorithm, fields))
    raw["seed"] = {"grid_search": list(seeds)} if len(seeds) > 1 else seeds[0]
    if lr is not None:
        raw["training"]["lr"] = float(lr)
    raw["stop"] = {"num_env_steps_sampled_lifetime": int(budget), "training_iteration": None,
                   "time_total_s": None, "episode_return_mean": None}
    raw["checkpoint"] = {"frequency": 0, "at_end": bool(checkpoint)}
    raw.setdefault("tune", {})
    raw["tune"].update({"name": name, "storage_path": runs, "dashboard": False,
                        "max_concurrent_trials": concurrent, "num_cpus_per_trial": round(1.9 / concurrent, 2)})
    raw.pop("generate", None)
    return raw


# -- results ------------------------------------------------------------------------------

def trial_curve(trial_dir: str) -> list[tuple[int, float]]:
    """(env steps, reward) per iteration; the policy-alone reward for guided runs."""
    from benchmarks.guided_comparison import trial_curve as curve

    return curve(trial_dir)


def trial_param(trial_dir: str, key: str, cast=float):
    """A value of the trial's config (Tune's params.json), or None."""
    try:
        with open(os.path.join(trial_dir, "params.json")) as f:
            return cast(json.load(f).get(key))
    except (OSError, ValueError, TypeError):
        return None


def trial_seed(trial_dir: str) -> int | None:
    return trial_param(trial_dir, "seed", int)


class StoppedShort(RuntimeError):
    """A run ended before its env-step budget (the suite was interrupted): its row would be a
    figure of a shorter run than the one reported."""


def full_runs(rows: list[dict], budget: int, pair: str) -> list[dict]:
    """The rows, or StoppedShort naming the runs that ended before `budget` env steps."""
    short = [r["env_steps"] for r in rows if r["env_steps"] < budget]
    if short:
        at = ", ".join(f"{steps:,}" for steps in short)
        raise StoppedShort(f"[{pair}] {len(short)} of {len(rows)} runs stopped before the budget of {budget:,} env "
                           f"steps (at {at}): the suite was interrupted; their rows are not written")
    return rows


def run_row(task: str, algorithm: str, trial_dir: str, budget: int, lr: float | None) -> dict:
    curve = trial_curve(trial_dir)
    # Tune stops after the iteration that crosses the budget: the curve up to that iteration.
    end = next((i for i, (s, _) in enumerate(curve) if s >= budget), len(curve) - 1)
    curve = curve[:end + 1]
    last = [r for s, r in curve if s >= (1 - FINAL_FRACTION) * budget] or [r for _, r in curve[-1:]]
    reached = next((s for s, r in curve if r >= TASKS[task].threshold), None)
    return {"task": task, "algorithm": algorithm, "seed": trial_seed(trial_dir), "lr": lr,
            "env_steps": curve[-1][0] if curve else 0, "start_reward": curve[0][1] if curve else None,
            "reward_at_budget": sum(last) / len(last) if last else None,
            "steps_to_threshold": reached, "threshold": TASKS[task].threshold, "trial_dir": trial_dir}


T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def mean_ci(xs: list[float]) -> tuple[float, float, float]:
    """Mean, sample standard deviation and the half-width of the 95% t interval."""
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, 0.0, math.nan
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    return m, s, T975.get(n - 1, 1.96) * s / math.sqrt(n)


def read_rows(path: str) -> list[dict]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k in ("reward_at_budget", "start_reward", "lr", *QUALITY_COLUMNS):
            r[k] = float(r[k]) if r.get(k) not in (None, "", "None") else None
        for k in ("env_steps", "steps_to_threshold", "seed"):
            r[k] = int(float(r[k])) if r.get(k) not in (None, "", "None") else None
    return rows


COLUMNS = ["task", "algorithm", "seed", "lr", "env_steps", "start_reward", "reward_at_budget",
           "steps_to_threshold", "threshold", *QUALITY_COLUMNS, "trial_dir"]


def write_rows(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, restval="")
        w.writeheader()
        w.writerows(rows)


def stats(rows: list[dict], task: str, algorithm: str, column: str = "reward_at_budget") -> dict | None:
    """Mean, std and 95% half-interval of `column` over the pair's runs, and the pair's other figures."""
    mine = [r for r in rows if r["task"] == task and r["algorithm"] == algorithm and r.get(column) is not None
            and not (isinstance(r[column], float) and math.isnan(r[column]))]
    if not mine:
        return None
    m, s, ci = mean_ci([r[column] for r in mine])
    reached = [r["steps_to_threshold"] for r in mine if r["steps_to_threshold"] is not None]
    start = mean_ci([r["start_reward"] for r in mine if r["start_reward"] is not None])[0]
    return {"n": len(mine), "mean": m, "std": s, "ci": ci, "start": start, "reached": len(reached),
            "steps": sum(reached) / len(reached) if reached else None,
            "lr": mine[0]["lr"], "budget": max(r["env_steps"] for r in mine)}


def _f(x, digits=3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def claim_lines(rows: list[dict]) -> list[str]:
    out = ["| claim | task | comparison | figures | difference (95% interval) |", "| --- | --- | --- | --- | --- |"]
    tasks = sorted({r["task"] for r in rows})
    for claim, where, kind, comparisons in CLAIMS:
        for task in (tasks if where == "*" else [where]):
            for a, b in comparisons:
                sa, sb = stats(rows, task, a), stats(rows, task, b)
                if not sa or not sb:
                    continue
                if kind == "start":
                    figures = f"warm start / first iteration {_f(sa['start'])} -> {_f(sa['mean'])} at the budget"
                    diff = _diff([r["reward_at_budget"] - r["start_reward"] for r in rows
                                  if r["task"] == task and r["algorithm"] == a and r["start_reward"] is not None])
                    out.append(f"| {claim} | {task} | {a}: budget vs start | {figures} | {diff} |")
                elif kind == "std":
                    out.append(f"| {claim} | {task} | {a} vs {b} | std over seeds {_f(sa['std'])} (n={sa['n']}) vs "
                               f"{_f(sb['std'])} (n={sb['n']}); means {_f(sa['mean'])} vs {_f(sb['mean'])} | "
                               f"std ratio {_f(sa['std'] / sb['std'] if sb['std'] else None, 2)} |")
                else:
                    if kind != "reward":  # another column of the rows, e.g. ref_perplexity
                        sa, sb = stats(rows, task, a, kind), stats(rows, task, b, kind)
                        if not sa or not sb:
                            continue
                    d = sa["mean"] - sb["mean"]
                    half = T975.get(min(sa["n"], sb["n"]) - 1, 1.96) * math.sqrt(
                        sa["std"] ** 2 / sa["n"] + sb["std"] ** 2 / sb["n"])
                    out.append(f"| {claim} | {task} | {a} vs {b} | {_f(sa['mean'])} ± {_f(sa['ci'])} vs "
                               f"{_f(sb['mean'])} ± {_f(sb['ci'])} | {d:+.3f} ({d - half:+.3f} .. {d + half:+.3f}) |")
    return out


def _diff(xs: list[float]) -> str:
    if not xs:
        return "-"
    m, _, ci = mean_ci(xs)
    return f"{m:+.3f} ({m - ci:+.3f} .. {m + ci:+.3f})" if not math.isnan(ci) else f"{m:+.3f}"


def report(rows: list[dict], out: str, command: str) -> str:
    lines = ["# Algorithm benchmark suite", "",
             f"Command: `{command}`", "",
             f"Written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Reward at budget: the mean "
             f"sampled reward over the last {int(FINAL_FRACTION * 100)}% of the env-step budget (guided "
             "algorithms: episodes the policy wrote alone). Intervals: 95% t interval of the mean over seeds. "
             "Steps to threshold: the mean over the seeds that reached it (how many did is shown).", ""]
    for task in [t for t in TASKS if any(r["task"] == t for r in rows)]:
        t = TASKS[task]
        lines += [f"## {task}", "", t.about + f"; threshold {t.threshold}.", "",
                  "| algorithm | seeds | lr | first iteration | reward at budget | std | env steps to "
                  f"{t.threshold} | reached |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for algorithm in t.pairs:
            s = stats(rows, task, algorithm)
            if s:
                lines.append(f"| {algorithm} | {s['n']} | {s['lr']:.2g} | {_f(s['start'])} | {_f(s['mean'])} ± "
                             f"{_f(s['ci'])} | {_f(s['std'])} | {_f(s['steps'], 0)} | {s['reached']}/{s['n']} |")
        lines += quality_lines(rows, task, out)
        if os.path.isfile(os.path.join(out, f"curves_{task}.png")):
            lines += ["", f"![{task}](curves_{task}.png)"]
        lines.append("")
    lines += ["## Claims: the comparisons", "", *claim_lines(rows), ""]
    return "\n".join(lines)


def quality_lines(rows: list[dict], task: str, out: str) -> list[str]:
    """The language-quality table of a task whose runs have it (mean ± 95% interval over seeds)."""
    if not any(r["task"] == task and r.get("ref_perplexity") is not None for r in rows):
        return []
    path = os.path.join(out, "quality_reference.json")
    reference = (json.load(open(path)) if os.path.isfile(path) else {}).get(task)
    lines = ["", "Language quality of the final policy on the test split (200 prompts, one sampled continuation "
             "each; lower perplexity is better):", "",
             "| policy | references' perplexity under the policy | generations' perplexity under the warm start "
             "| distinct-2 |", "| --- | ---: | ---: | ---: |"]
    if reference:
        lines.append("| warm start | " + " | ".join(_f(reference[c]) for c in QUALITY_COLUMNS) + " |")
    for algorithm in TASKS[task].pairs:
        cells = [stats(rows, task, algorithm, c) for c in QUALITY_COLUMNS]
        if any(cells):
            lines.append(f"| {algorithm} | " + " | ".join(f"{_f(c['mean'])} ± {_f(c['ci'])}" if c else "-"
                                                        for c in cells) + " |")
    return lines


def plot(rows: list[dict], out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    written = []
    for task in [t for t in TASKS if any(r["task"] == t for r in rows)]:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for algorithm in TASKS[task].pairs:
            curves = [trial_curve(r["trial_dir"]) for r in rows if r["task"] == task and r["algorithm"] == algorithm
                      and os.path.isdir(r["trial_dir"])]
            curves = [c for c in curves if c]
            if not curves:
                continue
            end = min(c[-1][0] for c in curves)
            grid = np.linspace(max(c[0][0] for c in curves), end, 60)
            ys = np.array([np.interp(grid, [s for s, _ in c], [r for _, r in c]) for c in curves])
            m = ys.mean(0)
            ax.plot(grid, m, label=f"{algorithm} (n={len(curves)})")
            if len(curves) > 1:
                half = T975.get(len(curves) - 1, 1.96) * ys.std(0, ddof=1) / math.sqrt(len(curves))
                ax.fill_between(grid, m - half, m + half, alpha=0.15)
        ax.axhline(TASKS[task].threshold, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("env steps")
        ax.set_ylabel("mean sampled reward")
        ax.set_title(task)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out, f"curves_{task}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


# -- running ------------------------------------------------------------------------------

def run_experiment(raw: dict, configs: str) -> list[str]:
    """Validates and trains one experiment through Tune; returns its trial directories."""
    import yaml

    from agents.config import validate
    from agents.train import preflight, run

    name = raw["tune"]["name"]
    os.makedirs(configs, exist_ok=True)
    with open(os.path.join(configs, name + ".yaml"), "w") as f:
        yaml.safe_dump(raw, f, sort_keys=False)
    cfg = validate(raw)
    preflight(cfg)
    experiment = os.path.join(raw["tune"]["storage_path"], name)
    if os.path.isdir(experiment):
        shutil.rmtree(experiment)  # a rerun replaces the old runs instead of mixing with them
    run(cfg, quiet=True)
    return sorted(d for d in glob.glob(os.path.join(experiment, "*")) if os.path.isfile(os.path.join(d, "result.json")))


def measure_quality(task: str, rows: list[dict], warm_start: str, out: str) -> None:
    """Adds the language-quality columns to each run's row (from its final checkpoint) and, once,
    the warm start's own figures to quality_reference.json."""
    path = os.path.join(out, "quality_reference.json")
    reference = json.load(open(path)) if os.path.isfile(path) else {}
    for row in rows:
        checkpoint = final_checkpoint(row["trial_dir"])
        if checkpoint is None:
            print(f"[{task}/{row['algorithm']}] no final checkpoint in {row['trial_dir']}: quality not measured")
            continue
        row.update(language_quality(checkpoint, warm_start)[0])
        if task not in reference:
            reference[task] = language_quality(warm_start, warm_start, checkpoint_env_config(checkpoint))[0]
            with open(path, "w") as f:
                json.dump(reference, f, indent=1)


def tune_pair(task: str, algorithm: str, budget: int, prepared: dict, out: str, concurrent: int) -> float:
    """Runs the pair with the YAML's lr x TUNE_FACTORS on TUNING_SEED (one Tune experiment, a grid
    over lr), appends the results to tuning.csv and returns the lr with the best reward at budget
    (ties: the YAML's own lr first, then the smaller)."""
    from agents.config import read_yaml

    base = float(read_yaml(os.path.join(ROOT, TASKS[task].pairs[algorithm].config))["training"]["lr"])
    lrs = [base * f for f in TUNE_FACTORS]
    raw = experiment_config(task, algorithm, budget=budget, seeds=[TUNING_SEED], lr=None, prepared=prepared,
                            runs=os.path.join(out, "tuning"), name=f"{task}-{algorithm}", concurrent=concurrent)
    raw["training"]["lr"] = {"grid_search": lrs}
    trials = run_experiment(raw, os.path.join(out, "configs", "tuning"))
    rows = full_runs([run_row(task, algorithm, d, budget, trial_param(d, "lr")) for d in trials], budget,
                     f"{task}/{algorithm}")
    path = os.path.join(out, "tuning.csv")
    old = [r for r in read_rows(path) if not (r["task"] == task and r["algorithm"] == algorithm)] \
        if os.path.isfile(path) else []
    write_rows(path, old + rows)
    scored = {lr: next((r["reward_at_budget"] for r in rows if r["lr"] is not None and math.isclose(r["lr"], lr)), None)
              for lr in lrs}
    for lr, r in scored.items():
        print(f"[{task}/{algorithm}] tuning lr {lr:.2g}: reward at budget {_f(r)}", flush=True)
    best = max(scored, key=lambda lr: (-math.inf if scored[lr] is None else round(scored[lr], 3),
                                       lr == base, -lr))
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small budgets, 2 seeds, a few algorithms (minutes)")
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), help="default: all")
    parser.add_argument("--algorithms", nargs="+", help="default: every algorithm of each task")
    parser.add_argument("--seeds", type=int, help="seeds per pair (default 5; --quick 2)")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiply every task's env-step budget")
    parser.add_argument("--out", default="results/suite")
    parser.add_argument("--tune", action="store_true", help="tune the learning rates (separate seed) and write --tuned")
    parser.add_argument("--tuned", default=os.path.join(ROOT, "benchmarks", "suite_tuned.json"))
    parser.add_argument("--concurrent", type=int, default=2, help="runs at once (default 2)")
    parser.add_argument("--report-only", action="store_true", help="rewrite report and plots from summary.csv")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    command = "python -m benchmarks.suite " + " ".join(argv if argv is not None else sys.argv[1:])
    summary = os.path.join(out, "summary.csv")
    rows = read_rows(summary) if os.path.isfile(summary) else []
    if args.report_only:
        return finish(rows, out, command)

    tasks = args.tasks or list(TASKS)
    known = {a for t in tasks for a in TASKS[t].pairs}
    bad = [a for a in args.algorithms or [] if a not in known]
    if bad:
        print(f"error: --algorithms: {', '.join(bad)} not in the suite's tasks {tasks} "
              f"(known: {', '.join(sorted(known))})", file=sys.stderr)
        return 2
    seeds = list(range(args.seeds or (2 if args.quick else 5)))
    tuned = {}
    if os.path.isfile(args.tuned):
        with open(args.tuned) as f:
            tuned = json.load(f)

    import ray

    ray.init(logging_level="ERROR", include_dashboard=False, log_to_driver=False)
    start = time.time()
    try:
        for task in tasks:
            t = TASKS[task]
            algorithms = [a for a in (args.algorithms or (QUICK_ALGORITHMS[task] if args.quick else t.pairs))
                          if a in t.pairs]
            if not algorithms:
                continue
            prepared = {}
            if t.prepare:
                print(f"[{task}] preparing data and warm start", flush=True)
                prepared = globals()[t.prepare](os.path.join(out, "prep", task), args.quick)
            budget = int((t.quick_budget if args.quick else t.budget) * args.budget_scale)
            for algorithm in algorithms:
                if args.tune:
                    tuned[f"{task}/{algorithm}"] = tune_pair(task, algorithm, budget, prepared, out, args.concurrent)
                    with open(args.tuned, "w") as f:
                        json.dump(tuned, f, indent=1, sort_keys=True)
                    continue
                lr = tuned.get(f"{task}/{algorithm}")
                raw = experiment_config(task, algorithm, budget=budget, seeds=seeds, lr=lr, prepared=prepared,
                                        runs=os.path.join(out, "runs"), name=f"{task}-{algorithm}",
                                        concurrent=args.concurrent, checkpoint=t.quality)
                lr = raw["training"]["lr"]
                t0 = time.time()
                trials = run_experiment(raw, os.path.join(out, "configs"))
                new = full_runs([run_row(task, algorithm, d, budget, lr) for d in trials], budget,
                                f"{task}/{algorithm}")
                if t.quality:
                    measure_quality(task, new, prepared["warm_start"], out)
                rows = [r for r in rows if not (r["task"] == task and r["algorithm"] == algorithm)] + new
                write_rows(summary, rows)
                s = stats(rows, task, algorithm)
                print(f"[{task}/{algorithm}] {len(new)} runs of {budget:,} env steps in {time.time() - t0:.0f} s: "
                      f"reward at budget {_f(s['mean']) if s else '-'} ± {_f(s['ci']) if s else '-'}", flush=True)
    except StoppedShort as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    print(f"suite: {time.time() - start:.0f} s", flush=True)
    if args.tune:
        print(f"tuned learning rates: {args.tuned}")
        return 0
    return finish(rows, out, command)


def finish(rows: list[dict], out: str, command: str) -> int:
    if not rows:
        print("error: no runs in summary.csv", file=sys.stderr)
        return 1
    plot(rows, out)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(report(rows, out, command))
    print(f"report: {os.path.join(out, 'report.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
