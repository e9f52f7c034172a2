"""Env steps/s through full PPO iterations, with the sample / learn split.

    python benchmarks/ppo_iteration.py [--config tune_configs/quickstart.yaml] [--iters 5] [--runners fast,stock]
                                       [--set key=value ...]

For each EnvRunner kind (`env_runners.runner`), builds the algorithm from the
config (no Tune), runs one warm-up iteration, then --iters timed ones. The learn phase is timed around
`learner_group.update` (learner connectors, GAE, reference KL, all epochs);
the sample phase is the rest of the iteration (EnvRunner sampling, weight
sync, bookkeeping).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from agents.config import algorithm_config, load  # noqa: E402


def measure(cfg: dict, iters: int) -> dict:
    """Env steps/s through `iters` timed iterations (after one warm-up), and the sample/learn split."""
    algo = algorithm_config(cfg).build_algo()
    learn = {"s": 0.0}
    update = algo.learner_group.update

    def timed_update(*a, **kw):
        t0 = time.perf_counter()
        try:
            return update(*a, **kw)
        finally:
            learn["s"] += time.perf_counter() - t0

    algo.learner_group.update = timed_update
    first = algo.train()  # warm-up
    before = first["env_runners"]["num_env_steps_sampled_lifetime"]
    learn["s"] = 0.0
    start = time.perf_counter()
    for _ in range(iters):
        result = algo.train()
    wall = time.perf_counter() - start
    steps = result["env_runners"]["num_env_steps_sampled_lifetime"] - before
    algo.stop()
    return {"steps_per_s": steps / wall, "steps_per_iter": steps / iters, "s_per_iter": wall / iters,
            "sample_s": (wall - learn["s"]) / iters, "learn_s": learn["s"] / iters}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tune_configs/quickstart.yaml")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--runners", default="fast,stock", help="comma-separated env_runners.runner values to compare")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()

    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    rows = {}
    for runner in args.runners.split(","):
        cfg = load(args.config, args.overrides + [f"env_runners.runner={runner}"])
        rows[runner] = measure(cfg, args.iters)
    print(f"config={args.config} overrides={args.overrides} model={cfg['model']['name_or_path']} iters={args.iters}")
    print(f"{'runner':8s} {'env steps/s':>12s} {'steps/iter':>11s} {'s/iter':>7s} {'sample s':>9s} {'learn s':>8s}")
    for runner, r in rows.items():
        print(f"{runner:8s} {r['steps_per_s']:12,.1f} {r['steps_per_iter']:11,.0f} {r['s_per_iter']:7.2f} "
              f"{r['sample_s']:6.2f} ({r['sample_s'] / r['s_per_iter']:.0%}) {r['learn_s']:5.2f} "
              f"({r['learn_s'] / r['s_per_iter']:.0%})")
    if "fast" in rows and "stock" in rows:
        print(f"fast / stock env steps/s = {rows['fast']['steps_per_s'] / rows['stock']['steps_per_s']:.2f}")


if __name__ == "__main__":
    main()
