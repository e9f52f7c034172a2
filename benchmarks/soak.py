"""Soak run: train for a fixed long budget and watch every process's memory.

    .venv/bin/python benchmarks/soak.py ppo [--minutes 60] [--every 60] [--limit-mb-per-hour 50]
    .venv/bin/python benchmarks/soak.py dqn [--minutes 60] ...

Runs `python -m agents.train` (ppo: tune_configs/quickstart.yaml, dqn: tune_configs/dqn_synthetic.yaml,
with replay; or --config FILE) with its stop criteria replaced by `stop.time_total_s` = the budget,
the dashboard on as by default, results in a temporary directory. Every --every seconds it
samples the resident set size (RSS) of the driver and every process below it (Ray's GCS, raylet,
dashboard and agents, the trial's actor, EnvRunners, ...), and at the end prints, per process,
its RSS after the warm-up (the first --warmup-minutes, default 20% of the budget), at the end,
the largest, and two growth rates per hour (least-squares slopes of RSS): over all samples after
the warm-up, and over the second half of them (the end of the run). Samples go to --csv (one row
per process and sample) when given.

Memory that fills up to a bound (a replay buffer reaching its capacity) grows after the warm-up
and then stands still; memory without a bound still grows at the end. So a process whose growth
over the second half exceeds --limit-mb-per-hour (default 50 MB/h) and adds more than --limit-mb
(default 10 MB) there counts as growing without bound: the script says so in capitals, names the
processes, and exits 1. It also exits 1 when the run fails. It never passes or fails on a speed.
"""
from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import threading
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"ppo": "tune_configs/quickstart.yaml", "dqn": "tune_configs/dqn_synthetic.yaml"}


def label(proc: psutil.Process) -> str:
    """A short name for a process of the run: Ray's worker title (ray::LMPPO.train), or the
    program and its module or script (gcs_server, raylet, dashboard.py, agents.train)."""
    try:
        cmd = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"
    if not cmd:
        return proc.name()
    first = cmd[0]
    if first.startswith("ray::") or first.startswith("ray-dashboard-"):
        return first.split()[0].split("(")[0]
    name = os.path.basename(first)
    if name.startswith("python"):
        for i, arg in enumerate(cmd[1:], 1):
            if arg == "-m" and i + 1 < len(cmd):
                return cmd[i + 1]
            if arg.endswith(".py"):
                return os.path.basename(arg)
            if arg == "-c":
                return "python -c " + (cmd[i + 1][:30] if i + 1 < len(cmd) else "")
    return name


