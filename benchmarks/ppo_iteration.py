"""Env steps/s through full PPO iterations, with the sample / learn split.

    python benchmarks/ppo_iteration.py [--config tune_configs/quickstart.yaml] [--iters 5] [--set key=value ...]

Builds the algorithm from the config (no Tune), runs one warm-up iteration,
then --iters timed ones. The learn phase is timed around
`learner_group.update` (learner connectors, GAE, reference KL, all epochs);
the sample phase is the rest of the iteration (EnvRunner sampling, weight
sync, bookkeeping).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from agents.config import algorithm_config, load  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tune_configs/quickstart.yaml")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    cfg = load(args.config, args.overrides)

    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
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
    for _ in range(args.iters):
        result = algo.train()
    wall = time.perf_counter() - start
    steps = result["env_runners"]["num_env_steps_sampled_lifetime"] - before
    learn_s = learn["s"]
    sample_s = wall - learn_s
    algo.stop()
    n = args.iters
    print(f"config={args.config} overrides={args.overrides} model={cfg['model']['name_or_path']}")
    print(f"env steps/s through full iterations: {steps / wall:,.1f}  ({steps / n:,.0f} steps per iteration, "
          f"{wall / n:.2f} s per iteration)")
    print(f"per iteration: sample {sample_s / n:.2f} s ({sample_s / wall:.0%}), "
          f"learn {learn_s / n:.2f} s ({learn_s / wall:.0%})")


if __name__ == "__main__":
    main()
