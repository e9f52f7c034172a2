"""Serve a trained policy over HTTP with Ray Serve.

    python -m agents.serve --checkpoint PATH [--host 127.0.0.1] [--port 8000] [--route-prefix /]
                           [--num-replicas 1] [--num-cpus 0.5] [--max-samples 16] [--dashboard-port N]
                           [--min-replicas N --max-replicas M [--target-ongoing-requests T]]

PATH is a checkpoint directory written by `agents.train` (or the RLModule
directory inside it). Each replica loads the policy once and serves a FastAPI
application (`@serve.ingress`) with these routes, under `--route-prefix`:

    POST /generate         the project's own request: generations with the task's reward
    GET  /generate         what the policy accepts (task, lengths, sampler, an example prompt)
    POST /v1/completions   the OpenAI completions API (text only, no reward)
    GET  /v1/models        the served model, in the OpenAI format
    GET  /docs             OpenAPI (Swagger) documentation; /openapi.json is the schema

POST /generate  {"prompt": "3 7 12", "max_new_tokens": 10, "num_samples": 2, "greedy": false, "seed": 0}
answers

    {"prompt": "3 7 12", "prompt_truncated": false, "max_new_tokens": 10, "greedy": false, "seed": 0,
     "generations": [{"text": "13 15 ...", "reward": 0.67}, {"text": "...", "reward": 0.44}]}

    curl -s localhost:8000/generate -H 'Content-Type: application/json' \\
         -d '{"prompt": "<pad> <pad> <pad> <pad> <pad>", "greedy": true}'

Generation runs the checkpoint's own environment (`agents.generate.generate`),
so the policy acts exactly as in training: the task's tokenizer, the left
truncation of long prompts to `env.max_prompt_len` (`prompt` in the reply is
the prompt as the policy saw it, decoded without special tokens such as
`<pad>`; `prompt_truncated` says whether it was cut),
the configured truncation sampler (top-k, top-p, ..., mirostat, learned
masking), and EOS ending a generation early. `reward` is the task's reward.

/generate fields (only `prompt` is required; any other field is an error):
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

POST /v1/completions takes the OpenAI completions request
    {"model": "policy", "prompt": "3 7 12", "max_tokens": 10, "temperature": 0.7, "top_p": 0.9, "n": 2, "seed": 0}
and answers in its format
    {"id": "cmpl-...", "object": "text_completion", "created": 1795000000, "model": "policy",
     "choices": [{"text": "13 15 ...", "index": 0, "logprobs": null, "finish_reason": "stop"}, ...],
     "usage": {"prompt_tokens": 3, "completion_tokens": 17, "total_tokens": 20}}
so OpenAI clients work against it (`OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")`).
  prompt       string or non-empty list of strings, each as for /generate (token ids are not taken);
               choices are ordered by prompt, then sample: index = prompt_index * n + j
  max_tokens   integer in [1, env.max_new_tokens] (default env.max_new_tokens, not OpenAI's 16: the
               policy was trained for that length)
  temperature  number in [0, 2] (default 1); top_p number in (0, 1] (default 1). They act ON TOP of
               the policy's trained sampler, not instead of it: the policy's logits, with the
               configured sampler's mask already applied, are divided by `temperature`, then cut to
               the nucleus of mass `top_p`. The defaults sample exactly as /generate does;
               temperature 0 is argmax (as /generate's greedy).
  n            integer in [1, --max-samples]; n times the number of prompts is at most --max-samples
  seed         integer in [0, 2**31 - 1] (default random): the same seed and request give the same text
  model        string, echoed in the reply (default: the checkpoint directory's name)
  stream       false only (streaming is not supported); user: string, ignored
Any other field (logprobs, stop, echo, ...) is refused naming it. `finish_reason` is "stop" when
the policy wrote EOS, else "length". `usage.prompt_tokens` counts each prompt once, as the policy
saw it (after the left truncation to env.max_prompt_len); `completion_tokens` counts the tokens
the policy wrote over all choices, EOS included (the text omits EOS and other special tokens).

A request the policy cannot take gets HTTP 400 (413 for a body over 1 MiB,
405 for a method a route does not take, 404 for an unknown path) and
`{"error": "<field>: <one line>"}`, FastAPI's validation errors included
(request bodies must be sent with `Content-Type: application/json`, as
FastAPI requires); the replica keeps serving. A failure inside generation is
a 500 with `{"error": "internal error: ..."}`, and the replica keeps serving
too. A reply with generations carries an `X-Replica` header naming the
replica that answered.

The routes are module functions on one FastAPI `app` that take the replica's
`Policy` as a FastAPI dependency (`replica_policy`), so the same application
runs in-process for tests with `app.dependency_overrides`.

Replicas: `--num-replicas N` runs N replicas (default 1). `--max-replicas M`
turns on Serve's autoscaling between `--min-replicas` (default 1; 0 scales
to zero when idle) and M, aiming at `--target-ongoing-requests` requests per
replica (default 2, at most the 8 a replica takes at a time); `--num-replicas`
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
from typing import Annotated, ClassVar, Literal, Optional, Union

from fastapi import Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError
from ray import serve
from starlette.exceptions import HTTPException

APP_NAME = "policy"
MAX_BODY_BYTES = 1 << 20
MAX_PROMPT_CHARS = 10_000
MAX_SEED = 2**31 - 1
MAX_REFERENCES = 64
MAX_ONGOING_REQUESTS = 8  # per replica: validation answers while a generation runs; generations queue
ROUTES = ("/generate", "/v1/completions", "/v1/models", "/docs", "/openapi.json")

logger = logging.getLogger(__name__)


class BadRequest(ValueError):
    """A request the policy cannot take; its message is the one line sent back."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# -- request models (no Ray, no model) -----------------------------------------------------------
