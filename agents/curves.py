"""`evaluate --curves`: a run's training curves, one PNG per metric against training_iteration,
one line per trial, from each trial's `result.json` (else `progress.csv`)."""
from __future__ import annotations

import csv
import json
import os
import sys


class EvalError(ValueError):
    """Bad input to the evaluation or its curves, one line naming what is wrong."""


def find_trials(run: str) -> list[str]:
    """Trial directories (holding result.json or progress.csv) at or under `run`."""
    if not os.path.isdir(run):
        raise EvalError(f"--curves: {run}: no such run directory")
    found = sorted(root for root, _, files in os.walk(run) if "result.json" in files or "progress.csv" in files)
    if not found:
        raise EvalError(f"--curves: {run}: no result.json or progress.csv under it")
    return found


def read_curves(trial: str) -> list[dict]:
    """The trial's results, one flat dict per iteration (nested keys joined with '/')."""
    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}/"))
            else:
                out[prefix + k] = v
        return out

    path = os.path.join(trial, "result.json")
    if os.path.isfile(path) and os.path.getsize(path) > 0:
        with open(path, encoding="utf-8") as f:
            lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
        rows = []
        for n, line in lines:
            try:
                rows.append(flat(json.loads(line)))
            except json.JSONDecodeError as e:
                if n != lines[-1][0]:
                    raise EvalError(f"--curves: {path}: line {n} is not valid JSON ({e.msg})") from None
                print(f"note: {path}: its last line is cut short (a run stopped mid-write); plotted without it",
                      file=sys.stderr)
        return rows
    csv_path = os.path.join(trial, "progress.csv")
    if not os.path.isfile(csv_path):
        return []  # a trial that stopped before its first result
    with open(csv_path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _metric_key(rows: list[dict], metric: str) -> str | None:
    """The logged key `metric` names in these rows (the whole key, or its last part), or None."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    if metric in keys:
        return metric
    matches = [k for k in keys if k.split("/")[-1] == metric or k.endswith("/" + metric)]
    return min(matches, key=len) if matches else None  # the shortest: env_runners/x over env_runners/module/x


def _metric_missing(data: list, metric: str) -> EvalError:
    import difflib

    keys = {k.split("/")[-1] for _, _, rows in data for r in rows for k in r}
    hint = difflib.get_close_matches(metric, sorted(keys), n=1)
    where = data[0][1] if len(data) == 1 else f"any of the {len(data)} trials"
    return EvalError(f"--metric: {metric!r} is not logged in {where}" + (f" (did you mean {hint[0]!r}?)" if hint else ""))


def plot_curves(runs: list[str], metrics: list[str], out_dir: str) -> list[str]:
    """One PNG per metric, the metric against training_iteration, one line per trial."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trials = [(run, t) for run in runs for t in find_trials(run)]
    data = [(run, t, read_curves(t)) for run, t in trials]
    for run, trial, rows in data:
        if not rows:
            print(f"note: {trial}: no results yet (it stopped before its first iteration); not plotted",
                  file=sys.stderr)
    data = [d for d in data if d[2]]
    if not data:
        raise EvalError(f"--curves: no trial under {', '.join(runs)} has a result yet")
    for metric in metrics:
        if all(_metric_key(rows, metric) is None for _, _, rows in data):
            raise _metric_missing(data, metric)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for metric in metrics:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for run, trial, rows in data:
            key = _metric_key(rows, metric)
            if key is None:  # another trial logs it (e.g. evaluation metrics of trials that evaluated)
                continue
            points = [(float(r["training_iteration"]), float(r[key])) for r in rows
                      if r.get(key) not in (None, "") and r.get("training_iteration") not in (None, "")]
            label = os.path.relpath(trial, os.path.dirname(os.path.abspath(run).rstrip(os.sep)))
            ax.plot([p[0] for p in points], [p[1] for p in points], label=label[:60])
        ax.set_xlabel("training iteration")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, f"curve_{metric.replace('/', '_')}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
