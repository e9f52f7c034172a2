"""The policy in one Serve replica: `Policy` (a checkpoint loaded once) checks requests against
its limits and generates for them: through a `Batcher` (continuous batching: `batch_rows` rows
stepping together, each request taking rows as they free up), or, with `batch_rows` 0, one
request at a time with `agents.generate.generate` under a lock. `replica_policy` is the FastAPI
dependency that gives the routes the answering replica's `Policy`.

Generation runs the checkpoint's own environment, so the policy acts exactly as in training
(the package's docstring says what that means for a reply).

Nothing here needs Ray but `replica_policy`: a `Policy` is usable and testable in-process.
"""
from __future__ import annotations

import asyncio
import os
import secrets
import threading

from ray import serve

from agents.samplers import MIN_TEMPERATURE
from agents.serve.batching import Batcher, Completion, Job
from agents.serve.options import BATCH_BLOCK, BATCH_ROWS, MAX_QUEUE
from agents.serve.requests import (MAX_SEED, ROUTES, BadRequest, ChatRequest, CompletionRequest,
                                   GenerateRequest)
from env.text_env import env_setting
from env.tokenization import unknown_words


# -- the policy in one replica (no Ray: usable and testable in-process) ----------------------


def alone_results(module, env_config: dict, completions: list[Completion]) -> list[dict]:
    """The completions generated together with `agents.generate.generate` (the one-at-a-time
    path: every completion shares the first one's length, greediness, temperature and top_p, as a
    checked request's do), as the batcher's results."""
    from agents.generate import generate

    c = completions[0]
    scored = c.meta is not None
    results = generate(module, {**env_config, "max_new_tokens": c.max_tokens}, [x.prompt for x in completions],
                       greedy=c.greedy, seed=c.seed, metas=[x.meta or {} for x in completions], score=scored,
                       temperature=1.0 if c.greedy else c.temperature, top_p=1.0 if c.greedy else c.top_p)
    return [{"text": r["generation"], "finish_reason": "stop" if r["eos"] else "length",
             "num_generated": r["num_generated"], "prompt": r["prompt"], "prompt_tokens": r["prompt_tokens"],
             "reward": r["reward"]} for r in results]


