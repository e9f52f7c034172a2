"""How much PPO learns per iteration with each EnvRunner, from one shared starting point.

    python benchmarks/runner_learning.py [--config tune_configs/quickstart.yaml] [--start 20] [--more 40]
                                         [--reps 4] [--variants stock,fast,drain] [--set key=value ...]

Trains `--start` iterations (0: none) with the stock EnvRunner (config seed), saves the learner group, then
for each repetition and variant builds the algorithm again, loads that learner state (weights,
optimizer, KL coefficient), syncs the weights to the EnvRunner, reseeds the process's
generators with 1000 + rep (the same for every variant of a repetition) and trains `--more`
iterations. Variants: `stock` and `fast` (`env_runners.runner`), `drain` (fast with
`env_runners.carry_episodes: false`), `nocarry` (fast, dropping the episodes a call leaves
running instead of carrying them). Prints, per run, the mean sampled reward at +20 iterations
(at the last one when --more is smaller), the mean over the last 5, the first iteration reaching
--target and the rows trained per iteration; then each variant's mean over repetitions with its
standard error.

The comparison isolates the EnvRunner: every variant starts from the same weights and optimizer
state, and rewards are read at iteration counts, which do not depend on the machine's load.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from agents.config import algorithm_config, load  # noqa: E402

VARIANTS = {"stock": ["env_runners.runner=stock"], "fast": ["env_runners.runner=fast"],
            "drain": ["env_runners.runner=fast", "env_runners.carry_episodes=false"],
            "nocarry": ["env_runners.runner=fast"]}


def build(args, variant: str, seed: int):
    return algorithm_config(load(args.config, args.overrides + [f"seed={seed}"] + VARIANTS[variant])).build_algo()


def run(args, start_dir: str, variant: str, rep: int) -> dict:
    algo = build(args, variant, seed=100 + rep)
    algo.learner_group.restore_from_path(os.path.join(start_dir, "learner_group"))
    algo.env_runner_group.sync_weights(from_worker_or_learner_group=algo.learner_group)
    torch.manual_seed(1000 + rep)
    np.random.seed(1000 + rep)
    random.seed(1000 + rep)
    rewards, rows = [], []
    for _ in range(args.more):
        if variant == "nocarry":
            algo.env_runner._rollout = None  # drop the episodes the last call left running
        result = algo.train()
        rewards.append(float(result["env_runners"]["episode_return_mean"]))
        rows.append(float(result["learners"]["default_policy"]["num_module_steps_trained"]))
    algo.stop()
    first = next((i + 1 for i, r in enumerate(rewards) if r >= args.target), None)
    return {"at20": rewards[min(19, len(rewards) - 1)], "end": float(np.mean(rewards[-5:])), "first": first,
            "rows": float(np.mean(rows))}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tune_configs/quickstart.yaml")
    p.add_argument("--start", type=int, default=20, help="iterations trained with the stock runner first")
    p.add_argument("--more", type=int, default=40, help="iterations trained by each variant from there")
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--variants", default="stock,fast,drain")
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        sys.exit(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")

    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        algo = build(args, "stock", seed=int(load(args.config, args.overrides)["seed"]))
        for _ in range(args.start):
            result = algo.train()
        if args.start:
            print(f"start: {args.start} stock iterations, reward {result['env_runners']['episode_return_mean']:.3f}")
        start_dir = os.path.join(tmp, "start")  # with --start 0: the initial weights, the same for every run
        algo.save_to_path(start_dir)
        algo.stop()
        out = {v: [] for v in variants}
        at = f"at +{min(20, args.more)}"
        print(f"{'rep':>3s} {'variant':8s} {at:>7s} {'last 5':>7s} {'first >= target':>16s} {'rows/iter':>9s}")
        for rep in range(args.reps):
            for v in variants:
                r = run(args, start_dir, v, rep)
                out[v].append(r)
                print(f"{rep:3d} {v:8s} {r['at20']:7.3f} {r['end']:7.3f} {str(r['first']):>16s} {r['rows']:9,.0f}",
                      flush=True)
    print(f"\n{'variant':8s} {at:>15s} {'last 5':>15s} {'reached target':>15s}")
    for v, rs in out.items():
        a, e = np.array([r["at20"] for r in rs]), np.array([r["end"] for r in rs])
        sqrt_n = np.sqrt(len(rs))  # standard errors: the spread over repetitions / sqrt(n)
        print(f"{v:8s} {a.mean():7.3f} +- {a.std() / sqrt_n:.3f} {e.mean():7.3f} +- {e.std() / sqrt_n:.3f} "
              f"{sum(r['first'] is not None for r in rs):>9d} of {len(rs)}")
    ray.shutdown()


if __name__ == "__main__":
    main()
