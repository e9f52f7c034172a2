"""Load test of the policy server (`agents.serve`): concurrent clients, a fixed number of requests,
the one-request-at-a-time path and continuous batching side by side.

    .venv/bin/python benchmarks/serve_load.py [--replicas 1 2] [--batch-rows 0 16] [--clients 1 4 16 64]
        [--requests 200] [--route completions|generate] [--stream auto|on|off] [--max-tokens 20] [--n 1]
        [--bad-every K] [--checkpoint PATH | --url URL] [--num-cpus 0.5] [--serve-args "--max-queue 64"]
        [--kill-replica-after S [--recovery-timeout 180]] [--ingress proxy direct]

Servers. Without --url it starts `python -m agents.serve` once per pair of a --replicas value and a
--batch-rows value (`--num-replicas R --batch-rows B`, then --serve-args; a private Ray instance on
a free loopback port, each replica reserving --num-cpus CPUs), serving --checkpoint or, without
one, a tiny policy it builds itself: the quickstart's tiny GPT-2 (2 layers, 64 wide, vocabulary
52) with its random initial weights (what a request costs does not depend on training), its
env.max_new_tokens the quickstart's 20 or --max-tokens where that is more. Batch rows
0 is the one-request-at-a-time path, B > 0 continuous batching with B rows per replica; the
default `--batch-rows 0 16` measures both in one invocation. Per server it waits for it, sends
--warmup requests, then makes one timed run per --clients value (default 1 4 16 64), then stops
the server (SIGINT to its process group; SIGKILL if it has not stopped after 60 s). With --url it
sends to a running server (its /generate URL or the base URL) and starts nothing: --batch-rows,
--checkpoint, --serve-args and --kill-replica-after cannot be given with it (--replicas is
ignored), and its runs are labelled "external" (with the batch rows its GET /generate reports).
--serve-args must not set --batch-rows or --num-replicas (use this script's flags).

Ingress. `--ingress proxy` (the default) sends every request to the server's --port, Serve's
proxy, which spreads them over the replicas. `--ingress direct` starts the server with
`--direct-port` and sends to the replicas' own ports instead (Serve's direct ingress: no proxy
hop); with several replicas, client k talks to replica k mod R. Both values: each server once per
ingress, so the two are measured in one invocation. A kill (--kill-replica-after) goes with
`proxy` only: a direct port has no failover to measure.

Requests. Each of --clients threads keeps one HTTP/1.1 connection (http.client, loopback) and
takes the next request until --requests have been sent: POST /v1/completions (prompt "3 7 12",
max_tokens, n, seed = the request's number) or POST /generate (the same as max_new_tokens /
num_samples). A request may take --timeout seconds in all (a streamed one too), else it counts as
an error.

Streaming and time to first token (TTFT). `--stream auto` (the default) sends the completions
requests with `"stream": true, "stream_options": {"include_usage": true}` to a server that batches
(batch rows > 0; with --url: where its GET /generate reports batch_rows > 0) and without streaming
otherwise: a server started with --batch-rows 0 refuses `stream` (400), and it writes the whole
reply at once anyway. `--stream on` streams on every run (refused with a --batch-rows 0 server of
this script), `--stream off` never streams (the same request kind on both paths, for a throughput
comparison without the SSE framing); /generate never streams. A streamed reply is read as
server-sent events (`data: {json}` lines, OpenAI's text_completion chunks, then `data: [DONE]`):
its TTFT is the time from sending the request to the first chunk carrying a non-empty text (a
reply with no text at all: to its first chunk), its latency the time to `[DONE]`, its completion
tokens those of the final usage chunk; a 200 stream that ends without [DONE] or carries an error
event is an error. A reply that is not streamed has no earlier first token: its TTFT is its
latency (the table's `stream` column says `no`, and its TTFT figures equal the latency's).

Malformed requests. With --bad-every K every K-th request is a malformed one instead (a cycle of
bad bodies on both routes, never streamed); each must get a 4xx naming the field the body got
wrong, else it counts as a wrong answer: on /generate `{"error": "<field>: ..."}`, on the /v1/
routes either that or OpenAI's error object `{"error": {"message": "<field>: ...", "type", "param":
"<field>", "code"}}` (param null for "request body"), the message one line.

With --kill-replica-after S (a server this script starts), S seconds into each timed run it kills
one replica's process (SIGKILL to a `ray::ServeReplica` process below the server) and keeps
sending, past --requests if need be, until a request is answered by a replica that was not serving
before the kill (Serve's replacement) or --recovery-timeout passes. It then prints how many good
requests failed after the kill (and their statuses; "200 cut": a stream cut short), how long after
the kill the first and last of them ended, and how long until the replacement replica answered its
first request. Without a kill, a reply from more distinct replicas in one run than were started
means a replica was restarted, and counts as a failure.

Output, per run (a line as it ends, and a markdown table of all runs at the end): the server
(replicas, batch rows), whether it streamed, clients, requests sent, answered 200, errors (a good
request not answered 200 other than 429, or no answer, or a stream cut short), 429s (good requests
the server refused because a replica's queue was full: --max-queue; counted apart from errors),
bad requests answered as expected / wrongly, throughput (good requests answered 200 per second and
completion tokens/s: usage.completion_tokens of /v1/completions; /generate reports no token
counts), latency p50/p95 and TTFT p50/p95 of the good requests answered 200, how many each replica
answered (the X-Replica header) and the load average before and after (the machine may be shared:
read the figures next to it); on a batching server also its GET /generate `load` after the run (of
whichever replica answered it; counters since the server started). After the table, for each
replicas and clients value and each batch rows B > 0, the ratios of the batching run to the
one-at-a-time run (batch rows 0, same replicas and clients): req/s B / req/s 0 (above 1: more
throughput) and p95 latency B / p95 latency 0 (below 1: faster).

It never passes or fails on a figure; the exit status is 1 only if a request failed (an error; not
a 429; with a kill: before the kill), a bad one was answered wrongly, a replica restarted without a
kill, or a killed replica was not replaced in time.
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

from agents.serve.launch import ServeProcess, free_port, gives_flag, untrained_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "3 7 12"

# (route, body, the field its error must name); bytes are sent as they are
BAD = [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/generate", {"prompt": PROMPT, "num_samples": "two"}, "num_samples"),
    ("/v1/completions", {"prompt": 37}, "prompt"),
    ("/generate", b"{\"prompt\": ", "request body"),
    ("/v1/completions", {"prompt": PROMPT, "stream": "yes"}, "stream"),
    ("/generate", {"prompt": "three"}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": 5}, "temperature"),
    ("/generate", {"prompt": PROMPT, "max_tokens": 5}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "n": 10_000}, "n"),
]
NOT_PARAMS = ("request body",)  # fields OpenAI's error object names with param null


def good_request(args, i: int, stream: bool) -> tuple[str, dict]:
    if args.route == "completions":
        body = {"prompt": PROMPT, "max_tokens": args.max_tokens, "n": args.n, "seed": i}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return "/v1/completions", body
    return "/generate", {"prompt": PROMPT, "max_new_tokens": args.max_tokens, "num_samples": args.n, "seed": i}


def names_field(status, reply, field: str) -> bool:
    """A 4xx whose JSON is {"error": "<field>: ..."} or OpenAI's error object naming `field`."""
    if status is None or not 400 <= status < 500 or not isinstance(reply, dict) or set(reply) != {"error"}:
        return False
    error = reply["error"]
    if isinstance(error, dict):
        params = (None, field) if field in NOT_PARAMS else (field,)
        if set(error) != {"message", "type", "param", "code"} or error["param"] not in params:
            return False
        error = error["message"]
    return isinstance(error, str) and error.startswith(f"{field}:") and "\n" not in error


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


