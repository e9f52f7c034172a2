"""The quickstart's learning curve per seed, built and trained directly (no Tune).

    python benchmarks/quickstart_seeds.py [--seeds 0-7] [--iters 160] [--until 0.93]
                                          [--runners fast,stock] [--set key=value ...]

For each seed (and EnvRunner kind, one after the other), trains `tune_configs/quickstart.yaml`
for at most --iters iterations, stopping once the mean episode reward reaches --until (0: run all
--iters), and prints the iteration and training seconds at which the reward first reached 0.85,
0.9 and 0.93, and the reward at iterations 40, 100 and 160. Seconds count from the start of the
first iteration. One run at a time: on a busy machine the seconds mean nothing, the iterations
still do.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from agents.config import algorithm_config, load  # noqa: E402

THRESHOLDS = (0.85, 0.9, 0.93)
AT = (40, 100, 160)


def seeds_arg(text: str) -> list[int]:
    """'0-7' or '0,3,5' -> the seeds."""
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def run(cfg: dict, iters: int, until: float) -> dict:
    algo = algorithm_config(cfg).build_algo()
    reached, at, rewards = {}, {}, []
    start = time.perf_counter()
    try:
        for i in range(1, iters + 1):
            reward = algo.train()["env_runners"]["episode_return_mean"]
            seconds = time.perf_counter() - start
            rewards.append(reward)
            for x in THRESHOLDS:
                if x not in reached and reward >= x:
                    reached[x] = (i, seconds)
            if i in AT:
                at[i] = reward
            if until and reward >= until:
                break
    finally:
        algo.stop()
    return {"reached": reached, "at": at, "iterations": len(rewards), "seconds": time.perf_counter() - start,
            "final": rewards[-1]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tune_configs/quickstart.yaml")
    p.add_argument("--seeds", type=seeds_arg, default=seeds_arg("0-7"))
    p.add_argument("--iters", type=int, default=160)
    p.add_argument("--until", type=float, default=0.93, help="stop a run at this reward (0: never)")
    p.add_argument("--runners", default="fast", help="comma-separated env_runners.runner values")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()

    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    head = " | ".join(f"{x}: iteration, s" for x in THRESHOLDS)
    print(f"config={args.config} overrides={args.overrides} iters={args.iters} until={args.until}")
    print(f"| seed | runner | {head} | " + " | ".join(f"reward at {i}" for i in AT) + " | iterations, s |")
    print("| ---: | --- | " + " | ".join("---" for _ in THRESHOLDS) + " | " + " | ".join("---:" for _ in AT)
          + " | --- |")
    for seed in args.seeds:
        for runner in args.runners.split(","):
            cfg = load(args.config, args.overrides + [f"seed={seed}", f"env_runners.runner={runner}"])
            r = run(cfg, args.iters, args.until)
            cells = [f"{r['reached'][x][0]}, {r['reached'][x][1]:.1f}" if x in r["reached"] else "-"
                     for x in THRESHOLDS]
            cells += [f"{r['at'][i]:.3f}" if i in r["at"] else "-" for i in AT]
            print(f"| {seed} | {runner} | " + " | ".join(cells) + f" | {r['iterations']}, {r['seconds']:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
