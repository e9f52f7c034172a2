"""Serve a trained policy over HTTP with Ray Serve.

    python -m agents.serve --checkpoint PATH [--host 127.0.0.1] [--port 8000] [--route /generate]
                           [--num-replicas 1] [--num-cpus 0.5] [--max-samples 16] [--dashboard-port N]

PATH is a checkpoint directory written by `agents.train` (or the RLModule
directory inside it). Each replica loads the policy once and answers

    POST /generate  {"prompt": "3 7 12", "max_new_tokens": 10, "num_samples": 2, "greedy": false, "seed": 0}

with

    {"prompt": "3 7 12", "prompt_truncated": false, "max_new_tokens": 10, "greedy": false, "seed": 0,
     "generations": [{"text": "13 15 ...", "reward": 0.67}, {"text": "...", "reward": 0.44}]}

    curl -s localhost:8000/generate -d '{"prompt": "<pad> <pad> <pad> <pad> <pad>", "greedy": true}'

Generation runs the checkpoint's own environment (`agents.generate.generate`),
so the policy acts exactly as in training: the task's tokenizer, the left
truncation of long prompts to `env.max_prompt_len` (`prompt` in the reply is
the prompt as the policy saw it, decoded without special tokens such as
`<pad>`; `prompt_truncated` says whether it was cut),
the configured truncation sampler (top-k, top-p, ..., mirostat, learned
masking), and EOS ending a generation early. `reward` is the task's reward.

Fields (only `prompt` is required; any other field is an error):
  prompt          string the task's tokenizer can encode, non-empty after tokenization
  max_new_tokens  integer in [1, env.max_new_tokens] (default: env.max_new_tokens).
                  Shorter generations ARE supported: the episode runs in the same
                  environment configured with this many new tokens, so the policy
                  stops after that many tokens (or at EOS) and `reward` is the
                  task's reward for an episode of that length.
  num_samples     integer in [1, --max-samples] (default 1): generations of the prompt
  greedy          boolean (default false): argmax decoding (after the sampler's mask)
  seed            integer in [0, 2**31 - 1] (default: random, and returned in the reply);
                  the same seed and request give the same generations
  references      string or list of strings: reference texts for tasks whose reward
                  compares the generation with references (BLEU, ROUGE, CIDEr, ...).
                  Without them such a task's `reward` is null (GET shows
                  `reward_needs_references`); the generations are the same.

A request the policy cannot take gets HTTP 400 (413 for a body over 1 MiB,
405 for a method other than POST or GET) and `{"error": "<one line naming the
field>"}`; the replica keeps serving. GET on the route returns what the
policy accepts (task, lengths, sampler, an example prompt).

The CLI prints the URL it serves at and runs until Ctrl-C (or SIGTERM), then
shuts Serve and its Ray instance down. Without RAY_ADDRESS it starts a private
local Ray instance (never one that `ray start` left running) without the
dashboard (`--dashboard-port N` turns it on at port N); with RAY_ADDRESS it
deploys the application to that cluster and on exit deletes only this
application. Each replica reserves `--num-cpus` CPUs (fractions are fine), the
Serve controller and HTTP proxy none.

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
import asyncio
import json
import logging
import math
import os
import secrets
import signal
import socket
import sys
import threading
import time

APP_NAME = "policy"
MAX_BODY_BYTES = 1 << 20
MAX_PROMPT_CHARS = 10_000
MAX_SEED = 2**31 - 1
FIELDS = ("prompt", "max_new_tokens", "num_samples", "greedy", "seed", "references")
MAX_REFERENCES = 64

logger = logging.getLogger(__name__)


class BadRequest(ValueError):
    """A request the policy cannot take; its message is the one line sent back."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# -- request validation (no Ray, no model: unit-testable) -------------------------------------


def _type_name(value) -> str:
    return "null" if value is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                         list: "array", dict: "object"}.get(type(value), type(value).__name__)