def connect(base: str, timeout: float) -> http.client.HTTPConnection:
    url = urllib.parse.urlsplit(base)
    return http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)


def send(conn, prefix: str, route: str, body, timeout: float) -> dict:
    """POSTs `body`; reads a JSON reply, or a streamed one (server-sent events) to its end.
    The answer: status, reply (JSON; a streamed one's last chunk, or its error), replica, first
    (perf_counter of the first text chunk; None), end (of the reply, or of [DONE]), tokens
    (usage.completion_tokens, 0 where none), complete (False: a stream cut short or with an error),
    broken (the connection cannot be reused). Raises OSError / HTTPException when no answer came."""
    start = time.perf_counter()
    deadline = start + timeout
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", prefix + route, body=data, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    out = {"status": response.status, "replica": response.getheader("X-Replica"), "first": None, "tokens": 0,
           "complete": True, "broken": False}
    if not (response.getheader("Content-Type") or "").startswith("text/event-stream"):
        raw = response.read()
        out["end"] = time.perf_counter()
        try:
            out["reply"] = json.loads(raw or b"null")
        except json.JSONDecodeError:  # e.g. the proxy's plain-text 500 when a replica dies mid-request
            out["reply"] = {"error": f"not JSON: {raw[:200].decode(errors='replace')}"}
        usage = out["reply"].get("usage") if isinstance(out["reply"], dict) else None
        out["tokens"] = usage["completion_tokens"] if isinstance(usage, dict) else 0
        return out
    first_chunk, done, reply, error = None, None, None, None
    try:
        while True:
            line = response.readline()
            if not line:
                break
            if time.perf_counter() > deadline:
                raise TimeoutError(f"stream still open after {timeout:g} s")
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = time.perf_counter()
                continue
            try:
                chunk = json.loads(payload)
            except json.JSONDecodeError:
                error = {"error": f"event not JSON: {payload[:200].decode(errors='replace')}"}
                continue
            now = time.perf_counter()
            if "error" in chunk:
                error = chunk
                continue
            reply = chunk
            first_chunk = first_chunk or now
            if out["first"] is None and any(c.get("text") for c in chunk.get("choices") or []):
                out["first"] = now
            if isinstance(chunk.get("usage"), dict):
                out["tokens"] = chunk["usage"]["completion_tokens"]
    except (OSError, http.client.HTTPException) as e:  # cut off mid-stream (a replica died, the timeout)
        error = {"error": f"stream cut: {type(e).__name__}: {e}"}
        out["broken"] = True
    out["first"] = out["first"] or first_chunk
    out["end"] = done or time.perf_counter()
    if done is None and error is None:
        error = {"error": "stream ended before [DONE]"}
    out["complete"] = error is None
    out["reply"] = error or reply
    return out