def processes(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, bytes) points, in bytes per hour."""
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return 0.0 if var == 0 else 3600 * sum((t - mt) * (v - mv) for t, v in points) / var


def report(samples: dict, warmup: float, limit_mb_per_hour: float, limit_mb: float) -> list[str]:
    """Prints the table of `samples` ((pid, start) -> {"label", "points": [(s, bytes)]}); returns the
    processes that grew without bound."""
    header = (f"  {'process':<28} {'pid':>7} {'samples':>7} {'RSS after warm-up':>17} {'at end':>8} {'max':>8} "
              f"{'MB/h after warm-up':>18} {'MB/h 2nd half':>13}")
    print(header)
    growing = []
    for (pid, _), entry in sorted(samples.items(), key=lambda kv: -kv[1]["points"][-1][1]):
        points = entry["points"]
        window = [(t, v) for t, v in points if t >= warmup]
        if len(window) < 3:  # lived too briefly after the warm-up to say
            continue
        mb = 2**20
        per_hour = slope_per_hour(window) / mb
        late = window[len(window) // 2:]
        late_per_hour = slope_per_hour(late) / mb
        added = (late[-1][1] - late[0][1]) / mb
        flag = late_per_hour > limit_mb_per_hour and added > limit_mb
        if flag:
            growing.append(f"{entry['label']} (pid {pid}): {late_per_hour:+.1f} MB/h, {added:+.1f} MB over the "
                           f"second half ({per_hour:+.1f} MB/h after the warm-up)")
        print(f"  {entry['label'][:28]:<28} {pid:>7} {len(points):>7} {window[0][1] / mb:>14.1f} MB "
              f"{points[-1][1] / mb:>8.1f} {max(v for _, v in points) / mb:>8.1f} {per_hour:>+18.1f} "
              f"{late_per_hour:>+13.1f}{'  <-- GROWS' if flag else ''}")
    return growing


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("algo", choices=sorted(CONFIGS), help="ppo (the quickstart) or dqn (with replay)")
    parser.add_argument("--config", help="experiment file instead of the algorithm's default")
    parser.add_argument("--minutes", type=float, default=60, help="training budget (default 60)")
    parser.add_argument("--every", type=float, default=60, help="seconds between samples (default 60)")
    parser.add_argument("--warmup-minutes", type=float, default=None,
                        help="samples before this are not used for the growth (default: 20%% of --minutes)")
    parser.add_argument("--limit-mb-per-hour", type=float, default=50.0,
                        help="growth per hour that counts as unbounded (default 50)")
    parser.add_argument("--limit-mb", type=float, default=10.0,
                        help="...together with this much growth over the second half (default 10)")
    parser.add_argument("--csv", help="write every sample here")
    parser.add_argument("--report", metavar="CSV", help="print the table of an earlier run's --csv; train nothing")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="more config overrides for the run")
    args = parser.parse_args(argv)
    warmup = 60 * (args.warmup_minutes if args.warmup_minutes is not None else 0.2 * args.minutes)
    config = args.config or os.path.join(ROOT, CONFIGS[args.algo])
    if args.report:
        samples: dict = {}
        with open(args.report, newline="") as f:
            for row in csv.DictReader(f):
                entry = samples.setdefault((int(row["pid"]), 0.0), {"label": row["process"], "points": []})
                entry["label"] = row["process"]  # the last name: a worker that became an actor
                entry["points"].append((float(row["seconds"]), float(row["rss_mb"]) * 2**20))
        growing = report(samples, warmup, args.limit_mb_per_hour, args.limit_mb)
        print("\n" + ("UNBOUNDED MEMORY GROWTH:\n  " + "\n  ".join(growing) if growing else "no unbounded growth"))
        return 1 if growing else 0

    storage = tempfile.mkdtemp(prefix="soak-")
    budget = 60 * args.minutes
    cmd = [sys.executable, "-m", "agents.train", config,
           "--set", f"stop.time_total_s={budget:g}", "--set", "stop.training_iteration=null",
           "--set", "stop.episode_return_mean=null", "--set", f"tune.storage_path={storage}",
           "--set", "tune.name=soak", "--set", "generate.num_samples=0"]
    for o in args.overrides:
        cmd += ["--set", o]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("RAY_ADDRESS", None)  # a private local instance: every process of the run is below the driver
    print(f"{args.algo}: {' '.join(cmd[1:])}", flush=True)
    print(f"  budget {args.minutes:g} min, a sample every {args.every:g} s, warm-up {warmup / 60:g} min; "
          f"{os.cpu_count()} CPU cores, load average {'/'.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    root = psutil.Process(proc.pid)
    tail: list[str] = []
    iterations = [0]

    def read():
        for line in proc.stdout:
            tail.append(line)
            del tail[:-40]
            if line.startswith("iter "):
                iterations[0] += 1

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    samples: dict[tuple[int, float], dict] = {}  # (pid, create_time) -> {"label", "points"}
    rows = []
    loads = []
    while proc.poll() is None:
        now = time.time() - start
        for p in processes(root):
            try:
                key = (p.pid, p.create_time())
                rss = p.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            entry = samples.setdefault(key, {"label": label(p), "points": []})
            if entry["label"].startswith("ray::") and entry["label"] in ("ray::IDLE",):
                entry["label"] = label(p)  # an idle worker that became an actor
            entry["points"].append((now, rss))
            rows.append({"seconds": round(now), "pid": p.pid, "process": entry["label"], "rss_mb": rss / 2**20})
        loads.append(os.getloadavg()[0])
        print(f"  {now / 60:5.1f} min  {len(processes(root)):3d} processes  total RSS "
              f"{sum(p['points'][-1][1] for p in samples.values() if p['points'][-1][0] == now) / 2**20:8.1f} MB  "
              f"iterations {iterations[0]}  load {loads[-1]:.2f}", flush=True)
        deadline = time.time() + args.every
        while proc.poll() is None and time.time() < deadline:
            time.sleep(1)
    reader.join(timeout=10)
    wall = time.time() - start
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["seconds", "pid", "process", "rss_mb"])
            w.writeheader()
            w.writerows(rows)

    print(f"\n{args.algo}: {iterations[0]} iterations in {wall / 60:.1f} min, exit code {proc.returncode}; "
          f"load average (1 min) during the run: min {min(loads):.2f}, mean {sum(loads) / len(loads):.2f}, "
          f"max {max(loads):.2f}; at the end {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    growing = report(samples, warmup, args.limit_mb_per_hour, args.limit_mb)
    if proc.returncode != 0:
        print("\nTHE RUN FAILED:\n" + "".join(tail[-20:]), file=sys.stderr)
        return 1
    if growing:
        print(f"\nUNBOUNDED MEMORY GROWTH (over {args.limit_mb_per_hour:g} MB/h and {args.limit_mb:g} MB over "
              f"the second half of the run):\n  " + "\n  ".join(growing), file=sys.stderr)
        return 1
    print(f"\nno process grew by more than {args.limit_mb_per_hour:g} MB/h (and {args.limit_mb:g} MB) over the second "
          f"half of the run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
