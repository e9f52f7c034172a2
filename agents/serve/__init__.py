"""Serve a trained policy over HTTP with Ray Serve.

    python -m agents.serve --checkpoint PATH [--host 127.0.0.1] [--port 8000] [--route-prefix /]
                           [--num-replicas 1] [--num-cpus 0.5] [--num-gpus 0] [--max-samples 16] [--dashboard-port N]
                           [--batch-rows 16] [--batch-block 8] [--max-queue 256] [--precision fp32]
                           [--min-replicas N --max-replicas M [--target-ongoing-requests T]]

PATH is a checkpoint directory written by `agents.train` (or the RLModule
directory inside it). Each replica loads the policy once and serves a FastAPI
application (`@serve.ingress`) with these routes, under `--route-prefix`:

    POST /generate         the project's own request: generations with the task's reward
    GET  /generate         what the policy accepts (task, lengths, sampler, an example prompt)
    POST /v1/completions   the OpenAI completions API (text only, no reward; `stream: true` for events)
    POST /v1/chat/completions  the OpenAI chat API, where the tokenizer has a chat template
    GET  /v1/models        the served model, in the OpenAI format
    GET  /docs             OpenAPI (Swagger) documentation; /openapi.json is the schema

POST /generate  {"prompt": "3 7 12", "max_new_tokens": 10, "num_samples": 2, "greedy": false, "seed": 0}
answers

    {"prompt": "3 7 12", "prompt_truncated": false, "max_new_tokens": 10, "greedy": false, "seed": 0,
     "generations": [{"text": "13 15 ...", "reward": 0.67}, {"text": "...", "reward": 0.44}]}

    curl -s localhost:8000/generate -H 'Content-Type: application/json' \\
         -d '{"prompt": "<pad> <pad> <pad> <pad> <pad>", "greedy": true}'

Each replica generates for many requests at once: `--batch-rows` rows (default 16) step
together, in blocks of up to `--batch-block` tokens (default 8: the decode engine's static steps,
CUDA graphs on a GPU, with each request's sampling inside), and a request's completions take rows
as they free up between blocks (continuous batching; `--batch-rows 0` runs one request at a
time). A request's text does not depend on what else is being generated: the same seed and
request give the same text, alone or under load.

Generation runs the checkpoint's own environment (as `agents.generate.generate` does),
so the policy acts exactly as in training: the task's tokenizer, the left
truncation of long prompts to `env.max_prompt_len` (`prompt` in the reply is
the prompt as the policy saw it, decoded without special tokens such as
`<pad>`; `prompt_truncated` says whether it was cut),
the configured truncation sampler (top-k, top-p, ..., mirostat, learned
masking), and EOS ending a generation early. `reward` is the task's reward.

The package:

    requests.py     the request and reply models (the fields above, checked with one-line errors)
    batching.py     `Batcher`: continuous batching, B rows stepping together, requests taking rows as they free
    replies.py      the replies: /generate's, OpenAI's objects and streamed chunks, OpenAI's error object
    replica.py      `Policy`: the checkpoint in one replica, checking requests and generating
    application.py  the FastAPI `app` (routes, errors, `BodyLimit`) and its Serve deployment
                    (`PolicyServer`, `make_app`)
    options.py      the batching defaults and `replica_options` (fixed replicas or autoscaling):
                    standard library only, so the command line refuses bad flags before Ray starts
    cli.py          `main`: the command line (replicas, autoscaling, ports, shutdown)
    launch.py       start `python -m agents.serve` from Python and wait for it (`ServeProcess`)

The names below are importable from `agents.serve` itself; each loads its module on first use,
so `agents.serve.launch` does not import Ray or FastAPI.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "agents.serve.application": ("MAX_BODY_BYTES", "BodyLimit", "PolicyServer", "app", "make_app"),
    "agents.serve.cli": ("APP_NAME", "main"),
    "agents.serve.batching": ("Batcher", "Busy", "Completion", "Job"),
    "agents.serve.options": ("BATCH_ROWS", "MAX_QUEUE", "MAX_ONGOING_REQUESTS", "max_ongoing_requests",
                             "replica_options"),
    "agents.serve.replica": ("Policy", "alone_results", "replica_policy", "unknown_words"),
    "agents.serve.requests": ("MAX_PROMPT_CHARS", "MAX_REFERENCES", "MAX_SEED", "ROUTES", "BadRequest",
                              "CompletionRequest", "CompletionResponse", "GenerateRequest", "GenerateResponse",
                              "error_line"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