def warm_up(base: str, args, stream: bool) -> None:
    """--warmup untimed requests, one at a time; RuntimeError if one is not answered 200."""
    prefix = urllib.parse.urlsplit(base).path.rstrip("/")
    conn = connect(base, args.timeout)
    for i in range(args.warmup):
        route, body = good_request(args, 10**6 + i, stream)
        answer = send(conn, prefix, route, body, args.timeout)
        if answer["status"] != 200 or not answer["complete"]:
            raise RuntimeError(f"warm-up request answered {answer['status']}: {answer['reply']}")
    conn.close()


def describe(base: str, timeout: float) -> dict | None:
    """The server's GET /generate (its limits, batch_rows and load), or None."""
    conn = connect(base, timeout)
    try:
        conn.request("GET", urllib.parse.urlsplit(base).path.rstrip("/") + "/generate")
        response = conn.getresponse()
        raw = response.read()
        return json.loads(raw) if response.status == 200 else None
    except (OSError, http.client.HTTPException, json.JSONDecodeError):
        return None
    finally:
        conn.close()


def run_load(base: str | list[str], args, clients: int, stream: bool, server_pid: int | None = None) -> dict:
    """Sends --requests requests from `clients` threads (with --kill-replica-after, kills a
    replica of the server `server_pid` on the way); the figures of the run. With several base
    URLs (the replicas' own ports), client k sends to the k-th of them (round robin)."""
    bases = [base] if isinstance(base, str) else base
    url = urllib.parse.urlsplit(bases[0])
    prefix = url.path.rstrip("/")
    counter, lock = iter(range(10**9)), threading.Lock()
    records: list[dict] = []
    kill: dict = {}  # at (s into the timed part), pid, replicas (that answered before it)

    def client(numbers, base):
        conn = connect(base, args.timeout)
        for i in numbers:
            bad = args.bad_every and (i + 1) % args.bad_every == 0
            route, body, field = (BAD[(i // args.bad_every) % len(BAD)] if bad
                                  else (*good_request(args, i, stream), None))
            start = time.perf_counter()
            try:
                answer = send(conn, prefix, route, body, args.timeout)
            except (OSError, http.client.HTTPException) as e:
                answer = {"status": None, "reply": {"error": f"{type(e).__name__}: {e}"}, "replica": None,
                          "first": None, "end": time.perf_counter(), "tokens": 0, "complete": False, "broken": True}
            if answer["broken"]:
                conn.close()
                conn = connect(base, args.timeout)
            end = answer["end"]
            record = {"bad": bool(bad), "status": answer["status"], "seconds": end - start,
                      "ttft": (answer["first"] or end) - start, "replica": answer["replica"],
                      "reply": answer["reply"], "start": start - t0, "end": end - t0, "cut": not answer["complete"]}
            if bad:
                record["ok"] = names_field(answer["status"], answer["reply"], field)
            else:
                record["ok"] = answer["status"] == 200 and answer["complete"]
                record["tokens"] = answer["tokens"] if record["ok"] else 0
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

    load_before = os.getloadavg()
    threads = [threading.Thread(target=client, args=(numbers(), bases[k % len(bases)])) for k in range(clients)]
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
    answered = [r for r in good if r["ok"]]
    refused = [r for r in good if r["status"] == 429]

    def quantile(key, q):
        values = sorted(r[key] for r in answered)
        return 1000 * values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    bad = [r for r in records if r["bad"]]
    failures = [r for r in records if not r["ok"] and not (not r["bad"] and r["status"] == 429)]
    result = {
        "requests": len(records), "wall_s": wall, "ok": len(answered), "refused": len(refused),
        "errors": len(good) - len(answered) - len(refused),
        "bad_ok": sum(r["ok"] for r in bad), "bad_wrong": len(bad) - sum(r["ok"] for r in bad),
        "req_per_s": len(answered) / wall, "tokens_per_s": sum(r.get("tokens", 0) for r in good) / wall,
        "p50_ms": quantile("seconds", 0.50), "p95_ms": quantile("seconds", 0.95),
        "ttft_p50_ms": quantile("ttft", 0.50), "ttft_p95_ms": quantile("ttft", 0.95),
        "replicas": dict(collections.Counter(r["replica"] for r in answered if r["replica"])),
        "load_before": load_before, "load_after": load_after,
        "first_failure": failures[0] if failures else None,
        "first_refused": refused[0] if refused else None,
        "failures_before_kill": len([r for r in failures if not kill or r["end"] < kill["at"]]),
        "kill": None,
    }
    if kill:
        after = [r for r in good if not r["ok"] and r["status"] != 429 and r["end"] >= kill["at"]]
        new = [r for r in answered if r["replica"] not in kill["replicas"] and r["start"] >= kill["at"]]
        result["kill"] = {
            "at_s": kill["at"], "pid": kill["pid"], "failed": len(after),
            "answered_after": sum(r["ok"] for r in good if r["end"] >= kill["at"]),
            "statuses": dict(collections.Counter(f"{r['status']}{' cut' if r['status'] == 200 else ''}"
                                                 for r in after)),
            "failed_from_s": min((r["end"] - kill["at"] for r in after), default=None),
            "failed_until_s": max((r["end"] - kill["at"] for r in after), default=None),
            "replacement_s": min((r["end"] - kill["at"] for r in new), default=None),
            "example": after[0]["reply"] if after else None,
        }
    return result


COLUMNS = ("server", "stream", "clients", "sent", "200", "err", "429", "bad ok", "bad wrong", "req/s", "tok/s",
           "p50 ms", "p95 ms", "TTFT p50 ms", "TTFT p95 ms", "per replica", "load avg 1/5/15 before -> after")


def row(label: str, stream: bool, clients: int, r: dict, route: str) -> str:
    tokens = f"{r['tokens_per_s']:.0f}" if route == "completions" else "-"
    load = "/".join(f"{x:.2f}" for x in r["load_before"]) + " -> " + "/".join(f"{x:.2f}" for x in r["load_after"])
    cells = (label, "yes" if stream else "no", clients, r["requests"], r["ok"], r["errors"], r["refused"],
             r["bad_ok"], r["bad_wrong"], f"{r['req_per_s']:.1f}", tokens, f"{r['p50_ms']:.1f}",
             f"{r['p95_ms']:.1f}", f"{r['ttft_p50_ms']:.1f}", f"{r['ttft_p95_ms']:.1f}",
             ", ".join(str(v) for v in sorted(r["replicas"].values(), reverse=True)) or "-", load)
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(columns, rows: list[str]) -> str:
    return "\n".join(["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *rows])


def ratios(runs: list[dict]) -> list[str]:
    """Per replicas, ingress and clients value and batch rows B > 0: req/s and p95 latency of B over 0."""
    base = {(r["replicas"], r["ingress"], r["clients"]): r["result"] for r in runs if r["batch_rows"] == 0}
    out = []
    for r in runs:
        zero = base.get((r["replicas"], r["ingress"], r["clients"]))
        if not r["batch_rows"] or zero is None:
            continue
        rps = r["result"]["req_per_s"] / zero["req_per_s"] if zero["req_per_s"] else float("nan")
        p95 = r["result"]["p95_ms"] / zero["p95_ms"] if zero["p95_ms"] else float("nan")
        out.append(f"| {r['replicas']} | {r['ingress']} | {r['batch_rows']} vs 0 | {r['clients']} | {rps:.2f} "
                   f"| {p95:.2f} |")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2],
                        help="servers with this many replicas, one per value (default 1 2)")
    parser.add_argument("--batch-rows", type=int, nargs="+", default=None,
                        help="servers with agents.serve --batch-rows B, one per value per --replicas value "
                             "(0: one request at a time; default 0 16); not with --url")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64],
                        help="concurrent client threads: one timed run per value on each server (default 1 4 16 64)")
    parser.add_argument("--requests", type=int, default=200, help="timed requests per run (default 200)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed requests per server first (default 4)")
    parser.add_argument("--route", choices=("completions", "generate"), default="completions")
    parser.add_argument("--stream", choices=("auto", "on", "off"), default="auto",
                        help="stream /v1/completions replies (SSE; TTFT measured): auto (default): where the "
                             "server batches; on: always; off: never (TTFT = latency)")
    parser.add_argument("--max-tokens", type=int, default=20, help="new tokens per completion (default 20)")
    parser.add_argument("--n", type=int, default=1, help="completions per request (default 1)")
    parser.add_argument("--bad-every", type=int, default=0, help="every K-th request is malformed (default: none)")
    parser.add_argument("--checkpoint", help="checkpoint to serve (default: a tiny policy built here)")
    parser.add_argument("--url", help="send to this running server instead of starting one")
    parser.add_argument("--num-cpus", type=float, default=0.5, help="CPUs each replica reserves (default 0.5)")
    parser.add_argument("--serve-args", default="", help="more agents.serve flags, e.g. \"--max-queue 64\"")
    parser.add_argument("--timeout", type=float, default=120,
                        help="seconds a request may take, a streamed one to its end (default 120)")
    parser.add_argument("--kill-replica-after", type=float, default=None, metavar="S",
                        help="kill one replica's process S seconds into each timed run (default: no kill)")
    parser.add_argument("--ingress", choices=("proxy", "direct"), nargs="+", default=["proxy"],
                        help="send to Serve's proxy (--port; default) or to the replicas' own ports "
                             "(agents.serve --direct-port); both: each server once per value")
    parser.add_argument("--recovery-timeout", type=float, default=180,
                        help="with a kill: seconds to keep sending for the replacement replica (default 180)")
    args = parser.parse_args(argv)
    for flag in ("requests", "max_tokens", "n"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if min(args.clients) < 1:
        parser.error("--clients must be >= 1")
    if args.bad_every < 0 or args.warmup < 0 or min(args.replicas) < 1:
        parser.error("--bad-every and --warmup must be >= 0, --replicas >= 1")
    if not args.timeout > 0:
        parser.error("--timeout must be > 0")
    args.ingress = list(dict.fromkeys(args.ingress))  # each way in once
    if args.kill_replica_after is not None and "direct" in args.ingress:
        parser.error("--kill-replica-after measures Serve's failover through its proxy: give --ingress proxy")
    if args.url:
        if args.ingress != ["proxy"]:
            parser.error("--url sends to a running server; --ingress is for servers this script starts")
        given = [flag for flag, value in (("--batch-rows", args.batch_rows), ("--checkpoint", args.checkpoint),
                                          ("--serve-args", args.serve_args),
                                          ("--kill-replica-after", args.kill_replica_after)) if value]
        if args.kill_replica_after is not None and "--kill-replica-after" not in given:
            given.append("--kill-replica-after")
        if given:
            parser.error(f"--url sends to a running server; {', '.join(given)} "
                         f"{'is' if len(given) == 1 else 'are'} for servers this script starts")
    else:
        args.batch_rows = [0, 16] if args.batch_rows is None else args.batch_rows
        if min(args.batch_rows) < 0:
            parser.error("--batch-rows must be >= 0 (0: one request at a time)")
        served = shlex.split(args.serve_args)
        for flag, ours in (("--batch-rows", "--batch-rows"), ("--num-replicas", "--replicas"),
                           ("--direct-port", "--ingress direct")):
            if gives_flag(served, flag):
                parser.error(f"--serve-args must not set {flag}: give this script's {ours} instead")
    if args.kill_replica_after is not None and args.kill_replica_after < 0:
        parser.error("--kill-replica-after S needs S >= 0")
    if args.stream == "on" and args.route != "completions":
        parser.error("--stream on: /generate does not stream (use --route completions)")
    if args.stream == "on" and not args.url and 0 in args.batch_rows:
        parser.error("--stream on: a server with --batch-rows 0 refuses stream (use --stream auto or off)")

    print(f"route /{'v1/completions' if args.route == 'completions' else 'generate'}, clients "
          f"{' '.join(map(str, args.clients))}, {args.requests} requests per run, {args.max_tokens} new tokens x "
          f"{args.n}, stream {args.stream}, bad every {args.bad_every or '-'}; {os.cpu_count()} CPU cores", flush=True)
    print("TTFT: time to the first text chunk of a streamed reply; of a reply not streamed (stream no): "
          "its latency\n" + table(COLUMNS, []), flush=True)
    rows, runs, notes, failed = [], [], [], False
    with tempfile.TemporaryDirectory() as tmp:
        if args.url:
            targets = [(None, None, "proxy")]
        else:
            targets = [(n, b, i) for n in args.replicas for i in args.ingress for b in args.batch_rows]
        quickstart = os.path.join(ROOT, "tune_configs", "quickstart.yaml")
        # the tiny policy's env.max_new_tokens: the quickstart's 20, or --max-tokens where that is more
        checkpoint = None if args.url else (args.checkpoint or untrained_checkpoint(
            quickstart, os.path.join(tmp, "tiny"), [f"env.max_new_tokens={max(20, args.max_tokens)}"]))
        for replicas, batch_rows, ingress in targets:
            server = None
            try:
                if args.url:
                    base = re.sub(r"/(generate|v1/completions)/?$", "", args.url.rstrip("/"))
                    info = describe(base, args.timeout) or {}
                    batch_rows = info.get("batch_rows")
                    label = "external" + (f", {batch_rows} rows" if batch_rows is not None else "")
                else:
                    direct = ("--direct-port", str(free_port(2 * replicas))) if ingress == "direct" else ()
                    server = ServeProcess(checkpoint, "--num-replicas", str(replicas), "--batch-rows", str(batch_rows),
                                          "--num-cpus", str(args.num_cpus), "--max-samples", str(max(16, args.n)),
                                          *direct, *shlex.split(args.serve_args), cwd=ROOT)
                    base = server.base
                    label = f"{replicas} repl., {batch_rows} rows" + (", direct" if direct else "")
                    if direct and len(server.direct) != replicas:
                        raise RuntimeError(f"{len(server.direct)} of {replicas} replicas' own ports answered:\n"
                                           f"{server.output()}")
                stream = args.route == "completions" and (args.stream == "on"
                                                          or (args.stream == "auto" and bool(batch_rows)))
                sent_to = server.direct if server and server.direct else [base]
                for url in sent_to:
                    warm_up(url, args, stream)
                for clients in args.clients:
                    result = run_load(sent_to, args, clients, stream, server.proc.pid if server else None)
                    runs.append({"replicas": replicas, "batch_rows": batch_rows, "ingress": ingress,
                                 "clients": clients, "result": result})
                    rows.append(row(label, stream, clients, result, args.route))
                    print(rows[-1], flush=True)
                    if batch_rows:
                        load = (describe(base, args.timeout) or {}).get("load")
                        if load:
                            print(f"  server load (one replica, since its start): "
                                  f"{', '.join(f'{k} {v}' for k, v in load.items())}", flush=True)
                    run = f"{label}, {clients} clients"
                    kill = result["kill"]
                    if result["refused"]:
                        print(f"  {result['refused']} requests refused with 429 (a replica's queue was full); first: "
                              f"{json.dumps(result['first_refused']['reply'])[:300]}", flush=True)
                    if args.kill_replica_after is None:
                        if result["first_failure"]:
                            failed = True
                            print(f"  first failure: {json.dumps(result['first_failure'])[:500]}", flush=True)
                        if (replicas and "replicas" not in args.serve_args
                                and len(result["replicas"]) > replicas):
                            failed = True  # a replacement's tag: a replica was restarted during the run
                            notes.append(f"{run}: {len(result['replicas'])} replicas answered, {replicas} were "
                                         f"started")
                            print(f"  {notes[-1]}", flush=True)
                    else:
                        if result["failures_before_kill"] or result["bad_wrong"]:
                            failed = True
                            print(f"  first failure: {json.dumps(result['first_failure'])[:500]}", flush=True)
                        if kill is None or kill["replacement_s"] is None:
                            failed = True
                            notes.append(f"{run}: " + ("THE KILLED REPLICA WAS NOT REPLACED within "
                                                       "--recovery-timeout" if kill else "no replica was killed"))
                            print(f"  {notes[-1]}", flush=True)
                        if kill:
                            span = (f", ending {kill['failed_from_s']:.2f}-{kill['failed_until_s']:.2f} s after "
                                    f"the kill (statuses {kill['statuses']}; first: "
                                    f"{json.dumps(kill['example'])[:200]})" if kill["failed"] else "")
                            came = (f"{kill['replacement_s']:.1f} s" if kill["replacement_s"] is not None
                                    else "never")
                            notes.append(f"{run}: replica kill at {kill['at_s']:.1f} s: {kill['failed']} good "
                                         f"requests failed{span}; {kill['answered_after']} answered 200 after the "
                                         f"kill; the replacement replica answered its first request {came} after "
                                         f"the kill")
                            print(f"  {notes[-1]}", flush=True)
            finally:
                if server:
                    server.stop()
    print("\n" + table(COLUMNS, rows))
    if notes:
        print("\n" + "\n".join(f"- {note}" for note in notes))
    compared = ratios(runs)
    if compared:
        print("\nbatching vs one request at a time (same replicas, ingress and clients): req/s ratio (above 1: "
              "more throughput), p95 latency ratio (below 1: faster)\n"
              + table(("replicas", "ingress", "batch rows", "clients", "req/s ratio", "p95 ratio"), compared))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
