"""The replies of the three generation routes, built from a request's completion results (see
`agents.serve.batching.Job` for a result's fields): /generate's JSON, OpenAI's `text_completion`
and `chat.completion` objects, their streamed chunks as server-sent events, and OpenAI's error
object. No Ray, no model."""
from __future__ import annotations

import json
import secrets
import time

KINDS = ("generate", "completion", "chat")


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{secrets.token_hex(12)}"


def usage(results: list[dict], n: int) -> dict:
    """OpenAI's usage: each prompt counted once (results are prompt-major, `n` per prompt), every
    token the policy wrote (EOS included)."""
    prompt_tokens = sum(r["prompt_tokens"] for r in results[::n])
    completion_tokens = sum(r["num_generated"] for r in results)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def reply(kind: str, checked: dict, results: list[dict]) -> dict:
    """The whole reply of a request (`checked`: the policy's checked request)."""
    if kind == "generate":
        return {"prompt": results[0]["prompt"], "prompt_truncated": checked["prompt_truncated"],
                "max_new_tokens": checked["max_new_tokens"], "greedy": checked["greedy"], "seed": checked["seed"],
                "generations": [{"text": r["text"], "reward": r["reward"]} for r in results]}
    if kind == "chat":
        choices = [{"index": i, "message": {"role": "assistant", "content": r["text"]}, "logprobs": None,
                    "finish_reason": r["finish_reason"]} for i, r in enumerate(results)]
    else:
        choices = [{"text": r["text"], "index": i, "logprobs": None, "finish_reason": r["finish_reason"]}
                   for i, r in enumerate(results)]
    return {"id": new_id(kind), "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": checked["model"], "choices": choices,
            "usage": usage(results, checked["n"])}


def sse(data) -> str:
    """One server-sent event carrying `data` (JSON, or the literal [DONE])."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class Chunks:
    """A streamed reply's events, OpenAI's chunk format: `text_completion` chunks (chat:
    `chat.completion.chunk`s, each choice opening with its role), one per text delta, one per
    choice with its finish_reason, the usage where asked, then [DONE]."""

    def __init__(self, kind: str, checked: dict):
        self.kind, self.checked = kind, checked
        self.id, self.created = new_id(kind), int(time.time())

    def _chunk(self, choices: list[dict], **extra) -> str:
        chat = self.kind == "chat"
        return sse({"id": self.id, "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": self.created, "model": self.checked["model"], "choices": choices, **extra})

    def _choice(self, index: int, text: str | None, finish_reason: str | None) -> dict:
        if self.kind == "chat":
            delta = {} if text is None else {"content": text}
            return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"text": text or "", "index": index, "logprobs": None, "finish_reason": finish_reason}

    def opening(self) -> list[str]:
        """Chat: a first chunk per choice with the assistant's role (OpenAI's clients expect it)."""
        if self.kind != "chat":
            return []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for i in range(self.choices)]

    @property
    def choices(self) -> int:
        return len(self.checked["prompts"]) * self.checked["n"]

    def delta(self, index: int, text: str) -> str:
        return self._chunk([self._choice(index, text, None)])

    def finish(self, index: int, finish_reason: str) -> str:
        return self._chunk([self._choice(index, None, finish_reason)])

    def closing(self, results: list[dict]) -> list[str]:
        out = []
        if (self.checked.get("stream_options") or {}).get("include_usage"):
            out.append(self._chunk([], usage=usage(results, self.checked["n"])))
        return out + [sse("[DONE]")]


ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error"}


def openai_error(message: str, status: int) -> dict:
    """OpenAI's error object for the one-line `message` ("<field>: <what is wrong>")."""
    field = message.split(":", 1)[0] if ":" in message else None
    param = None if field in (None, "request body", "internal error", "server busy", "path", "method") else field
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": None}}
