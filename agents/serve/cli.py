"""The policy server's command line: `python -m agents.serve` (and `tokenmdp serve`) starts
Ray and Serve, deploys the application (`agents.serve.application.make_app`) and serves until stopped.

    python -m agents.serve --checkpoint PATH [--host 127.0.0.1] [--port 8000] [--route-prefix /]
                           [--num-replicas 1] [--num-cpus 0.5] [--max-samples 16] [--dashboard-port N]
                           [--min-replicas N --max-replicas M [--target-ongoing-requests T]]
                           [--direct-port P]

Replicas: `--num-replicas N` runs N replicas (default 1). `--max-replicas M`
turns on Serve's autoscaling between `--min-replicas` (default 1; 0 scales
to zero when idle) and M, aiming at `--target-ongoing-requests` requests per
replica (default `--batch-rows`; 2 with `--batch-rows 0`, at most the 8 such a
replica takes at a time); `--num-replicas`
is then the number to start with (within [min, max]; default min, or 1 if
min is 0). Serve's other autoscaling settings keep their defaults (it scales
up after 30 s above the target and down after 600 s below it).

The CLI prints the URLs it serves at and runs until Ctrl-C (or SIGTERM), then
shuts Serve and its Ray instance down (killed with SIGKILL, a watcher process stops
what Ray leaves running: agents/reaper.py). Without RAY_ADDRESS it starts a private
local Ray instance (never one that `ray start` left running) without the
dashboard (`--dashboard-port N` turns it on at port N); with RAY_ADDRESS it
deploys the application to that cluster and on exit deletes only this
application. Each replica reserves `--num-cpus` CPUs (fractions are fine), the
Serve controller and HTTP proxy none; on a local instance, replicas to start
that need more CPUs than it has are refused before deploying.

Direct ports: `--direct-port P` has each replica serve the same routes itself on its own
port as well, P, P+1, ... (one per replica, printed when they answer), through
Serve's direct ingress: the request goes straight to the replica's HTTP server, with no hop
through Serve's proxy and no Ray call per request for its body. That is the fast path for a
client that talks to one replica (on 2 CPU cores, a 16-row batching replica answered 1.4-1.7x
the req/s it answered through the proxy with 16 clients: docs/results/serving.md), or for a
load balancer of the user's own in front of the replicas. `--port` stays the load-balanced
front door: it spreads requests over the replicas and routes around a replica that died, which a direct port cannot: a killed replica's port refuses
connections, and Serve's replacement comes up on another port of the range held for them,
P to P + 2R - 1 for R replicas (R = --max-replicas with autoscaling), a freed port resting 150 s
(Serve's quarantine) before it is handed out again. The range must stay clear of Ray's worker
ports (10002-19999). Local Ray only: these ports are set when the private Ray instance starts.

Ports: Serve's HTTP proxy listens on `--port` and the dashboard on
`--dashboard-port`; both are checked before Ray starts (an address in use is a
one-line error, exit 2), and Ray does not move an explicitly given dashboard
port, so two servers on one machine need different values of each. Ray picks
its other ports itself (GCS, raylet, agents: free ones), and Serve's gRPC
proxy is off. The dashboard's own metrics endpoint (44227, env
DASHBOARD_METRIC_PORT) can collide between two dashboards; that only costs the
second one its metrics.
"""
from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import sys
import time

# The flags, the ports and the checkpoint are checked with these alone (the standard library):
# Ray, Serve, torch and the application are imported once they pass, so bad input is refused at once.
from agents.saved_policy import PRECISIONS, check_whole, find_module_dir
from agents.serve.options import BATCH_BLOCK, BATCH_ROWS, MAX_QUEUE, max_ongoing_requests, replica_options

APP_NAME = "policy"
SERVE_PROXY_GRPC = "RAY_SERVE_PROXY_USE_GRPC"  # read by Serve's proxy: gRPC to the replicas ("1")
RAY_WORKER_PORTS = (10002, 19999)  # ray.init's default min_worker_port and max_worker_port


