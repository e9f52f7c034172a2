"""Load test of the policy server (`agents.serve`): concurrent clients, a fixed number of requests.

    .venv/bin/python benchmarks/serve_load.py [--replicas 1 2] [--clients 8] [--requests 200]
        [--route completions|generate] [--max-tokens 20] [--n 1] [--bad-every K]
        [--checkpoint PATH | --url URL] [--num-cpus 0.5] [--serve-args "--max-replicas 2"]
        [--kill-replica-after S [--recovery-timeout 180]]

Without --url it starts `python -m agents.serve` once per value of --replicas (a private Ray
instance on a free loopback port, each replica reserving --num-cpus CPUs), serving --checkpoint
or, without one, a tiny policy it builds itself: the quickstart's tiny GPT-2 (2 layers, 64 wide,
vocabulary 52) with its random initial weights (what a request costs does not depend on training).
It waits for the server, sends --warmup requests, runs the timed requests, then stops the server
(SIGINT to its process group; SIGKILL if it has not stopped after 60 s). With --url it sends to a
running server (its /generate URL or the base URL) and starts nothing.

Each of --clients threads keeps one HTTP/1.1 connection (http.client) and takes the next request
until --requests have been sent: POST /v1/completions (prompt "3 7 12", max_tokens, n, seed = the
request's number) or POST /generate (the same as max_new_tokens / num_samples). With --bad-every K
every K-th request is a malformed one instead (a cycle of bad bodies on both routes); each must get
a 4xx whose JSON is {"error": "<field>: ..."} naming the field the body got wrong, else it counts
as a wrong answer.

With --kill-replica-after S (a server this script starts), S seconds into the timed requests it
kills one replica's process (SIGKILL to the `ray::ServeReplica` process below the server) and keeps
sending, past --requests if need be, until a request is answered by a replica that was not serving
before the kill (Serve's replacement) or --recovery-timeout passes. It then prints how many good
requests failed after the kill (and their statuses), how long after the kill the first and last of
them ended, and how long until the replacement replica answered its first request. Without a kill,
a reply from more distinct replicas than were started means a replica was restarted, and counts as
a failure.

Prints, per run: requests answered 200, errors (a good request not answered 200, or no answer),
bad requests answered as expected / wrongly, throughput (good requests/s and completion tokens/s:
usage.completion_tokens of /v1/completions; /generate reports no token counts), latency p50/p95 of
the good requests, how many each replica answered (the X-Replica header), and the load average
before and after (the machine may be shared: read the figures next to it). It never passes or
fails on a figure; the exit status is 1 only if a request failed (with a kill: before the kill),
a bad one was answered wrongly, a replica restarted without a kill, or a killed replica was not
replaced in time.
"""
from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import re
import shlex
import signal
import sys
import tempfile
import threading
import time
import urllib.parse

from agents.serve.launch import ServeProcess, untrained_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "3 7 12"

# (route, body, the field its error must name); bytes are sent as they are
BAD = [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/generate", {"prompt": PROMPT, "num_samples": "two"}, "num_samples"),
    ("/v1/completions", {"prompt": 37}, "prompt"),
    ("/generate", b"{\"prompt\": ", "request body"),
    ("/v1/completions", {"prompt": PROMPT, "stream": True}, "stream"),
    ("/generate", {"prompt": "three"}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": 5}, "temperature"),
    ("/generate", {"prompt": PROMPT, "max_tokens": 5}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "n": 10_000}, "n"),
]


def good_request(args, i: int) -> tuple[str, dict]:
    if args.route == "completions":
        return "/v1/completions", {"prompt": PROMPT, "max_tokens": args.max_tokens, "n": args.n, "seed": i}
    return "/generate", {"prompt": PROMPT, "max_new_tokens": args.max_tokens, "num_samples": args.n, "seed": i}


