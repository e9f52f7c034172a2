"""The policy in one Serve replica: `Policy` (a checkpoint loaded once) checks requests against
its limits and generates for them with `agents.generate.generate` (`run_request`, `run_completion`);
`replica_policy` is the FastAPI dependency that gives the routes the answering replica's `Policy`.

Generation runs the checkpoint's own environment, so the policy acts exactly as in training
(the package's docstring says what that means for a reply).

Nothing here needs Ray but `replica_policy`: a `Policy` is usable and testable in-process.
"""
from __future__ import annotations

import os
import secrets
import threading
import time

from ray import serve

from agents.serve.requests import MAX_SEED, ROUTES, BadRequest, CompletionRequest, GenerateRequest
from env.text_env import env_setting


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
        self.max_new_tokens = int(env_setting(self.env_config, "max_new_tokens"))
        self.max_prompt_len = int(env_setting(self.env_config, "max_prompt_len"))
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


def replica_policy() -> Policy:
    """The `Policy` of the Serve replica answering (a FastAPI dependency; tests override it)."""
    return serve.get_replica_context().servable_object.policy