#
# Each field's validator writes its own one-line message; `error_line` puts the field's name in
# front. Types are checked here; limits that depend on the checkpoint or the CLI (max_new_tokens,
# num_samples, the vocabulary) are checked by `Policy`, with messages of the same form.


def _type_name(value) -> str:
    return "null" if value is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                         list: "array", dict: "object"}.get(type(value), type(value).__name__)


def _invalid(reason: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_field", "{reason}", {"reason": reason})


def _shown(value) -> str:
    return f"{_type_name(value)} {json.dumps(value)[:80]}"


def _json_int(value) -> int | None:
    """`value` as an integer if JSON writes it as one (3 or 3.0; not 3.5, true or "3"), else None."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _integer(lo: int | None = None, hi: int | None = None):
    what = (f"an integer in [{lo}, {hi}]" if hi is not None else
            f"an integer >= {lo}" if lo is not None else "an integer")

    def check(value):
        if value is None:  # where the field allows null (= its default)
            return None
        number = _json_int(value)
        if number is None:
            raise _invalid(f"must be {what}, got {_shown(value)}")
        if (lo is not None and number < lo) or (hi is not None and number > hi):
            raise _invalid(f"must be {what}, got {number}")
        return number

    return BeforeValidator(check)


def _number(lo: float, hi: float, *, lo_open: bool = False):
    what = f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"

    def check(value):
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _invalid(f"must be {what}, got {_shown(value)}")
        if value < lo or (lo_open and value == lo) or value > hi:
            raise _invalid(f"must be {what}, got {value:g}")
        return float(value)

    return BeforeValidator(check)


def _boolean(value):
    if not isinstance(value, bool):
        raise _invalid(f"must be true or false, got {_shown(value)}")
    return value


def _text(value, what: str = "a string"):
    if not isinstance(value, str):
        raise _invalid(f"must be {what}, got {_type_name(value)}")
    if len(value) > MAX_PROMPT_CHARS:
        raise _invalid(f"longer than {MAX_PROMPT_CHARS} characters")
    return value


def _texts(value):
    """A completions prompt: a string or a non-empty list of strings."""
    what = "a string or a non-empty list of strings"
    if isinstance(value, list):
        if not value:
            raise _invalid(f"must be {what}, got an empty list")
        if not all(isinstance(v, str) for v in value):
            bad = next(v for v in value if not isinstance(v, str))
            ids = " (token ids are not taken: send text)" if _json_int(bad) is not None else ""
            raise _invalid(f"must be {what}, got a list holding {_type_name(bad)}{ids}")
        if sum(len(v) for v in value) > MAX_PROMPT_CHARS:
            raise _invalid(f"longer than {MAX_PROMPT_CHARS} characters in all")
        return value
    return _text(value, what)


def _references(value):
    if value is None:
        return None
    refs = [value] if isinstance(value, str) else value
    if not isinstance(refs, list) or not refs or not all(isinstance(r, str) and r.strip() for r in refs):
        raise _invalid(f"must be a non-empty string or a non-empty list of non-empty strings, "
                       f"got {json.dumps(value)[:80]}")
    if len(refs) > MAX_REFERENCES or sum(len(r) for r in refs) > MAX_PROMPT_CHARS:
        raise _invalid(f"at most {MAX_REFERENCES} texts of {MAX_PROMPT_CHARS} characters in all")
    return refs


def _stream(value):
    if value is not False:
        raise _invalid("streaming is not supported; send false or leave the field out"
                       if value is True else f"must be false, got {_shown(value)}")
    return value


class _StrictFields(BaseModel):
    """Refuses a field it does not know, naming it (before any other check)."""

    model_config = ConfigDict(extra="forbid")
    other_route_names: ClassVar[dict[str, str]] = {}  # a field of the other route -> a hint

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data):
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(cls.model_fields))
            if unknown:
                name = unknown[0]
                hint = cls.other_route_names.get(name)
                reason = f"unknown field (known: {', '.join(cls.model_fields)})"
                if hint:
                    reason += f"; {hint}"
                raise PydanticCustomError("unknown_field", "{reason}", {"field": name, "reason": reason})
        return data


Seed = Annotated[Optional[int], _integer(0, MAX_SEED),
                 Field(None, description="integer in [0, 2**31 - 1]; default: a random seed")]


class GenerateRequest(_StrictFields):
    """POST /generate: generations of one prompt, with the task's reward."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"prompt": "3 7 12", "max_new_tokens": 10, "num_samples": 2, "greedy": False, "seed": 0}]})
    other_route_names: ClassVar[dict[str, str]] = {
        "max_tokens": "/generate calls it max_new_tokens", "n": "/generate calls it num_samples",
        "temperature": "/generate has greedy; /v1/completions takes temperature",
        "top_p": "/v1/completions takes top_p"}

    prompt: Annotated[str, BeforeValidator(_text)] = Field(
        description="text the task's tokenizer can encode; cut on the left to env.max_prompt_len tokens")
    max_new_tokens: Annotated[Optional[int], _integer()] = Field(
        None, description="integer in [1, env.max_new_tokens] (GET /generate shows it); default: that maximum")
    num_samples: Annotated[int, _integer()] = Field(1, description="generations, in [1, --max-samples]")
    greedy: Annotated[bool, BeforeValidator(_boolean)] = Field(
        False, description="argmax decoding (after the sampler's mask)")
    seed: Seed
    references: Annotated[Optional[list[str]], BeforeValidator(_references)] = Field(
        None, description="reference texts (string or list) for tasks whose reward compares with references")


class Generation(BaseModel):
    text: str
    reward: Optional[float] = Field(description="the task's reward; null where it needs references not given")


class GenerateResponse(BaseModel):
    prompt: str = Field(description="the prompt as the policy saw it (cut, without special tokens)")
    prompt_truncated: bool
    max_new_tokens: int
    greedy: bool
    seed: int
    generations: list[Generation]


class CompletionRequest(_StrictFields):
    """POST /v1/completions: the OpenAI completions request (the fields this policy can honour)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "policy", "prompt": "3 7 12", "max_tokens": 10, "temperature": 0.7, "n": 2, "seed": 0}]})
    other_route_names: ClassVar[dict[str, str]] = {
        "max_new_tokens": "this route calls it max_tokens", "num_samples": "this route calls it n",
        "greedy": "temperature 0 is argmax here", "references": "/generate takes references and gives rewards"}

    prompt: Annotated[Union[str, list[str]], BeforeValidator(_texts)] = Field(
        description="a string or a list of strings, each cut on the left to env.max_prompt_len tokens")
    model: Annotated[Optional[str], BeforeValidator(lambda v: v if v is None else _text(v))] = Field(
        None, description="echoed in the reply; default: the checkpoint's name")
    max_tokens: Annotated[Optional[int], _integer()] = Field(
        None, description="integer in [1, env.max_new_tokens]; default: that maximum")
    temperature: Annotated[float, _number(0, 2)] = Field(
        1.0, description="divides the policy's (sampler-masked) logits; 0 is argmax")
    top_p: Annotated[float, _number(0, 1, lo_open=True)] = Field(
        1.0, description="nucleus over the policy's (sampler-masked) distribution")
    n: Annotated[int, _integer()] = Field(1, description="completions per prompt, in [1, --max-samples]")
    seed: Seed
    stream: Annotated[bool, BeforeValidator(_stream)] = Field(False, description="false only")
    user: Annotated[Optional[str], BeforeValidator(lambda v: v if v is None else _text(v))] = Field(
        None, description="ignored")


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


def error_line(errors: list[dict]) -> str:
    """One `"<field>: <message>"` line for pydantic/FastAPI validation errors (the first that counts)."""
    def field_of(e):
        names = [str(x) for x in e.get("loc", ()) if x != "body" and not isinstance(x, int)]
        return names[0] if names else None

    for e in errors:  # an unknown field first, as the models check it first
        if e["type"] == "unknown_field":
            return f"{e['ctx']['field']}: {e['msg']}"
    e = errors[0]
    field = field_of(e)
    if e["type"] == "json_invalid":
        return f"request body: not valid JSON ({(e.get('ctx') or {}).get('error', e['msg'])})"
    if field is None:  # the body as a whole
        if e["type"] == "missing":
            return "request body: required (a JSON object)"
        if isinstance(e.get("input"), (bytes, bytearray)):  # FastAPI reads JSON only when the request says so
            return "request body: send it as JSON with the header Content-Type: application/json"
        return (f"request body: must be a JSON object like {{\"prompt\": \"...\"}}, "
                f"got {_type_name(e.get('input'))}")
    if e["type"] == "missing":
        return f"{field}: required"
    if e["type"] == "invalid_field":
        return f"{field}: {e['msg']}"
    return f"{field}: {e['msg']}, got {_shown(e.get('input'))}"


# -- the policy in one replica (no Ray: usable and testable in-process) ----------------------


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


def run_request(module, env_config: dict, req: dict, *, needs_references: bool = False) -> dict:
    """Generates for a checked /generate request with `agents.generate.generate`; the reply's JSON.
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


def run_completion(module, env_config: dict, req: dict) -> dict:
    """Generates for a checked /v1/completions request with `agents.generate.generate`: the
    OpenAI reply's JSON. Rows are prompt-major (choice index = prompt_index * n + j)."""
    from agents.generate import generate

    n = req["n"]
    greedy = req["temperature"] == 0
    results = generate(module, {**env_config, "max_new_tokens": req["max_tokens"]},
                       [p for p in req["prompts"] for _ in range(n)], greedy=greedy, seed=req["seed"], score=False,
                       temperature=1.0 if greedy else req["temperature"], top_p=1.0 if greedy else req["top_p"])
    completion_tokens = sum(r["num_generated"] for r in results)
    prompt_tokens = sum(r["prompt_tokens"] for r in results[::n])
    return {
        "id": f"cmpl-{secrets.token_hex(12)}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": req["model"],
        "choices": [{"text": r["generation"], "index": i, "logprobs": None,
                     "finish_reason": "stop" if r["eos"] else "length"} for i, r in enumerate(results)],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


class Policy:
    """A checkpoint's policy, loaded once, behind a lock (its KV cache and sampler state are per
    module): checks requests against its limits and generates for them."""

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
        self.model_name = os.path.basename(os.path.normpath(checkpoint)) or "policy"
        self.replica = None  # the Serve replica's tag, where one runs it
        self.lock = threading.Lock()
        task = make_task(self.env_config["task"], max_new_tokens=self.max_new_tokens)
        self.needs_references = reward_needs_meta(task)
        examples = task.examples("train")
        self.info = {
            "checkpoint": checkpoint,
            "model": self.model_name,
            "task": self.env_config["task"],
            "env": self.env_config,
            "max_prompt_len": self.max_prompt_len,
            "max_new_tokens": self.max_new_tokens,
            "max_num_samples": self.max_samples,
            "sampler": {k: v for k, v in (self.module.model_config.get("sampler") or {"name": "none"}).items()
                        if v is not None},
            "example_prompt": examples[0]["prompt"] if examples else None,
            "reward_needs_references": self.needs_references,
            "fields": list(GenerateRequest.model_fields),
            "routes": list(ROUTES),
        }

    def _prompt_tokens(self, text: str, item: str = "") -> int:
        """The prompt's length in tokens; refuses unknown words and empty prompts (`item`: "[i] " in a list)."""
        unknown_pieces = unknown_words(self.tokenizer, text)
        if unknown_pieces:
            raise BadRequest(f"prompt: {item}{unknown_pieces[0]!r} is not in the task's vocabulary")
        n_tokens = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if n_tokens == 0:
            raise BadRequest(f"prompt: {item}empty after tokenization")
        return n_tokens

    @staticmethod
    def _within(field: str, value: int, hi: int) -> int:
        if not 1 <= value <= hi:
            raise BadRequest(f"{field}: must be an integer in [1, {hi}], got {value}")
        return value

    @staticmethod
    def _seed(seed: int | None) -> int:
        # absent (or null): a fresh seed (returned by /generate so the reply can be reproduced)
        return secrets.randbelow(MAX_SEED + 1) if seed is None else seed

    def check_generate(self, req: GenerateRequest) -> dict:
        """The /generate request with its limits checked and defaults filled in; raises BadRequest."""
        n_tokens = self._prompt_tokens(req.prompt)
        return {
            "prompt": req.prompt,
            "prompt_truncated": n_tokens > self.max_prompt_len,
            "max_new_tokens": self._within("max_new_tokens", self.max_new_tokens if req.max_new_tokens is None
                                           else req.max_new_tokens, self.max_new_tokens),
            "num_samples": self._within("num_samples", req.num_samples, self.max_samples),
            "greedy": req.greedy,
            "seed": self._seed(req.seed),
            "references": req.references,
        }

    def check_completion(self, req: CompletionRequest) -> dict:
        """The /v1/completions request with its limits checked and defaults filled in; raises BadRequest."""
        prompts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
        for i, text in enumerate(prompts):
            self._prompt_tokens(text, "" if isinstance(req.prompt, str) else f"[{i}] ")
        n = self._within("n", req.n, self.max_samples)
        if len(prompts) * n > self.max_samples:
            raise BadRequest(f"prompt: {len(prompts)} prompts x n={n} = {len(prompts) * n} completions; "
                             f"at most {self.max_samples} per request (--max-samples)")
        return {
            "prompts": prompts,
            "model": req.model or self.model_name,
            "max_tokens": self._within("max_tokens", self.max_new_tokens if req.max_tokens is None
                                       else req.max_tokens, self.max_new_tokens),
            "temperature": req.temperature,
            "top_p": req.top_p,
            "n": n,
            "seed": self._seed(req.seed),
        }

    def generate(self, req: dict) -> dict:
        with self.lock:  # one generation at a time per replica: the module keeps per-row state
            return run_request(self.module, self.env_config, req, needs_references=self.needs_references)

    def complete(self, req: dict) -> dict:
        with self.lock:
            return run_completion(self.module, self.env_config, req)


# -- the HTTP application ------------------------------------------------------------------------


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets a 413 before the app reads it
    (declared by Content-Length, or counted as it arrives). The refused body is read to its end
    first (up to `drain_bytes` in all): a server that answers and closes while the client is
    still sending leaves the client a broken pipe or a reset instead of the 413."""

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES, drain_bytes: int = 16 * MAX_BODY_BYTES):
        self.app = app
        self.max_bytes = max_bytes
        self.drain_bytes = drain_bytes

    async def _refuse(self, scope, receive, send, received: int, more: bool):
        while more and received <= self.drain_bytes:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            received += len(message.get("body", b""))
            more = message.get("more_body", False)
        response = JSONResponse({"error": f"request body: larger than {self.max_bytes} bytes"}, status_code=413)
        await response(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = 0
        if declared > self.max_bytes:
            return await self._refuse(scope, receive, send, 0, declared <= self.drain_bytes)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send, size, more)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


app = FastAPI(
    title="Policy server",
    summary="A policy trained with this project's token-level RL, served with Ray Serve.",
    description="`POST /generate` is the project's own request (generations with the task's reward); "
                "`POST /v1/completions` is the OpenAI completions API. Errors are "
                "`{\"error\": \"<field>: <message>\"}` (400; 413 for a body over 1 MiB).",
    version="1",
)
app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    return JSONResponse({"error": error_line(list(exc.errors()))}, status_code=400)


@app.exception_handler(BadRequest)
async def _bad_request(request: Request, exc: BadRequest):
    return JSONResponse({"error": str(exc)}, status_code=exc.status)


@app.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException):
    path = request.url.path
    if exc.status_code == 404:
        message = f"path: {path} not found (routes: {', '.join(ROUTES)})"
    elif exc.status_code == 405:
        message = f"method: {request.method} is not supported on {path}"
    elif exc.status_code == 400:  # FastAPI could not read the body (not UTF-8, ...)
        message = f"request body: not valid JSON ({exc.detail})"
    else:
        message = f"request: {exc.detail}"
    return JSONResponse({"error": message}, status_code=exc.status_code, headers=getattr(exc, "headers", None))


def replica_policy() -> Policy:
    """The `Policy` of the Serve replica answering (a FastAPI dependency; tests override it)."""
    return serve.get_replica_context().servable_object.policy


async def _answer(policy: Policy, check, run, req: BaseModel, response: Response) -> dict:
    """`run(check(req))`: the check (fast) on the event loop, the generation in a thread, so the
    replica keeps answering other requests meanwhile. A failure that is not a BadRequest is a 500."""
    try:
        checked = check(req)
        if policy.replica:
            response.headers["X-Replica"] = policy.replica
        return await asyncio.to_thread(run, checked)
    except BadRequest:
        raise
    except Exception as e:  # a bug or a task failure: report it, keep the replica up
        logger.exception("generation failed")
        message = " ".join(str(e).split()) or type(e).__name__
        raise BadRequest(f"internal error: {type(e).__name__}: {message}", status=500) from None


@app.post("/generate", response_model=GenerateResponse)
async def generate_route(req: GenerateRequest, response: Response, policy: Policy = Depends(replica_policy)):
    """Generations of a prompt by the policy, each with the task's reward."""
    return await _answer(policy, policy.check_generate, policy.generate, req, response)


@app.get("/generate")
async def describe_route(policy: Policy = Depends(replica_policy)) -> dict:
    """What /generate accepts: task, lengths, sampler, an example prompt, the fields."""
    return policy.info


@app.post("/v1/completions", response_model=CompletionResponse)
async def completions_route(req: CompletionRequest, response: Response, policy: Policy = Depends(replica_policy)):
    """The OpenAI completions API: choices and token usage (no reward)."""
    return await _answer(policy, policy.check_completion, policy.complete, req, response)


@app.get("/v1/models")
async def models_route(policy: Policy = Depends(replica_policy)) -> dict:
    """The served model, in the OpenAI format."""
    return {"object": "list", "data": [{"id": policy.model_name, "object": "model", "created": 0,
                                        "owned_by": "agents.serve"}]}


@serve.ingress(app)
class PolicyServer:
    """One Serve replica: loads the checkpoint's `Policy` once; `app`'s routes answer with it."""

    def __init__(self, checkpoint: str, max_samples: int = 16):
        self.policy = Policy(checkpoint, max_samples)
        self.policy.replica = serve.get_replica_context().replica_tag


def replica_options(num_replicas: int | None = None, min_replicas: int | None = None,
                    max_replicas: int | None = None, target_ongoing_requests: float | None = None) -> dict:
    """Serve deployment options for a fixed number of replicas or for autoscaling (when
    `max_replicas` is given); raises ValueError naming the flag for a combination that cannot work."""
    if max_replicas is None:
        for flag, value in (("--min-replicas", min_replicas), ("--target-ongoing-requests", target_ongoing_requests)):
            if value is not None:
                raise ValueError(f"{flag} needs --max-replicas (autoscaling runs between --min-replicas and it)")
        n = 1 if num_replicas is None else num_replicas
        if n < 1:
            raise ValueError(f"--num-replicas must be >= 1 (got {n})")
        return {"num_replicas": n}
    lo = 1 if min_replicas is None else min_replicas
    if lo < 0:
        raise ValueError(f"--min-replicas must be >= 0 (got {lo})")
    if max_replicas < max(lo, 1):
        raise ValueError(f"--max-replicas must be >= 1 and >= --min-replicas {lo} (got {max_replicas})")
    start = max(lo, 1) if num_replicas is None else num_replicas
    if not lo <= start <= max_replicas:
        raise ValueError(f"--num-replicas (the replicas to start with when autoscaling) must lie in "
                         f"[--min-replicas, --max-replicas] = [{lo}, {max_replicas}] (got {start})")
    target = 2.0 if target_ongoing_requests is None else target_ongoing_requests
    if not 0 < target <= MAX_ONGOING_REQUESTS:
        raise ValueError(f"--target-ongoing-requests must be in (0, {MAX_ONGOING_REQUESTS}] (a replica takes "
                         f"{MAX_ONGOING_REQUESTS} requests at a time; got {target:g})")
    return {"autoscaling_config": {"min_replicas": lo, "max_replicas": max_replicas, "initial_replicas": start,
                                   "target_ongoing_requests": target}}


def make_app(checkpoint: str, *, num_replicas: int = 1, num_cpus: float = 0.5, max_samples: int = 16,
             replicas: dict | None = None):
    """The Serve application: PolicyServer replicas, each loading `checkpoint`: `num_replicas` of
    them, or as `replicas` (from `replica_options`, e.g. an autoscaling config) says."""
    deployment = serve.deployment(
        PolicyServer,
        name="PolicyServer",
        ray_actor_options={"num_cpus": num_cpus},
        max_ongoing_requests=MAX_ONGOING_REQUESTS,
        **(replicas or {"num_replicas": num_replicas}),
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
                        help=f"autoscaling: requests per replica to aim at (default 2, at most "
                             f"{MAX_ONGOING_REQUESTS}); needs --max-replicas")
    parser.add_argument("--num-cpus", type=float, default=0.5, help="CPUs each replica reserves (default 0.5)")
    parser.add_argument("--max-samples", type=int, default=16,
                        help="most generations per request (num_samples; n x prompts) (default 16)")
    parser.add_argument("--dashboard-port", type=int, default=None,
                        help="start the Ray dashboard on this port (local Ray only; default: no dashboard)")
    args = parser.parse_args(argv)
    if not 1 <= args.port <= 65535:
        parser.error("--port must be in [1, 65535]")
    if not args.route_prefix.startswith("/"):
        parser.error("--route-prefix must start with '/'")
    try:
        replicas = replica_options(args.num_replicas, args.min_replicas, args.max_replicas,
                                   args.target_ongoing_requests)
    except ValueError as e:
        parser.error(str(e))
    if not args.num_cpus > 0:
        parser.error("--num-cpus must be > 0 (fractions such as 0.25 are fine)")
    if args.max_samples < 1:
        parser.error("--max-samples must be >= 1")
    if args.dashboard_port is not None and not 1 <= args.dashboard_port <= 65535:
        parser.error("--dashboard-port must be in [1, 65535]")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    prefix = args.route_prefix.rstrip("/")

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
    autoscaling = replicas.get("autoscaling_config")
    start = autoscaling["initial_replicas"] if autoscaling else replicas["num_replicas"]

    import ray

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
            context = ray.init(address="local", logging_level="ERROR", log_to_driver=False,
                               runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}}, **dashboard)
            if context.dashboard_url:
                print(f"Ray dashboard: http://{context.dashboard_url}", flush=True)
            cpus = ray.cluster_resources().get("CPU", 0)
            if start * args.num_cpus > cpus + 1e-9:  # Serve would wait forever for the replicas
                print(f"error: --num-replicas: {start} replicas x --num-cpus {args.num_cpus:g} need "
                      f"{start * args.num_cpus:g} CPUs; this machine's Ray instance has {cpus:g}", file=sys.stderr)
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
        application = make_app(checkpoint, num_cpus=args.num_cpus, max_samples=args.max_samples, replicas=replicas)
        serve.run(application, name=APP_NAME, route_prefix=prefix or "/", logging_config={"log_level": "WARNING"})
        base = f"http://{args.host}:{args.port}{prefix}"
        print(f"Serving {checkpoint} at {base}/generate (Ctrl-C to stop)", flush=True)
        scaling = (f"autoscaling {autoscaling['min_replicas']}-{autoscaling['max_replicas']} replicas "
                   f"(started {start}, target {autoscaling['target_ongoing_requests']:g} ongoing requests each)"
                   if autoscaling else f"{start} replica{'s' if start > 1 else ''}")
        print(f"  OpenAI completions: {base}/v1/completions; API docs: {base}/docs; {scaling}", flush=True)
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