def _integer(req: dict, field: str, default, lo: int, hi: int) -> int:
    value = req.get(field, default)
    if field not in req:
        return value
    # JSON has one number type: 3.0 is accepted as 3, 3.5 and true are not.
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{field}: must be an integer in [{lo}, {hi}], got {_type_name(value)} {json.dumps(value)}")
    if not lo <= value <= hi:
        raise BadRequest(f"{field}: must be an integer in [{lo}, {hi}], got {value}")
    return value


def unknown_words(tokenizer, text: str) -> list[str]:
    """The pieces of `text` that `tokenizer` can only encode as its unknown token."""
    unk_id, unk_token = tokenizer.unk_token_id, tokenizer.unk_token
    if unk_id is None:  # e.g. a word-level tokenizer whose unknown token is set on its backend only
        backend = getattr(tokenizer, "backend_tokenizer", None)
        unk_token = getattr(getattr(backend, "model", None), "unk_token", None)
        unk_id = backend.token_to_id(unk_token) if unk_token else None
    if unk_id is None:
        return []
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [text[s:e] for t, (s, e) in zip(enc["input_ids"], enc["offset_mapping"])
            if t == unk_id and text[s:e] != unk_token]


def parse_request(body: bytes, tokenizer, *, max_new_tokens: int, max_prompt_len: int, max_samples: int) -> dict:
    """The validated request in `body`, with defaults filled in; raises BadRequest naming the field."""
    if len(body) > MAX_BODY_BYTES:
        raise BadRequest(f"request body: larger than {MAX_BODY_BYTES} bytes", status=413)
    try:
        req = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"request body: not valid JSON ({e})") from None
    if not isinstance(req, dict):
        raise BadRequest(f"request body: must be a JSON object like {{\"prompt\": \"...\"}}, got {_type_name(req)}")
    unknown = sorted(set(req) - set(FIELDS))
    if unknown:
        raise BadRequest(f"{unknown[0]}: unknown field (known: {', '.join(FIELDS)})")
    if "prompt" not in req:
        raise BadRequest("prompt: required (a string)")
    prompt = req["prompt"]
    if not isinstance(prompt, str):
        raise BadRequest(f"prompt: must be a string, got {_type_name(prompt)}")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise BadRequest(f"prompt: longer than {MAX_PROMPT_CHARS} characters")
    unknown_pieces = unknown_words(tokenizer, prompt)
    if unknown_pieces:
        raise BadRequest(f"prompt: {unknown_pieces[0]!r} is not in the task's vocabulary")
    n_tokens = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if n_tokens == 0:
        raise BadRequest("prompt: empty after tokenization")
    greedy = req.get("greedy", False)
    if not isinstance(greedy, bool):
        raise BadRequest(f"greedy: must be true or false, got {_type_name(greedy)} {json.dumps(greedy)}")
    refs = req.get("references")
    if refs is not None:
        refs = [refs] if isinstance(refs, str) else refs
        if not isinstance(refs, list) or not refs or not all(isinstance(r, str) and r.strip() for r in refs):
            raise BadRequest(f"references: must be a non-empty string or a non-empty list of non-empty strings, "
                             f"got {json.dumps(req['references'])[:80]}")
        if len(refs) > MAX_REFERENCES or sum(len(r) for r in refs) > MAX_PROMPT_CHARS:
            raise BadRequest(f"references: at most {MAX_REFERENCES} texts of {MAX_PROMPT_CHARS} characters in all")
    seed = req.get("seed")
    if seed is None:  # absent (or null): a fresh seed, returned so the reply can be reproduced
        req.pop("seed", None)
        seed = secrets.randbelow(MAX_SEED + 1)
    return {
        "prompt": prompt,
        "prompt_truncated": n_tokens > max_prompt_len,
        "max_new_tokens": _integer(req, "max_new_tokens", max_new_tokens, 1, max_new_tokens),
        "num_samples": _integer(req, "num_samples", 1, 1, max_samples),
        "greedy": greedy,
        "seed": _integer(req, "seed", seed, 0, MAX_SEED),
        "references": refs,
    }


