"""A finished completion handed to its job (`HandOver`): an unscored one at once, in the batch's
thread; a scored one (`/generate`: the task's reward, which may run a model) in a thread of its
own, one at a time in the order they finished, so that the batch's rows go on stepping meanwhile.
The counters (`Batcher.load`) are updated before the job hears of it."""
from __future__ import annotations

import logging
import queue
import threading

logger = logging.getLogger(__name__)


def score(scorers: dict, env_config: dict, c, prompt: str, text: str) -> float:
    """The task's reward for `text` of completion `c`, as the env of its length gives it (a dense
    reward's return is the same final metric); `scorers` keeps one env per length."""
    from env.text_env import TokenGenerationEnv

    if c.max_tokens not in scorers:
        scorers[c.max_tokens] = TokenGenerationEnv({**env_config, "max_new_tokens": c.max_tokens})
    return scorers[c.max_tokens].score([prompt], [text], [c.meta])[0]


def one_line(e: Exception) -> str:
    """An exception as one line: its type and its message's first 300 characters, spaces folded."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


class HandOver:
    """Called with a finished row (`batching._Row`), its finish reason and text. `count(outcome)`
    ("completions", "failed" or "cancelled") is called once per completion, before its job's events.
    A reward runs under the decode engine's CAPTURE_LOCK (no CUDA work while a graph is captured)."""

    def __init__(self, env_config: dict, count):
        self.env_config, self.count = dict(env_config), count
        self.scorers: dict = {}  # max_tokens -> an env scoring at that length (used in one thread only)
        self._queue: queue.Queue = queue.Queue()  # (row, reason, text) waiting for their reward; None: stop
        self._thread: threading.Thread | None = None
        self._busy = False  # the scoring thread is handing one over (set by that thread only)

    @property
    def scoring(self) -> int:
        """Completions waiting for their reward or being scored."""
        return self._queue.qsize() + self._busy

    def __call__(self, row, reason: str, text: str) -> None:
        if row.completion.meta is None:
            return self._hand_over(row, reason, text)
        if self._thread is None:  # a daemon: a process that ends does not wait for queued rewards
            self._thread = threading.Thread(target=self._work, name="scoring", daemon=True)
            self._thread.start()
        self._queue.put((row, reason, text))

    def close(self) -> None:
        """Completions still waiting for their reward fail (the replica is closing)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._fail(item[0].job, "the server closed before its reward was computed")
        if self._thread is not None:  # its thread ends (none started: nothing would take the None)
            self._queue.put(None)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            self._busy = True
            try:
                self._hand_over(*item)
            except Exception as e:  # not the reward's (that fails its job alone): logged, and its job fails
                logger.exception("handing a completion over failed")
                self._fail(item[0].job, f"internal error: {one_line(e)}")
            finally:
                self._busy = False

    def _fail(self, job, message: str) -> None:
        self.count("failed")
        job._fail(message)
        job.cancel()  # its other rows are freed at the next block

    def _hand_over(self, row, reason: str, text: str) -> None:
        """The rest of a streamed text, then the result, with its reward where it is scored; a
        reward that fails fails its job alone."""
        from agents.modules.decode_engine import CAPTURE_LOCK

        job, c = row.job, row.completion
        if job.error is not None or job.cancelled:  # while its reward waited
            return self.count("failed" if job.error is not None else "cancelled")
        try:
            if c.meta is None:
                reward = None
            else:
                with CAPTURE_LOCK:
                    reward = score(self.scorers, self.env_config, c, row.prompt, text)
        except Exception as e:
            return self._fail(job, f"reward: {one_line(e)}")
        with job._lock:  # a job failed meanwhile (the batch failed) gets nothing more, counted failed
            if job.error is not None:
                return self.count("failed")
            self.count("completions")
            if job.stream and text.startswith(row.sent) and len(text) > len(row.sent):
                job._emit("delta", row.index, text[len(row.sent):])
            job._finish(row.index, {"text": text, "finish_reason": reason, "num_generated": len(row.tokens),
                                    "prompt": row.prompt, "prompt_tokens": row.prompt_tokens, "reward": reward})