def direct_ingress_env(first_port: int, ports: int) -> dict:
    """The environment Serve reads (in its controller and replicas, when they start) to have each
    ingress replica serve HTTP itself on one of `ports` ports from `first_port` on (Serve hands
    out the lowest free one). A replica's freed port keeps Serve's quarantine (150 s) before it is
    handed out again: Serve binds without SO_REUSEADDR, so the port's connections in TCP's
    TIME_WAIT (60 s) would make a replacement's bind fail, and Serve would then block the port
    for good; a replacement takes a spare port of the range instead. A replica stopping drains
    for no minimum time (Serve's default waits 30 s for an outside load balancer)."""
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(first_port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(first_port + ports),  # exclusive
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}


def listening_ports(host: str, ports, want: int, timeout: float) -> list[int]:
    """Those of `ports` that accept a TCP connection on `host`, waiting up to `timeout` seconds
    for `want` of them (a replica starts its own server as it finishes starting)."""
    deadline = time.time() + timeout
    while True:
        found = []
        for port in ports:
            try:
                socket.create_connection((host, port), timeout=1).close()
                found.append(port)
            except OSError:
                pass
        if len(found) >= want or time.time() > deadline:
            return found
        time.sleep(0.2)


def _root_cause(e: BaseException) -> str:
    """The innermost error behind `e` as one line: a Ray task's error carries the actor's traceback,
    whose last line names what went wrong."""
    while getattr(e, "cause", None) is not None and e.cause is not e:
        e = e.cause
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    last = lines[-1] if lines else type(e).__name__
    return last if len(lines) > 1 or last.startswith(type(e).__name__) else f"{type(e).__name__}: {last}"


def _deployment_error(default: str) -> str:
    """The replicas' own error behind Serve's "Deploying application ... failed": the last line of
    a failed deployment's status message (a replica's traceback), else `default`."""
    try:
        from ray import serve

        for app in serve.status().applications.values():
            for deployment in app.deployments.values():
                lines = [line.strip() for line in (deployment.message or "").splitlines() if line.strip()]
                if lines and deployment.status.value in ("DEPLOY_FAILED", "UNHEALTHY"):
                    return lines[-1]
    except Exception:  # Serve itself is gone: the error as it came
        pass
    return default