class Policy:
    """A checkpoint's policy, loaded once: checks requests against its limits and generates for
    them, batched (`batch_rows` > 0) or one request at a time behind a lock."""

    def __init__(self, checkpoint: str, max_samples: int = 16, batch_rows: int = BATCH_ROWS,
                 max_queue: int = MAX_QUEUE, device: str = "cpu", batch_block: int = BATCH_BLOCK,
                 precision: str = "fp32"):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from agents.generate import decode_in, load_policy, reward_needs_meta
        from env.tasks import make_task

        self.module = decode_in(load_policy(checkpoint).to(device), precision)
        self.env_config = dict(self.module.model_config["env"])
        self.tokenizer = self.module.tokenizer
        self.max_new_tokens = int(env_setting(self.env_config, "max_new_tokens"))
        self.max_prompt_len = int(env_setting(self.env_config, "max_prompt_len"))
        self.max_samples = int(max_samples)
        self.model_name = os.path.basename(os.path.normpath(checkpoint)) or "policy"
        self.replica = None  # the Serve replica's tag, where one runs it
        self.lock = threading.Lock()  # the one-at-a-time path: the module's per-row state is the module's
        self.batcher = (Batcher(self.module, self.env_config, batch_rows, max_queue, batch_block) if batch_rows > 0
                        else None)
        self.chat = bool(getattr(self.tokenizer, "chat_template", None))
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
            "chat_template": self.chat,
            "batch_rows": batch_rows,
            "batch_block": batch_block if batch_rows > 0 else None,
            "device": str(device),
            "precision": precision,
            "fields": list(GenerateRequest.model_fields),
            "routes": list(ROUTES),
        }

    def describe(self) -> dict:
        """What GET /generate shows: the policy's limits, and the batch's load where it batches."""
        return {**self.info, "load": self.batcher.load() if self.batcher else None}

    def _prompt_tokens(self, text: str, item: str = "", field: str = "prompt") -> int:
        """The prompt's length in tokens; refuses unknown words and empty prompts (`item`: "[i] " in a list)."""
        encoding = self.tokenizer(text, add_special_tokens=False,
                                  return_offsets_mapping=bool(getattr(self.tokenizer, "is_fast", False)))
        unknown_pieces = unknown_words(self.tokenizer, text, encoding)
        if unknown_pieces:
            raise BadRequest(f"{field}: {item}{unknown_pieces[0]!r} is not in the task's vocabulary")
        n_tokens = len(encoding["input_ids"])
        if n_tokens == 0:
            raise BadRequest(f"{field}: {item}empty after tokenization")
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
        checked = {
            "prompts": [req.prompt],
            "prompt_truncated": n_tokens > self.max_prompt_len,
            "max_new_tokens": self._within("max_new_tokens", self.max_new_tokens if req.max_new_tokens is None
                                           else req.max_new_tokens, self.max_new_tokens),
            "n": self._within("num_samples", req.num_samples, self.max_samples),
            "greedy": req.greedy,
            "seed": self._seed(req.seed),
            "references": req.references,
            "stream": False,
        }
        refs = req.references
        meta = ({"references": refs} if refs else {}) if refs or not self.needs_references else None
        checked["completions"] = [Completion(req.prompt, checked["seed"] + j, checked["max_new_tokens"],
                                             greedy=req.greedy, meta=meta) for j in range(checked["n"])]
        return checked

    def _check_openai(self, req, prompts: list[str], max_tokens: int | None, prompt_field: str = "prompt") -> dict:
        if self.batcher is None:
            for field in ("stream", "stop", "sampler"):
                if getattr(req, field):
                    raise BadRequest(f"{field}: needs continuous batching; this server runs one request at a "
                                     f"time (started with --batch-rows 0)")
        n = self._within("n", req.n, self.max_samples)
        if len(prompts) * n > self.max_samples:
            raise BadRequest(f"{prompt_field}: {len(prompts)} prompts x n={n} = {len(prompts) * n} completions; "
                             f"at most {self.max_samples} per request (--max-samples)")
        checked = {
            "prompts": prompts,
            "model": req.model or self.model_name,
            "max_tokens": self._within("max_tokens", self.max_new_tokens if max_tokens is None else max_tokens,
                                       self.max_new_tokens),
            "temperature": req.temperature,
            "top_p": req.top_p,
            "n": n,
            "seed": self._seed(req.seed),
            "stop": tuple(req.stop or ()),
            "stream": req.stream,
            "stream_options": req.stream_options,
        }
        greedy = req.temperature < MIN_TEMPERATURE  # 0, or too small to divide float32 logits by: argmax
        sampler = tuple(req.sampler.items()) if req.sampler and req.sampler["name"] != "none" else ()
        checked["completions"] = [
            Completion(p, checked["seed"] + k, checked["max_tokens"], greedy=greedy,
                       temperature=1.0 if greedy else req.temperature, top_p=1.0 if greedy else req.top_p,
                       stop=checked["stop"], sampler=sampler) for k, p in enumerate(p for p in prompts for _ in range(n))]
        return checked

    def check_completion(self, req: CompletionRequest) -> dict:
        """The /v1/completions request with its limits checked and defaults filled in; raises BadRequest."""
        prompts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
        for i, text in enumerate(prompts):
            self._prompt_tokens(text, "" if isinstance(req.prompt, str) else f"[{i}] ")
        return self._check_openai(req, prompts, req.max_tokens)

    def check_chat(self, req: ChatRequest) -> dict:
        """The /v1/chat/completions request: its messages through the tokenizer's chat template."""
        if not self.chat:
            raise BadRequest("messages: the policy's tokenizer has no chat template, so it cannot take chat "
                             "messages; send text to /v1/completions")
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise BadRequest("max_completion_tokens: give max_tokens or max_completion_tokens, not both")
        try:
            prompt = self.tokenizer.apply_chat_template(req.messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template that raises on these messages (e.g. roles out of order)
            raise BadRequest(f"messages: the chat template refused them: {' '.join(str(e).split())[:200]}") from None
        self._prompt_tokens(prompt, field="messages")
        max_tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
        return self._check_openai(req, [prompt], max_tokens, prompt_field="messages")

    def submit(self, checked: dict, loop: asyncio.AbstractEventLoop | None = None) -> Job:
        """The checked request's completions queued for the batch's rows (raises Busy when full)."""
        return self.batcher.submit(Job(checked["completions"], stream=checked["stream"], loop=loop))

    def run(self, checked: dict) -> list[dict]:
        """The checked request's completion results, waiting for them (either path)."""
        if self.batcher is not None:
            return self.submit(checked).wait()
        with self.lock:  # one generation at a time: the module keeps per-row state
            return alone_results(self.module, self.env_config, checked["completions"])


async def replica_policy() -> Policy:
    """The `Policy` of the Serve replica answering (a FastAPI dependency; tests override it).
    A coroutine, so FastAPI calls it on the event loop rather than in its thread pool."""
    return serve.get_replica_context().servable_object.policy