def replica_processes(server_pid: int) -> list[int]:
    """The process ids of the Serve replicas below the server's process."""
    import psutil

    pids = []
    for p in psutil.Process(server_pid).children(recursive=True):
        try:
            if p.cmdline() and p.cmdline()[0].startswith("ray::ServeReplica"):
                pids.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


def run_load(base: str, args, server_pid: int | None = None) -> dict:
    """Sends --warmup, then --requests requests from --clients threads (with --kill-replica-after,
    kills a replica of the server `server_pid` on the way); the figures of the timed part."""
    url = urllib.parse.urlsplit(base)
    prefix = url.path.rstrip("/")
    counter, lock = iter(range(10**9)), threading.Lock()
    records: list[dict] = []
    kill: dict = {}  # at (s into the timed part), pid, replicas (that answered before it)

    def send(conn, route: str, body) -> tuple[int, dict, str | None]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", prefix + route, body=data, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        body = response.read()
        try:
            reply = json.loads(body or b"null")
        except json.JSONDecodeError:  # e.g. the proxy's plain-text 500 when a replica dies mid-request
            reply = {"error": f"not JSON: {body[:200].decode(errors='replace')}"}
        return response.status, reply, response.getheader("X-Replica")

    def client(numbers):
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=args.timeout)
        for i in numbers:
            bad = args.bad_every and (i + 1) % args.bad_every == 0
            route, body, field = BAD[(i // args.bad_every) % len(BAD)] if bad else (*good_request(args, i), None)
            start = time.perf_counter()
            try:
                status, reply, replica = send(conn, route, body)
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                conn = http.client.HTTPConnection(url.hostname, url.port, timeout=args.timeout)
                status, reply, replica = None, {"error": f"{type(e).__name__}: {e}"}, None
            end = time.perf_counter()
            record = {"bad": bool(bad), "status": status, "seconds": end - start, "replica": replica, "reply": reply,
                      "start": start - t0, "end": end - t0}
            if bad:
                error = reply.get("error", "") if isinstance(reply, dict) else ""
                record["ok"] = (status is not None and 400 <= status < 500 and set(reply) == {"error"}
                                and error.startswith(f"{field}:") and "\n" not in error)
            else:
                record["ok"] = status == 200
                record["tokens"] = reply["usage"]["completion_tokens"] if record["ok"] and "usage" in reply else 0
            with lock:
                records.append(record)
        conn.close()

    def recovered() -> bool:
        return any(r["ok"] and not r["bad"] and r["replica"] and r["replica"] not in kill["replicas"]
                   and r["start"] >= kill["at"] for r in records)

    def numbers():
        while True:
            with lock:
                i = next(counter)
                more = i < args.requests
                if args.kill_replica_after is not None and not more:  # go on until the replacement answered
                    now = time.perf_counter() - t0
                    more = not kill or (not recovered() and now < kill["at"] + args.recovery_timeout)
            if not more:
                return
            yield i

    def kill_one():
        with lock:
            answered = {r["replica"] for r in records if r["replica"]}
        pids = replica_processes(server_pid)
        if not pids:
            print("  --kill-replica-after: no replica process found", flush=True)
            return
        os.kill(pids[0], signal.SIGKILL)
        with lock:
            kill.update(at=time.perf_counter() - t0, pid=pids[0], replicas=answered)
        print(f"  killed replica process {pids[0]} at {kill['at']:.1f} s ({len(pids)} replica processes)", flush=True)

    warm = http.client.HTTPConnection(url.hostname, url.port, timeout=args.timeout)
    for i in range(args.warmup):
        route, body = good_request(args, 10**6 + i)
        status, reply, _ = send(warm, route, body)
        if status != 200:
            raise RuntimeError(f"warm-up request answered {status}: {reply}")
    warm.close()

    load_before = os.getloadavg()
    threads = [threading.Thread(target=client, args=(numbers(),)) for _ in range(args.clients)]
    t0 = start = time.perf_counter()
    killer = None
    if args.kill_replica_after is not None:
        killer = threading.Timer(args.kill_replica_after, kill_one)
        killer.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if killer:
        killer.cancel()
    wall = time.perf_counter() - start
    load_after = os.getloadavg()

    good = [r for r in records if not r["bad"]]
    answered = sorted(r["seconds"] for r in good if r["ok"])

    def quantile(q):
        return answered[min(len(answered) - 1, int(q * len(answered)))] if answered else float("nan")

    bad = [r for r in records if r["bad"]]
    failures = [r for r in records if not r["ok"]]
    result = {
        "requests": len(records), "wall_s": wall, "ok": len(answered), "errors": len(good) - len(answered),
        "bad_ok": sum(r["ok"] for r in bad), "bad_wrong": len(bad) - sum(r["ok"] for r in bad),
        "req_per_s": len(answered) / wall, "tokens_per_s": sum(r.get("tokens", 0) for r in good) / wall,
        "p50_ms": 1000 * quantile(0.50), "p95_ms": 1000 * quantile(0.95),
        "replicas": dict(collections.Counter(r["replica"] for r in good if r["ok"] and r["replica"])),
        "load_before": load_before, "load_after": load_after,
        "first_failure": failures[0] if failures else None,
        "failures_before_kill": len([r for r in failures if not kill or r["end"] < kill["at"]]),
        "kill": None,
    }
    if kill:
        after = [r for r in good if not r["ok"] and r["end"] >= kill["at"]]
        new = [r for r in good if r["ok"] and r["replica"] not in kill["replicas"] and r["start"] >= kill["at"]]
        result["kill"] = {
            "at_s": kill["at"], "pid": kill["pid"], "failed": len(after),
            "answered_after": sum(r["ok"] for r in good if r["end"] >= kill["at"]),
            "statuses": dict(collections.Counter(str(r["status"]) for r in after)),
            "failed_from_s": min((r["end"] - kill["at"] for r in after), default=None),
            "failed_until_s": max((r["end"] - kill["at"] for r in after), default=None),
            "replacement_s": min((r["end"] - kill["at"] for r in new), default=None),
            "example": after[0]["reply"] if after else None,
        }
    return result


def report(label: str, r: dict, route: str) -> str:
    tokens = f"{r['tokens_per_s']:8.0f}" if route == "completions" else "       -"
    load = "/".join(f"{x:.2f}" for x in r["load_before"]) + " -> " + "/".join(f"{x:.2f}" for x in r["load_after"])
    return (f"{label:>9} | {r['requests']:5d} | {r['ok']:5d} | {r['errors']:4d} | {r['bad_ok']:3d} ok "
            f"{r['bad_wrong']:2d} wrong | {r['req_per_s']:7.1f} | {tokens} | {r['p50_ms']:7.1f} | {r['p95_ms']:7.1f} | "
            f"{', '.join(str(v) for v in sorted(r['replicas'].values(), reverse=True)) or '-'} | {load}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2], help="one run per value (default 1 2)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent client threads (default 8)")
    parser.add_argument("--requests", type=int, default=200, help="timed requests per run (default 200)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed requests first (default 4)")
    parser.add_argument("--route", choices=("completions", "generate"), default="completions")
    parser.add_argument("--max-tokens", type=int, default=20, help="new tokens per completion (default 20)")
    parser.add_argument("--n", type=int, default=1, help="completions per request (default 1)")
    parser.add_argument("--bad-every", type=int, default=0, help="every K-th request is malformed (default: none)")
    parser.add_argument("--checkpoint", help="checkpoint to serve (default: a tiny policy built here)")
    parser.add_argument("--url", help="send to this running server instead of starting one")
    parser.add_argument("--num-cpus", type=float, default=0.5, help="CPUs each replica reserves (default 0.5)")
    parser.add_argument("--serve-args", default="", help="more agents.serve flags, e.g. \"--max-replicas 2\"")
    parser.add_argument("--timeout", type=float, default=120, help="seconds a request may take (default 120)")
    parser.add_argument("--kill-replica-after", type=float, default=None, metavar="S",
                        help="kill one replica's process S seconds into the timed requests (default: no kill)")
    parser.add_argument("--recovery-timeout", type=float, default=180,
                        help="with a kill: seconds to keep sending for the replacement replica (default 180)")
    args = parser.parse_args(argv)
    for flag in ("clients", "requests", "max_tokens", "n"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.bad_every < 0 or args.warmup < 0 or min(args.replicas) < 1:
        parser.error("--bad-every and --warmup must be >= 0, --replicas >= 1")
    if args.url and args.checkpoint:
        parser.error("--url sends to a running server; --checkpoint is for one this script starts")
    if args.kill_replica_after is not None and (args.url or args.kill_replica_after < 0):
        parser.error("--kill-replica-after needs a server this script starts (no --url) and S >= 0")

    print(f"route /{'v1/completions' if args.route == 'completions' else 'generate'}, {args.clients} clients, "
          f"{args.requests} requests, {args.max_tokens} new tokens x {args.n}, bad every "
          f"{args.bad_every or '-'}; {os.cpu_count()} CPU cores", flush=True)
    header = ("   server | sent  |  200  | err  | bad requests  |  req/s  | tok/s    | p50 ms  | p95 ms  | "
              "per replica | load avg 1/5/15 min before -> after")
    rows, failed = [], False
    with tempfile.TemporaryDirectory() as tmp:
        targets = [("url", None)] if args.url else [(f"{n} repl.", n) for n in args.replicas]
        quickstart = os.path.join(ROOT, "tune_configs", "quickstart.yaml")
        checkpoint = None if args.url else (args.checkpoint
                                            or untrained_checkpoint(quickstart, os.path.join(tmp, "tiny")))
        for label, replicas in targets:
            server = None
            try:
                if args.url:
                    base = re.sub(r"/(generate|v1/completions)/?$", "", args.url.rstrip("/"))
                else:
                    server = ServeProcess(checkpoint, "--num-replicas", str(replicas), "--num-cpus",
                                          str(args.num_cpus), "--max-samples", str(max(16, args.n)),
                                          *shlex.split(args.serve_args), cwd=ROOT)
                    base = server.base
                result = run_load(base, args, server.proc.pid if server else None)
            finally:
                if server:
                    server.stop()
            rows.append(report(label, result, args.route))
            print(rows[-1], flush=True)
            kill = result["kill"]
            if args.kill_replica_after is None:
                if result["first_failure"]:
                    failed = True
                    print(f"  first failure: {json.dumps(result['first_failure'])[:500]}", flush=True)
                if replicas and "replicas" not in args.serve_args and len(result["replicas"]) > replicas:
                    failed = True  # a replacement's tag: a replica was restarted during the run
                    print(f"  {len(result['replicas'])} replicas answered, {replicas} were started", flush=True)
            else:
                if result["failures_before_kill"] or result["bad_wrong"]:
                    failed = True
                    print(f"  first failure: {json.dumps(result['first_failure'])[:500]}", flush=True)
                if kill is None or kill["replacement_s"] is None:
                    failed = True
                    print("  THE KILLED REPLICA WAS NOT REPLACED within --recovery-timeout" if kill else
                          "  no replica was killed", flush=True)
                if kill:
                    span = (f", ending {kill['failed_from_s']:.2f}-{kill['failed_until_s']:.2f} s after the kill "
                            f"(statuses {kill['statuses']}; first: {json.dumps(kill['example'])[:200]})"
                            if kill["failed"] else "")
                    came = (f"{kill['replacement_s']:.1f} s" if kill["replacement_s"] is not None else "never")
                    line = (f"  replica kill at {kill['at_s']:.1f} s: {kill['failed']} good requests failed{span}; "
                            f"{kill['answered_after']} answered 200 after the kill; the replacement replica "
                            f"answered its first request {came} after the kill")
                    rows.append(line)
                    print(line, flush=True)
    print("\n" + header + "\n" + "\n".join(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