def run_request(module, env_config: dict, req: dict, *, needs_references: bool = False) -> dict:
    """Generates for a validated request with `agents.generate.generate`; the reply's JSON.
    A task whose reward needs references is scored only when the request gives them."""
    from agents.generate import generate

    env_config = {**env_config, "max_new_tokens": req["max_new_tokens"]}
    refs = req.get("references")
    meta = {"references": refs} if refs else {}
    results = generate(module, env_config, [req["prompt"]] * req["num_samples"], greedy=req["greedy"],
                       seed=req["seed"], metas=[meta] * req["num_samples"], score=bool(refs) or not needs_references)
    return {
        "prompt": results[0]["prompt"],
        "prompt_truncated": req["prompt_truncated"],
        "max_new_tokens": req["max_new_tokens"],
        "greedy": req["greedy"],
        "seed": req["seed"],
        "generations": [{"text": r["generation"], "reward": r["reward"]} for r in results],
    }


# -- the deployment -------------------------------------------------------------------------


class PolicyServer:
    """One replica: the policy, loaded once, behind a lock (its KV cache and sampler state are per module)."""

    def __init__(self, checkpoint: str, max_samples: int = 16):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from agents.generate import load_policy, reward_needs_meta
        from env.tasks import make_task

        self.module = load_policy(checkpoint)
        self.env_config = dict(self.module.model_config["env"])
        self.tokenizer = self.module.tokenizer
        self.max_new_tokens = int(self.env_config.get("max_new_tokens", 20))
        self.max_prompt_len = int(self.env_config.get("max_prompt_len", 5))
        self.max_samples = int(max_samples)
        self.lock = threading.Lock()
        task = make_task(self.env_config["task"], max_new_tokens=self.max_new_tokens)
        self.needs_references = reward_needs_meta(task)
        examples = task.examples("train")
        self.info = {
            "checkpoint": checkpoint,
            "task": self.env_config["task"],
            "env": self.env_config,
            "max_prompt_len": self.max_prompt_len,
            "max_new_tokens": self.max_new_tokens,
            "max_num_samples": self.max_samples,
            "sampler": {k: v for k, v in (self.module.model_config.get("sampler") or {"name": "none"}).items()
                        if v is not None},
            "example_prompt": examples[0]["prompt"] if examples else None,
            "reward_needs_references": self.needs_references,
            "fields": list(FIELDS),
        }

    def _generate(self, req: dict) -> dict:
        with self.lock:  # one generation at a time per replica: the module keeps per-row state
            return run_request(self.module, self.env_config, req, needs_references=self.needs_references)

    async def handle(self, method: str, body: bytes) -> tuple[int, dict]:
        """(HTTP status, JSON reply) for one request; never raises."""
        try:
            if method == "GET":
                return 200, self.info
            if method != "POST":
                return 405, {"error": f"method: {method} is not supported; POST a JSON object"}
            req = parse_request(body, self.tokenizer, max_new_tokens=self.max_new_tokens,
                                max_prompt_len=self.max_prompt_len, max_samples=self.max_samples)
            return 200, await asyncio.to_thread(self._generate, req)
        except BadRequest as e:
            return e.status, {"error": str(e)}
        except Exception as e:  # a bug or a task failure: report it, keep the replica up
            logger.exception("generation failed")
            message = " ".join(str(e).split()) or type(e).__name__
            return 500, {"error": f"internal error: {type(e).__name__}: {message}"}

    async def __call__(self, request):
        from starlette.responses import JSONResponse

        body = b""
        if request.method == "POST":
            try:
                declared = int(request.headers.get("content-length", 0))
            except ValueError:
                declared = 0
            if declared > MAX_BODY_BYTES:  # refused before reading it
                return JSONResponse({"error": f"request body: larger than {MAX_BODY_BYTES} bytes"}, status_code=413)
            body = await request.body()
        status, reply = await self.handle(request.method, body)
        return JSONResponse(reply, status_code=status)


