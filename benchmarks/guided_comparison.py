"""Compares finished runs of several algorithms (each with several seeds) on sample efficiency.

    python benchmarks/guided_comparison.py results/ppo_synthetic results/ppo_pp_synthetic ...

Each argument is a Tune experiment directory, or several joined with commas (seeds run as
separate experiments, shown under the first one's name). For every trial it reads result.json: env steps
sampled (guide tokens included: they are env steps too) and the reward of the episodes the
policy wrote alone (`env_runners/policy_return_mean` for guided runs, the mean episode return
otherwise). It prints, per experiment, the mean over seeds of the final reward and of the env
steps at which the reward first reached each level (`--levels`; the first experiment's final
mean reward is always one of them). Nothing here passes or fails: it prints measurements.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os


def trial_curve(trial_dir: str) -> list[tuple[int, float]]:
    curve = []
    with open(os.path.join(trial_dir, "result.json")) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            er = r.get("env_runners", {})
            reward = er.get("policy_return_mean") if "guide_mode_aggrevated" in r else er.get("episode_return_mean")
            if reward is None or (isinstance(reward, float) and math.isnan(reward)):
                continue
            curve.append((int(er.get("num_env_steps_sampled_lifetime", 0)), float(reward)))
    return curve


def first_reaching(curve, level: float):
    return next((steps for steps, reward in curve if reward >= level), None)


def mean_std(xs):
    m = sum(xs) / len(xs)
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, s


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiments", nargs="+")
    parser.add_argument("--levels", type=float, nargs="*", default=[0.6, 0.7])
    args = parser.parse_args(argv)
    curves = {}
    for arg in args.experiments:
        exps = [e for e in arg.split(",") if e]
        trials = sorted(d for exp in exps for d in glob.glob(os.path.join(exp, "*"))
                        if os.path.isfile(os.path.join(d, "result.json")))
        curves[os.path.basename(exps[0].rstrip("/"))] = [c for c in (trial_curve(t) for t in trials) if c]
    first = next(iter(curves.values()))
    reference = round(mean_std([c[-1][1] for c in first])[0], 3)
    levels = sorted(set(args.levels) | {reference})
    head = ["experiment", "seeds", "final env steps", "final reward (mean ± std)"] + [f"steps to {lv:g}" for lv in levels]
    print(f"reference level {reference:g}: the first experiment's final mean reward")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, cs in curves.items():
        final_m, final_s = mean_std([c[-1][1] for c in cs])
        steps_m = mean_std([c[-1][0] for c in cs])[0]
        cells = [name, str(len(cs)), f"{steps_m:,.0f}", f"{final_m:.3f} ± {final_s:.3f}"]
        for lv in levels:
            hits = [first_reaching(c, lv) for c in cs]
            reached = [h for h in hits if h is not None]
            if len(reached) == len(hits):
                cells.append(f"{mean_std(reached)[0]:,.0f}")
            else:
                cells.append(f"{len(reached)}/{len(hits)} seeds" + (f" (mean {mean_std(reached)[0]:,.0f})" if reached else ""))
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
