"""What `peer_trl.py --learner-log` files say about a run: when the static update captured each
graph, from which iteration on every batch had one size (the bucket also depends on the number of
episodes: `static_bucket` names the one each update took), which buckets served the updates from
then on, the reward's falls with the learner's KL, gradient norm and entropy at them (and, with
`--static-verify-every`, how far that iteration's replay was from the eager update: `check`), the
updates with a large KL and the lowest reward once the policy was nearly deterministic, and,
for several files of the same seed, the first iteration where they part (the reward, the loss or
the gradient norm differs).

    python benchmarks/learner_log.py RUN.jsonl [RUN2.jsonl ...] [--fall 0.05]

A bucket is named by its place in the learner's order of first use (`static_bucket`, logged since
2026-11-27; older logs give only the counts, `static_buckets` and `static_graphs`).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter

BATCH = "module_train_batch_size_mean"
GRAD_NORM = "gradients_default_optimizer_global_norm"
PLATEAU_ENTROPY = 0.05  # a policy whose mean entropy per token is below this is nearly deterministic
SPIKE_KL = 0.1  # an update whose KL (per token, the learner's mean_kl_loss) is above this moved the policy far
CLIP_SCALE = "update_clip_scale"  # training.update_clipping: the smallest scale a tensor's step took
CLIPPED = 0.5  # an update with a tensor's step scaled below this was clipped hard


class LogError(Exception):
    """A log that cannot be read (one line naming the file)."""


def load(path: str) -> list[dict]:
    """The log's iterations, in order. A last line cut short (a run stopped while writing it) is
    left out with a warning; any other line that is not JSON, a missing file or an empty log
    raise LogError naming the file (and line)."""
    try:
        with open(path) as f:
            lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    except OSError as err:
        raise LogError(f"{path}: {err.strerror}") from None
    rows = []
    for k, (n, line) in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            if k < len(lines) - 1:
                raise LogError(f"{path}:{n}: not a JSON line ({err.msg})") from None
            print(f"{path}:{n}: the last line is cut short; left out", file=sys.stderr)
    if not rows:
        raise LogError(f"{path}: no iterations")
    return rows


def summarize(rows: list[dict], fall: float = 0.05) -> dict:
    """The run's captures, the iteration its batch shape settled at, the buckets and replays from
    then on, and its reward falls (a drop of more than `fall` from one iteration to the next)."""
    captures, falls = [], []
    worst = {row["iteration"]: max(c["apart_over_moved"] for c in row["replay_checks"])
             for row in rows if row.get("replay_checks")}  # --static-verify-every's checks
    for prev, row in zip([None] + rows[:-1], rows):
        if prev is not None and row.get("static_graphs", 0) > prev.get("static_graphs", 0):
            captures.append((row["iteration"], row["static_graphs"], row.get(BATCH)))
        if prev is not None and prev["reward"] - row["reward"] > fall:
            falls.append({"iteration": row["iteration"], "from": prev["reward"], "to": row["reward"],
                          "kl": row.get("mean_kl_loss"), "grad_norm": row.get(GRAD_NORM),
                          "entropy": row.get("entropy"), "check": worst.get(row["iteration"])})
    sizes = Counter(row.get(BATCH) for row in rows)
    usual = sizes.most_common(1)[0][0]
    other = [row["iteration"] for row in rows if row.get(BATCH) != usual]
    settled = (max(other) + 1) if other else rows[0]["iteration"]
    after = [row for row in rows if row["iteration"] >= settled]
    rewards = [row["reward"] for row in rows if not math.isnan(row["reward"])]
    return {"plateau": plateau(rows), "iterations": len(rows), "final": rows[-1]["reward"],
            "best": max(rewards, default=math.nan), "captures": captures, "usual_batch": usual, "settled_from": settled,
            "iterations_after": len(after), "replayed_after": sum(1 for r in after if r.get("static_update_replays", 0) >= 1),
            "buckets_after": sorted({r["static_bucket"] for r in after if r.get("static_bucket") is not None}),
            "falls": falls, "checks": sorted(worst.items(), key=lambda ic: ic[1])}


def plateau(rows: list[dict]) -> dict | None:
    """From the first iteration whose entropy is below PLATEAU_ENTROPY: where and when it began,
    the reward then, the updates with a KL above SPIKE_KL from then on, the largest KL and the
    lowest reward; None where the entropy never fell that low."""
    start = next((k for k, row in enumerate(rows) if row.get("entropy", math.inf) < PLATEAU_ENTROPY), None)
    if start is None:
        return None
    after = rows[start:]
    kls = [row["mean_kl_loss"] for row in after if not math.isnan(row.get("mean_kl_loss", math.nan))]
    rewards = [row["reward"] for row in after if not math.isnan(row["reward"])]
    scales = [row[CLIP_SCALE] for row in after  # training.update_clipping
              if not math.isnan(row.get(CLIP_SCALE, math.nan))]
    return {"iteration": rows[start]["iteration"], "t": rows[start].get("t"), "reward": rows[start]["reward"],
            "iterations": len(after), "spikes": sum(kl > SPIKE_KL for kl in kls), "max_kl": max(kls, default=math.nan),
            "lowest": min(rewards, default=math.nan),
            "clipped": sum(scale < CLIPPED for scale in scales) if scales else None,
            "smallest_scale": min(scales, default=math.nan)}


COMPARED = ("reward", "total_loss", GRAD_NORM)  # where same-seed runs part: the first of these to differ


def first_difference(runs: list[list[dict]]) -> tuple[int, str] | None:
    """(the first iteration at which the runs differ, in what: the sampled reward or the learner's
    loss or gradient norm); None: equal throughout their common length."""
    for rows in zip(*runs):
        for key in COMPARED:
            if len({row.get(key) for row in rows}) > 1:
                return rows[0]["iteration"], key
    return None


def report(path: str, s: dict) -> None:
    print(f"{path}: {s['iterations']} iterations, reward final {s['final']:.3f}, best {s['best']:.3f}")
    for it, n, batch in s["captures"]:
        print(f"  graph {n} captured at iteration {it} (batch of {batch:g} steps)")
    if not s["iterations_after"]:
        print(f"  the batch shape never held to the end (the last iteration's batch differs from the "
              f"usual {s['usual_batch']:g} steps)")
    else:
        print(f"  every batch {s['usual_batch']:g} steps from iteration {s['settled_from']}: "
              f"{s['replayed_after']} of its {s['iterations_after']} iterations replayed a graph"
              + (f", bucket(s) {s['buckets_after']}" if s["buckets_after"] else ""))
    if s["checks"]:
        (it, largest), median = s["checks"][-1], s["checks"][len(s["checks"]) // 2][1]
        print(f"  replay checks in {len(s['checks'])} iterations: |replay - eager| / |eager update| median "
              f"{median:.3g}, largest {largest:.3g} (iteration {it})")
    if s["plateau"] is not None:
        pl = s["plateau"]
        when = f", {pl['t']:.0f} s" if pl["t"] is not None else ""
        print(f"  nearly deterministic (entropy < {PLATEAU_ENTROPY}) from iteration {pl['iteration']}{when}, reward "
              f"{pl['reward']:.3f}: over its {pl['iterations']} iterations {pl['spikes']} updates with a KL above "
              f"{SPIKE_KL} (largest {pl['max_kl']:.3g}), lowest reward {pl['lowest']:.3f}")
        if pl["clipped"] is not None:
            print(f"  update clipping there: {pl['clipped']} updates with a tensor's step scaled below {CLIPPED} "
                  f"(smallest scale {pl['smallest_scale']:.3g})")
    for f in s["falls"]:
        extra = "".join(f", {k} {f[k]:.3g}" for k in ("kl", "grad_norm", "entropy", "check") if f[k] is not None)
        print(f"  fall at iteration {f['iteration']}: {f['from']:.3f} -> {f['to']:.3f}{extra}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+")
    p.add_argument("--fall", type=float, default=0.05, help="a drop of the reward larger than this is a fall")
    args = p.parse_args()
    runs, failed = [], False
    for path in args.logs:  # a log that cannot be read is named; the others are still summarized
        try:
            rows = load(path)
        except LogError as err:
            print(err, file=sys.stderr)
            failed = True
            continue
        report(path, summarize(rows, args.fall))
        runs.append(rows)
    if len(runs) > 1:
        part = first_difference(runs)
        print("the runs are equal throughout (reward, loss, gradient norm)" if part is None
              else f"the runs first differ at iteration {part[0]}, in {part[1]}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