def make_app(checkpoint: str, *, num_replicas: int = 1, num_cpus: float = 0.5, max_samples: int = 16):
    """The Serve application: `num_replicas` replicas of PolicyServer, each loading `checkpoint`."""
    from ray import serve

    deployment = serve.deployment(
        PolicyServer,
        name="PolicyServer",
        num_replicas=num_replicas,
        ray_actor_options={"num_cpus": num_cpus},
        max_ongoing_requests=8,  # validation answers while a generation runs; generations queue
    )
    return deployment.bind(checkpoint, max_samples)


# -- CLI --------------------------------------------------------------------------------------


def _check_port_free(flag: str, host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and aiohttp do
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"{flag}: cannot listen on {host}:{port} ({e.strerror or e})") from None


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None, prog: str = "python -m agents.serve") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory from agents.train")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    parser.add_argument("--route", default="/generate", help="URL path of the endpoint (default /generate)")
    parser.add_argument("--num-replicas", type=int, default=1, help="replicas, each with its own copy (default 1)")
    parser.add_argument("--num-cpus", type=float, default=0.5, help="CPUs each replica reserves (default 0.5)")
    parser.add_argument("--max-samples", type=int, default=16, help="largest num_samples per request (default 16)")
    parser.add_argument("--dashboard-port", type=int, default=None,
                        help="start the Ray dashboard on this port (local Ray only; default: no dashboard)")
    args = parser.parse_args(argv)
    if not 1 <= args.port <= 65535:
        parser.error("--port must be in [1, 65535]")
    if not args.route.startswith("/"):
        parser.error("--route must start with '/'")
    if args.num_replicas < 1:
        parser.error("--num-replicas must be >= 1")
    if not args.num_cpus > 0:
        parser.error("--num-cpus must be > 0 (fractions such as 0.25 are fine)")
    if args.max_samples < 1:
        parser.error("--max-samples must be >= 1")
    if args.dashboard_port is not None and not 1 <= args.dashboard_port <= 65535:
        parser.error("--dashboard-port must be in [1, 65535]")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    route = args.route.rstrip("/") or "/"

    from agents.generate import find_module_dir

    external = bool(os.environ.get("RAY_ADDRESS"))
    try:
        find_module_dir(args.checkpoint)
        if not external:  # Serve's proxy and the dashboard would fail later, deep inside Ray
            _check_port_free("--port", args.host, args.port)
            if args.dashboard_port is not None:
                _check_port_free("--dashboard-port", "127.0.0.1", args.dashboard_port)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    checkpoint = os.path.abspath(os.path.expanduser(args.checkpoint))

    import ray
    from ray import serve

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
            context = ray.init(address="local", logging_level="ERROR", log_to_driver=False,
                               runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}}, **dashboard)
            if context.dashboard_url:
                print(f"Ray dashboard: http://{context.dashboard_url}", flush=True)
        # After ray.init, which installs its own SIGTERM handler: Ctrl-C and SIGTERM both stop
        # the server cleanly (also when started from a shell that ignores SIGINT in background jobs).
        signal.signal(signal.SIGINT, _interrupt)
        signal.signal(signal.SIGTERM, _interrupt)
        serve.start(proxy_location="HeadOnly", http_options={"host": args.host, "port": args.port})
        started = True
        app = make_app(checkpoint, num_replicas=args.num_replicas, num_cpus=args.num_cpus,
                       max_samples=args.max_samples)
        serve.run(app, name=APP_NAME, route_prefix=route, logging_config={"log_level": "WARNING"})
        print(f"Serving {checkpoint} at http://{args.host}:{args.port}{route} (Ctrl-C to stop)", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("shutting down Serve", flush=True)
        return 0
    except Exception as e:  # Ray/Serve failed to start or to deploy: one line, not a Ray traceback
        message = " ".join(str(e).split())
        print(f"error: serving failed: {type(e).__name__}: {message[:500]}", file=sys.stderr)
        return 1
    finally:
        # A second Ctrl-C or SIGTERM must not cut the cleanup short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            if started and ray.is_initialized():
                if external:
                    serve.delete(APP_NAME)
                else:
                    serve.shutdown()
        finally:
            if ray.is_initialized():
                ray.shutdown()
            print("stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
