"""A finished completion handed to its job (`HandOver`): an unscored one at once, in the batch's
thread; a scored one (`/generate`: the task's reward, which may run a model) in a thread of its
own, one at a time in the order they finished, so that the batch's rows go on stepping meanwhile.
The counters (`Batcher.load`) are updated before the job hears of it."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


def score(scorers: dict, env_config: dict, c, prompt: str, text: str) -> float:
    """The task's reward for `text` of completion `c`, as the env of its length gives it (a dense
    reward's return is the same final metric); `scorers` keeps one env per length."""
    from env.text_env import TokenGenerationEnv

    if c.max_tokens not in scorers:
        scorers[c.max_tokens] = TokenGenerationEnv({**env_config, "max_new_tokens": c.max_tokens})
    return scorers[c.max_tokens].score([prompt], [text], [c.meta])[0]


class HandOver:
    """Called with a finished row (`batching._Row`), its finish reason and text. `count(outcome)`
    ("completions", "failed" or "cancelled") is called once per completion, before its job's events."""

    def __init__(self, env_config: dict, count):
        self.env_config, self.count = dict(env_config), count
        self.scorers: dict = {}  # max_tokens -> an env scoring at that length (used in one thread only)
        self._pool: ThreadPoolExecutor | None = None

    def __call__(self, row, reason: str, text: str) -> None:
        if row.completion.meta is None:
            return self._hand_over(row, reason, text)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scoring")
        self._pool.submit(self._hand_over, row, reason, text)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _hand_over(self, row, reason: str, text: str) -> None:
        """The rest of a streamed text, then the result, with its reward where it is scored; a
        reward that fails fails its job alone (its other rows are freed at the next block)."""
        job, c = row.job, row.completion
        if job.error is not None or job.cancelled:  # while its reward waited
            return self.count("failed" if job.error is not None else "cancelled")
        try:
            reward = None if c.meta is None else score(self.scorers, self.env_config, c, row.prompt, text)
        except Exception as e:
            self.count("failed")
            job._fail(f"reward: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
            job.cancel()
            return
        self.count("completions")
        if job.stream and text.startswith(row.sent) and len(text) > len(row.sent):
            job._emit("delta", row.index, text[len(row.sent):])
        job._finish(row.index, {"text": text, "finish_reason": reason, "num_generated": len(row.tokens),
                                "prompt": row.prompt, "prompt_tokens": row.prompt_tokens, "reward": reward})
