"""Offline sentiment demo: corpus -> warm start -> PPO -> evaluation, on a CPU with no network.

    python -m agents.demo [--out results/sentiment_demo] [--ppo-set KEY=VALUE ...] [--pretrain-set KEY=VALUE ...]

1. writes a templated review corpus (env/tasks/review_corpus.py) to OUT/data;
2. warm-starts a tiny GPT-2 on it (tune_configs/pretrain_reviews.yaml) into OUT/warm_start;
3. trains it with PPO to continue reviews positively, VADER as the reward and a KL penalty
   against the warm start (tune_configs/sentiment_offline.yaml), into OUT/ppo;
4. evaluates the warm start and the PPO policy on the test prompts (sentiment, perplexity
   under the warm start, distinct-n, by prompt sentiment) and plots the reward curve, into OUT/eval.

Each step runs as its own `python -m ...` command (printed before it runs), so every step
can be repeated by hand.
"""
from __future__ import annotations

import argparse
import glob
import os
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PPO_CONFIG = "tune_configs/sentiment_offline.yaml"  # relative to ROOT, where the steps run


def run(args: list[str]) -> None:
    print("$ " + " ".join(shlex.quote(a) for a in args), flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    code = subprocess.call(args, cwd=ROOT, env=env)
    if code != 0:
        raise SystemExit(code)


def ppo_overrides(out: str, ppo_set: list[str]) -> list[str]:
    """The RL step's --set values (the demo's paths under `out`, then the user's --ppo-set), checked
    against PPO_CONFIG: a ConfigError names a bad one."""
    from agents.config import load

    # Absolute paths: a Tune trial does not run in the repository root.
    data = [f"task.dataset.{s}={out}/data/{s}.jsonl" for s in ("train", "validation", "test")]
    sets = [f"model.name_or_path={out}/warm_start", *data, f"tune.storage_path={out}", "tune.name=ppo", *ppo_set]
    load(os.path.join(ROOT, PPO_CONFIG), sets)
    return sets


def main(argv=None, prog: str = "python -m agents.demo") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/sentiment_demo", help="where everything goes")
    parser.add_argument("--seed", type=int, default=0, help="corpus seed")
    parser.add_argument("--pretrain-set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--ppo-set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--num-samples", type=int, default=2, help="generations per test prompt (default 2)")
    args = parser.parse_args(argv)
    out = os.path.abspath(args.out)
    py = sys.executable
    start = time.time()
    timings = {}

    from agents.config import ConfigError

    try:  # a bad --ppo-set is refused now, not after the corpus and the warm start are written
        ppo_sets = ppo_overrides(out, args.ppo_set)
    except ConfigError as e:
        print(f"error: --ppo-set: {e}", file=sys.stderr)
        return 2

    for old in ("ppo", "eval"):  # a fresh run: earlier trials would show up in the curves and tables
        if os.path.isdir(os.path.join(out, old)):
            print(f"removing the previous {os.path.join(out, old)}")
            shutil.rmtree(os.path.join(out, old))
    from agents.pretrain import CHECKPOINT

    if os.path.isfile(os.path.join(out, "warm_start", CHECKPOINT)):  # an interrupted demo's: start it over
        os.remove(os.path.join(out, "warm_start", CHECKPOINT))

    t = time.time()
    run([py, "-m", "env.tasks.review_corpus", f"{out}/data", "--seed", str(args.seed)])
    timings["corpus"] = time.time() - t

    t = time.time()
    run([py, "-m", "agents.pretrain", "tune_configs/pretrain_reviews.yaml",
         "--set", f"output_dir={out}/warm_start",
         "--set", f"data.dataset.train={out}/data/train.jsonl",
         "--set", f"data.dataset.validation={out}/data/validation.jsonl",
         *[x for s in args.pretrain_set for x in ("--set", s)]])
    timings["pretrain"] = time.time() - t

    t = time.time()
    run([py, "-m", "agents.train", PPO_CONFIG, *[x for s in ppo_sets for x in ("--set", s)]])
    timings["ppo"] = time.time() - t
    checkpoints = sorted(glob.glob(f"{out}/ppo/*/checkpoint_*"), key=os.path.getmtime)
    if not checkpoints:
        print(f"error: PPO left no checkpoint under {out}/ppo", file=sys.stderr)
        return 1

    t = time.time()
    run([py, "-m", "agents.evaluate", f"{out}/warm_start", checkpoints[-1], "--names", "warm_start", "ppo",
         "--config", PPO_CONFIG, *[x for s in ppo_sets for x in ("--set", s)],
         "--num-samples", str(args.num_samples), "--threads", "1", "--out", f"{out}/eval",
         "--curves", f"{out}/ppo", "--metric", "episode_return_mean", "--metric", "ref_kl"])
    timings["evaluate"] = time.time() - t
    print("wall time: " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items())
          + f"; total {time.time() - start:.0f}s")
    print(f"results: {out}/eval/evaluation.md")
    return 0


if __name__ == "__main__":
    from agents import exit_with

    exit_with(main())