def _check_port_free(flag: str, host: str, port: int, reuse_address: bool = True) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        if reuse_address:  # as uvicorn and aiohttp do (Serve's direct ingress binds without it)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except socket.gaierror as e:  # the address, not the port: no such host or interface
            raise ValueError(f"--host: cannot listen on {host} ({e.strerror or e})") from None
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                raise ValueError(f"--host: {host} is not an address of this machine ({e.strerror})") from None
            raise ValueError(f"{flag}: cannot listen on {host}:{port} ({e.strerror or e})") from None


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None, prog: str = "python -m agents.serve") -> int:
    import agents.serve

    parser = argparse.ArgumentParser(prog=prog, description=agents.serve.__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory from agents.train")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    parser.add_argument("--route-prefix", default="/",
                        help="URL prefix of the routes (default /: /generate, /v1/completions, /docs)")
    parser.add_argument("--num-replicas", type=int, default=None,
                        help="replicas, each with its own copy (default 1); with --max-replicas, "
                             "the replicas to start with")
    parser.add_argument("--min-replicas", type=int, default=None,
                        help="autoscaling: fewest replicas (default 1; 0 scales to zero); needs --max-replicas")
    parser.add_argument("--max-replicas", type=int, default=None,
                        help="autoscaling: most replicas; turns autoscaling on")
    parser.add_argument("--target-ongoing-requests", type=float, default=None,
                        help="autoscaling: requests per replica to aim at (default: --batch-rows; 2 with "
                             "--batch-rows 0); needs --max-replicas")
    parser.add_argument("--num-cpus", type=float, default=0.5, help="CPUs each replica reserves (default 0.5)")
    parser.add_argument("--num-gpus", type=float, default=0,
                        help="GPUs each replica reserves and generates on (default 0: the CPU; fractions such "
                             "as 0.5 share one GPU between replicas)")
    parser.add_argument("--max-samples", type=int, default=16,
                        help="most generations per request (num_samples; n x prompts) (default 16)")
    parser.add_argument("--batch-rows", type=int, default=BATCH_ROWS,
                        help=f"rows each replica generates together (continuous batching; default {BATCH_ROWS}); "
                             f"0: one request at a time")
    parser.add_argument("--batch-block", type=int, default=BATCH_BLOCK,
                        help=f"decode steps a batch takes per block (default {BATCH_BLOCK}): rows join, stream and "
                             f"cancel between blocks; 1: every token")
    parser.add_argument("--precision", default="fp32",
                        help="each replica's weights while it decodes: fp32 (default) or bf16 (less memory, faster "
                             "steps on a GPU; texts can differ from fp32's)")
    parser.add_argument("--max-queue", type=int, default=MAX_QUEUE,
                        help=f"completions that may wait for a row in a replica before a request gets 429 "
                             f"(default {MAX_QUEUE})")
    parser.add_argument("--direct-port", type=int, default=None,
                        help="each replica also serves the routes itself on its own port, from this one up "
                             "(Serve's direct ingress: no proxy hop; no load balancing or failover there)")
    parser.add_argument("--dashboard-port", type=int, default=None,
                        help="start the Ray dashboard on this port (local Ray only; default: no dashboard)")
    args = parser.parse_args(argv)
    if not 1 <= args.port <= 65535:
        parser.error("--port must be in [1, 65535]")
    if not args.route_prefix.startswith("/"):
        parser.error("--route-prefix must start with '/'")
    if args.batch_rows < 0:
        parser.error(f"--batch-rows must be >= 0 (0: one request at a time), got {args.batch_rows}")
    if args.precision not in PRECISIONS:
        parser.error(f"--precision: expected one of {', '.join(PRECISIONS)}, got {args.precision!r}")
    if args.batch_block < 1:
        parser.error(f"--batch-block must be >= 1, got {args.batch_block}")
    if args.max_queue < 0:
        parser.error(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.batch_rows and args.max_samples > args.batch_rows + args.max_queue:
        parser.error(f"--max-queue {args.max_queue}: a request of --max-samples {args.max_samples} completions "
                     f"would never fit in {args.batch_rows} rows and the queue; raise --max-queue or lower "
                     f"--max-samples")
    try:
        replicas = replica_options(args.num_replicas, args.min_replicas, args.max_replicas,
                                   args.target_ongoing_requests,
                                   max_ongoing=max_ongoing_requests(args.batch_rows, args.max_queue),
                                   default_target=float(args.batch_rows or 2))
    except ValueError as e:
        parser.error(str(e))
    if not args.num_cpus > 0:
        parser.error("--num-cpus must be > 0 (fractions such as 0.25 are fine)")
    if args.num_gpus < 0 or (args.num_gpus > 1 and not float(args.num_gpus).is_integer()):
        parser.error(f"--num-gpus must be a fraction in [0, 1] or a whole number, got {args.num_gpus:g}")
    if args.max_samples < 1:
        parser.error("--max-samples must be >= 1")
    if args.dashboard_port is not None and not 1 <= args.dashboard_port <= 65535:
        parser.error("--dashboard-port must be in [1, 65535]")
    autoscaling = replicas.get("autoscaling_config")
    start = autoscaling["initial_replicas"] if autoscaling else replicas["num_replicas"]
    direct_ports = []
    if args.direct_port is not None:
        # two ports per replica: a replacement starts on a spare one while its predecessor's rests
        direct_ports = list(range(args.direct_port, args.direct_port + 2 * (
            autoscaling["max_replicas"] if autoscaling else start)))
        held = f"ports {args.direct_port}-{direct_ports[-1]} (two per replica, for replacements)"
        if not (1 <= args.direct_port and direct_ports[-1] <= 65535):
            parser.error(f"--direct-port: {held} must be in [1, 65535]")
        if args.port in direct_ports or args.dashboard_port in direct_ports:
            parser.error(f"--direct-port: {held} overlap --port or --dashboard-port")
        if direct_ports[0] <= RAY_WORKER_PORTS[1] and direct_ports[-1] >= RAY_WORKER_PORTS[0]:
            parser.error(f"--direct-port: {held} overlap Ray's worker ports "
                         f"({RAY_WORKER_PORTS[0]}-{RAY_WORKER_PORTS[1]}); pick ports outside them")
        if os.environ.get("RAY_ADDRESS"):
            parser.error("--direct-port needs the private local Ray instance (without RAY_ADDRESS): Serve reads "
                         "its direct ports when Ray starts; on a cluster, start Ray with "
                         "RAY_SERVE_ENABLE_DIRECT_INGRESS=1 instead")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    prefix = args.route_prefix.rstrip("/")

    external = bool(os.environ.get("RAY_ADDRESS"))
    try:
        check_whole(find_module_dir(args.checkpoint))  # before Ray starts: a damaged one fails in every replica
        if not external:  # Serve's proxy and the dashboard would fail later, deep inside Ray
            _check_port_free("--port", args.host, args.port)
            if args.dashboard_port is not None:
                _check_port_free("--dashboard-port", "127.0.0.1", args.dashboard_port)
            for port in direct_ports:
                _check_port_free("--direct-port", args.host, port, reuse_address=False)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    checkpoint = os.path.abspath(os.path.expanduser(args.checkpoint))

    import ray
    from ray import serve
    from ray._private import worker as ray_worker

    from agents.serve.application import make_app

    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    started = False
    try:
        if external:
            ray.init(logging_level="ERROR", log_to_driver=False)
        else:
            # A private local instance (address="local": never one a `ray start` left running);
            # replicas import the installed package.
            dashboard = {"include_dashboard": args.dashboard_port is not None}
            if args.dashboard_port is not None:
                dashboard["dashboard_port"] = args.dashboard_port
            from agents.reaper import watch_this_process

            watch_this_process()  # stops this instance's processes should this one be killed
            # Serve's proxy sends requests to the replicas over gRPC rather than as Ray actor
            # calls: fewer calls and less serialization per request in the replica, which shares
            # its CPU with the batch (docs/results/serving.md). The private instance's processes
            # inherit this environment; a user's own setting wins.
            os.environ.setdefault(SERVE_PROXY_GRPC, "1")
            # Serve's proxy binds its port with SO_REUSEPORT by default: a second server given the
            # same port would share it silently instead of failing (the check above runs earlier)
            os.environ.setdefault("SERVE_SOCKET_REUSE_PORT_ENABLED", "0")
            if direct_ports:
                os.environ.update(direct_ingress_env(direct_ports[0], len(direct_ports)))
            context = ray.init(address="local", logging_level="ERROR", log_to_driver=False,
                               runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}}, **dashboard)
            if context.dashboard_url:
                print(f"Ray dashboard: http://{context.dashboard_url}", flush=True)
            cpus = ray.cluster_resources().get("CPU", 0)
            if start * args.num_cpus > cpus + 1e-9:  # Serve would wait forever for the replicas
                print(f"error: --num-replicas: {start} replicas x --num-cpus {args.num_cpus:g} need "
                      f"{start * args.num_cpus:g} CPUs; this machine's Ray instance has {cpus:g}", file=sys.stderr)
                return 2
            gpus = ray.cluster_resources().get("GPU", 0)
            if start * args.num_gpus > gpus + 1e-9:  # as for CPUs: Serve would wait forever
                print(f"error: --num-gpus: {start} replicas x --num-gpus {args.num_gpus:g} need "
                      f"{start * args.num_gpus:g} GPUs; this machine's Ray instance has {gpus:g}", file=sys.stderr)
                return 2
            if autoscaling and autoscaling["max_replicas"] * args.num_cpus > cpus + 1e-9:
                print(f"note: --max-replicas {autoscaling['max_replicas']} x --num-cpus {args.num_cpus:g} is more "
                      f"than the {cpus:g} CPUs here; autoscaling stops at {int(cpus // args.num_cpus)} replicas",
                      flush=True)
        # After ray.init, which installs its own SIGTERM handler: Ctrl-C and SIGTERM both stop
        # the server cleanly (also when started from a shell that ignores SIGINT in background jobs).
        signal.signal(signal.SIGINT, _interrupt)
        signal.signal(signal.SIGTERM, _interrupt)
        serve.start(proxy_location="HeadOnly", http_options={"host": args.host, "port": args.port})
        started = True
        application = make_app(checkpoint, num_cpus=args.num_cpus, max_samples=args.max_samples, replicas=replicas,
                               batch_rows=args.batch_rows, max_queue=args.max_queue, num_gpus=args.num_gpus,
                               batch_block=args.batch_block, precision=args.precision)
        serve.run(application, name=APP_NAME, route_prefix=prefix or "/", logging_config={"log_level": "WARNING"})
        base = f"http://{args.host}:{args.port}{prefix}"
        print(f"Serving {checkpoint} at {base}/generate (Ctrl-C to stop)", flush=True)
        scaling = (f"autoscaling {autoscaling['min_replicas']}-{autoscaling['max_replicas']} replicas "
                   f"(started {start}, target {autoscaling['target_ongoing_requests']:g} ongoing requests each)"
                   if autoscaling else f"{start} replica{'s' if start > 1 else ''}")
        batching = (f"{args.batch_rows} rows batched per replica" if args.batch_rows
                    else "one request at a time per replica")
        print(f"  OpenAI completions: {base}/v1/completions (chat: {base}/v1/chat/completions); "
              f"API docs: {base}/docs; {scaling}; {batching}", flush=True)
        if direct_ports:
            up = listening_ports(args.host, direct_ports, want=start, timeout=60) if start else []
            print("  replicas' own ports (no proxy hop, no load balancing): "
                  + (" ".join(f"http://{args.host}:{p}{prefix}" for p in up)
                     or ("none yet (no replica runs until requests come)" if not start
                         else "none answered within 60 s"))
                  + f" (a replaced replica comes back on another of {direct_ports[0]}-{direct_ports[-1]})",
                  flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("shutting down Serve", flush=True)
        return 0
    except Exception as e:  # Ray/Serve failed to start or to deploy: one line, not a Ray traceback
        cause = _root_cause(e)
        if f":{args.port}" in cause and any(m in cause.lower() for m in ("address already in use", "failed to bind")):
            # the port was taken between the check above and Serve's bind
            print(f"error: --port: cannot listen on {args.host}:{args.port} (Address already in use)",
                  file=sys.stderr)
            return 2
        if "Deploying application" in cause:
            cause = _deployment_error(cause)
            if cause.startswith("ValueError: "):  # the replicas refused the input (a checkpoint cut short)
                print(f"error: {cause[len('ValueError: '):][:500]}", file=sys.stderr)
                return 2
        print(f"error: serving failed: {cause[:500]}", file=sys.stderr)
        return 1
    finally:
        # A second Ctrl-C or SIGTERM must not cut the cleanup short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            if started and ray.is_initialized():
                # Serve's shutdown kills its controller mid-task, and the raylet reports the killed
                # task ("... failed. There are infinite retries remaining"): nothing of the user's
                ray_worker._worker_logs_enabled = False
                if external:
                    serve.delete(APP_NAME)
                else:
                    serve.shutdown()
        finally:
            if ray.is_initialized():
                ray.shutdown()
            print("stopped", flush=True)
