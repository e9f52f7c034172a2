"""Continuous batching in one replica: `Batcher` keeps one batch of `rows` rows of the policy
stepping, one token per step, in a thread of its own.

A request is a `Job` of one or more `Completion`s (a prompt, a seed and its own sampling
parameters). Each completion waits in a bounded queue for a free row; at the next step boundary
it takes the row (its environment reset with the prompt: the row restarts, so the policy's KV
cache prefills it), and when it finishes (EOS, its `max_tokens`, one of its stop strings, or its
job cancelled) its text goes back to the job and the row is free for the next completion. A full
queue refuses a job at once (`Busy`: HTTP 429).

Every row starts in the checkpoint's own environment (`env.text_env.TokenGenerationEnv` with the
policy's `max_new_tokens`, so all rows share one window shape: the prompt's encoding, its
truncation and the window), and its window grows as the env's observation does, as
`agents.generate.generate` runs it: completion i of a request is reset with seed + i and draws
from its own generator seeded with seed + i (one uniform per token); idle rows repeat their last
token and their outputs are ignored. What a row computes depends only on its own window, so a
completion's text is the one it gets when it runs alone (tested); the only difference from
running alone is the order of float sums in the KV cache's attention, which a sampled token
does not feel in practice.

A `Job` hands its events to one consumer: an asyncio loop (the HTTP routes, through
`events()`) or a thread (`wait()`).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import queue
import threading

import numpy as np
import torch

logger = logging.getLogger(__name__)


class Busy(RuntimeError):
    """The queue is full: the request is refused at once (HTTP 429)."""


@dataclasses.dataclass(frozen=True)
class Completion:
    """One completion of a request: the prompt, its seed and sampling parameters. `meta` is the
    task's metadata for a scored completion (/generate); None leaves the completion unscored."""

    prompt: str
    seed: int
    max_tokens: int
    greedy: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    meta: dict | None = None
    sampler: tuple = ()  # a truncation sampler's (key, value) items, name first; () for none


class Job:
    """A request's completions as they are generated. Events, in order: ("delta", i, text) for a
    streaming job (text as it grows, stop strings held back), ("finish", i, result) once per
    completion, then ("done", None, None); or ("error", None, message) if the batch failed.
    A result is {"text", "finish_reason" ("stop" | "length" | "cancelled"), "num_generated"
    (EOS included), "prompt" (as the policy saw it), "prompt_tokens", "reward"}."""

    def __init__(self, completions: list[Completion], stream: bool = False,
                 loop: asyncio.AbstractEventLoop | None = None):
        if not completions:
            raise ValueError("a job needs at least one completion")
        self.completions = list(completions)
        self.stream = stream
        self.results: list[dict | None] = [None] * len(completions)
        self.cancelled = False
        self.error: str | None = None
        self._loop = loop
        self._events = asyncio.Queue() if loop is not None else queue.Queue()

    def cancel(self) -> None:
        """The client went away: the job's rows are freed at the next step boundary."""
        self.cancelled = True

    def _emit(self, kind: str, index, value) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, index, value))
        else:
            self._events.put((kind, index, value))

    def _finish(self, index: int, result: dict) -> None:
        self.results[index] = result
        self._emit("finish", index, result)
        if all(r is not None for r in self.results):
            self._emit("done", None, None)

    def _fail(self, message: str) -> None:
        if self.error is None and not all(r is not None for r in self.results):
            self.error = message
            self._emit("error", None, message)

    async def events(self):
        """The job's events, as an async iterator (for a job made with an event loop)."""
        async for batch in self.event_batches():
            for event in batch:
                yield event

    async def event_batches(self):
        """The job's events as lists: each the next event and those already waiting behind it (a
        stream writes them in one piece: fewer, larger writes when the server is busy)."""
        while True:
            batch = [await self._events.get()]
            while not self._events.empty():
                batch.append(self._events.get_nowait())
            yield batch
            if batch[-1][0] in ("done", "error"):
                return

    def wait(self, timeout: float | None = None) -> list[dict]:
        """Blocks until every completion finished (a job made without a loop); its results.
        Raises RuntimeError if the batch failed, TimeoutError after `timeout` seconds."""
        while True:
            try:
                kind, _, value = self._events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"the job did not finish in {timeout} s") from None
            if kind == "error":
                raise RuntimeError(value)
            if kind == "done":
                return list(self.results)


def stop_position(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the first stop string begins in `text`, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could begin a stop string (not sent yet)."""
    for n in range(min(len(text), max((len(s) for s in stops), default=0)), 0, -1):
        if any(s.startswith(text[-n:]) for s in stops):
            return n
    return 0


def request_sampler_mask(logits: torch.Tensor, row) -> torch.Tensor:
    """`logits` (one row, the policy's own sampler applied) with the row's requested sampler's mask
    on top; mirostat's mu is the row's own."""
    from agents.samplers import MASKED, SAMPLERS, mirostat_mask

    spec = dict(row.completion.sampler)
    name = spec.pop("name")
    if name == "mirostat":
        if row.mu is None:
            row.mu = torch.full((1,), 2.0 * spec["tau"], device=logits.device)  # stays where the draws run
        keep = mirostat_mask(logits, row.mu)
    else:
        fn, names = SAMPLERS[name]
        keep = fn(logits, *(spec[n] for n in names))
    return logits.masked_fill(~keep, MASKED)


def draw(logits: torch.Tensor, rows: dict) -> dict[int, int]:
    """Each row's token (rows: batch index -> `_Row`): argmax, or drawn at one uniform from the
    row's own generator (`agents.generate.draw_rows`, inverting the cumulative distribution where
    the logits are) from the policy's distribution with the row's requested sampler's mask,
    warped by its temperature and top_p: the draws `agents.generate.generate` makes, so a
    completion's text is the same with or without continuous batching."""
    from agents.generate import draw_rows
    from agents.samplers import mirostat_update

    out = {}
    greedy = logits.argmax(-1).tolist()
    sampled = [i for i, row in rows.items() if not row.completion.greedy]
    if sampled:
        c = [rows[i].completion for i in sampled]
        warped = logits[torch.tensor(sampled, device=logits.device)]
        for j, i in enumerate(sampled):
            if c[j].sampler:
                warped[j] = request_sampler_mask(warped[j:j + 1], rows[i])[0]
        temperature, top_p = 1.0, 1.0
        if any(x.temperature != 1.0 or x.top_p < 1.0 for x in c):
            temperature, top_p = (torch.tensor([[getattr(x, name)] for x in c], dtype=logits.dtype,
                                               device=logits.device) for name in ("temperature", "top_p"))
        tokens = draw_rows(warped, [rows[i].generator for i in sampled], temperature, top_p)
        for i, token in zip(sampled, tokens):
            out[i] = token
            row = rows[i]
            if row.mu is not None:  # mirostat: mu follows the surprise of the token under the policy
                spec = dict(row.completion.sampler)
                surprise = -torch.log_softmax(logits[i], -1)[token] / math.log(2)
                row.mu = mirostat_update(row.mu, surprise, spec["tau"], spec["learning_rate"])
    for i in rows:
        out.setdefault(i, greedy[i])
    return out


def score(scorers: dict, env_config: dict, c: Completion, prompt: str, text: str) -> float:
    """The task's reward for `text`, as the env of the completion's length gives it (a dense
    reward's return is the same final metric); `scorers` keeps one env per length."""
    from env.text_env import TokenGenerationEnv

    if c.max_tokens not in scorers:
        scorers[c.max_tokens] = TokenGenerationEnv({**env_config, "max_new_tokens": c.max_tokens})
    return scorers[c.max_tokens].score([prompt], [text], [c.meta])[0]


@dataclasses.dataclass
class _Row:
    job: Job
    index: int
    completion: Completion
    generator: torch.Generator
    prompt: str
    prompt_tokens: int
    tokens: list = dataclasses.field(default_factory=list)
    mu: torch.Tensor | None = None  # a requested mirostat sampler's state
    sent: str = ""  # the text a streaming job was sent so far


class Batcher:
    """`rows` rows of `module` stepping together in a thread (see the module docstring).
    `max_queue`: completions that may wait for a row; `submit` refuses a job (Busy) beyond it."""

    def __init__(self, module, env_config: dict, rows: int = 16, max_queue: int = 256):
        from agents.generate import policy_device
        from env.text_env import TokenGenerationEnv

        if rows < 1 or max_queue < 0:
            raise ValueError(f"Batcher: rows must be >= 1 and max_queue >= 0, got {rows} and {max_queue}")
        self.module, self.env_config = module, dict(env_config)
        self.rows, self.max_queue = int(rows), int(max_queue)
        self.env = TokenGenerationEnv(self.env_config)  # resets a row's window (the rows' windows live in obs)
        self.device = policy_device(module)
        self.eos_id, self.tokenizer = self.env.eos_id, self.env.tokenizer
        self.max_new_tokens = self.env.max_new_tokens
        self._scorers: dict[int, TokenGenerationEnv] = {}  # max_tokens -> an env scoring at that length
        self.slots: list[_Row | None] = [None] * self.rows
        self.obs: dict[str, np.ndarray] | None = None
        self.cont = np.zeros(self.rows, dtype=bool)
        self.waiting: collections.deque = collections.deque()  # (job, index) not yet in a row
        self.cv = threading.Condition()
        self.stats = {"steps": 0, "tokens": 0, "completions": 0, "cancelled": 0, "refused": 0, "max_active": 0}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.on_step = None  # called after each step, in the batch's thread (tests pause it here)

    # -- the consumers' side (any thread) ------------------------------------------------------

    def submit(self, job: Job) -> Job:
        """Queues the job's completions for rows; raises Busy when they would leave more than
        `max_queue` completions waiting for a row."""
        with self.cv:
            waiting = len(self.waiting) + len(job.completions) - len(self._free_rows())
            if waiting > self.max_queue:
                self.stats["refused"] += 1
                raise Busy(f"server busy: {len(self.waiting)} completions are waiting for one of the "
                           f"{self.rows} rows (--max-queue {self.max_queue}); retry later")
            self.waiting.extend((job, i) for i in range(len(job.completions)))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="batcher", daemon=True)
                self._thread.start()
            self.cv.notify()
        return job

    def load(self) -> dict:
        """Rows in use and completions waiting, with the counters since the start."""
        with self.cv:
            return {"rows": self.rows, "active": sum(s is not None for s in self.slots),
                    "waiting": len(self.waiting), "max_queue": self.max_queue, **self.stats}

    def close(self) -> None:
        with self.cv:
            self._stopping = True
            self.cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # -- the batch (its own thread) ------------------------------------------------------------

    def _free_rows(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s is None]

    def _run(self) -> None:
        while True:
            with self.cv:
                self._drop_cancelled()
                while not self._stopping and not self.waiting and all(s is None for s in self.slots):
                    self.cv.wait()
                if self._stopping:
                    return
                admitted = self._admit()
            try:
                for i, job, index, completion in admitted:
                    self._start_row(i, job, index, completion)
                if any(s is not None for s in self.slots):
                    self.step()
            except Exception as e:  # a bug or a task failure: fail what is running, keep serving
                logger.exception("the batch failed")
                self._fail_all(f"internal error: {type(e).__name__}: {' '.join(str(e).split())[:300]}")

    def _drop_cancelled(self) -> None:
        for i, row in enumerate(self.slots):
            if row is not None and row.job.cancelled:
                self._end(i, "cancelled")
        if any(job.cancelled for job, _ in self.waiting):
            dropped = [(j, k) for j, k in self.waiting if j.cancelled]
            self.waiting = collections.deque((j, k) for j, k in self.waiting if not j.cancelled)
            self.stats["cancelled"] += len(dropped)

    def _admit(self) -> list:
        admitted = []
        for i in self._free_rows():
            if not self.waiting:
                break
            job, index = self.waiting.popleft()
            admitted.append((i, job, index, job.completions[index]))
        return admitted

    def _start_row(self, i: int, job: Job, index: int, c: Completion) -> None:
        try:
            obs, info = self.env.reset(seed=c.seed, options={"prompt": c.prompt, "meta": c.meta or {},
                                                                 "score": False})
        except ValueError as e:  # checked before submit; kept from failing the batch all the same
            job._fail(f"prompt: {e}")
            return
        if self.obs is None:  # the first row: every row's window starts as a copy of it
            self.obs = {k: np.repeat(v[None], self.rows, axis=0) for k, v in obs.items()}
        for k, v in obs.items():
            self.obs[k][i] = v
        self.cont[i] = False
        self.slots[i] = _Row(job, index, c, torch.Generator().manual_seed(c.seed), info["prompt"],
                             len(self.env.prompt_ids))

    @torch.no_grad()
    def step(self) -> None:
        """One token for every row in use (idle rows step too, their outputs ignored)."""
        from ray.rllib.core.columns import Columns

        from agents.core import ROW_CONTINUES

        # observations on the policy's device; which rows continue stays on the CPU (the caches
        # branch on it with no device sync); the draws run on the device, one uniform per row from
        # its CPU generator going there and its token coming back (`draw`)
        batch = {Columns.OBS: {k: torch.from_numpy(v.copy()).to(self.device) for k, v in self.obs.items()},
                 ROW_CONTINUES: torch.from_numpy(self.cont.copy())}
        # the module's own step where it has one (RLlib's forward_inference flips train/eval each call)
        act = getattr(self.module, "act", None)
        out = act(batch, explore=False) if act is not None else self.module.forward_inference(batch)
        logits = out[Columns.ACTION_DIST_INPUTS].float()
        self.cont[:] = True
        active = [i for i, s in enumerate(self.slots) if s is not None]
        self.stats["steps"] += 1
        self.stats["max_active"] = max(self.stats["max_active"], len(active))
        actions = draw(logits, {i: self.slots[i] for i in active})
        # Every window appends its row's token (an idle row repeats its last), as the env's
        # observation does: the prompt and generated tokens right-aligned in a window that holds them all.
        ids, mask = self.obs["input_ids"], self.obs["attention_mask"]
        tokens = ids[:, -1].copy()
        tokens[active] = [actions[i] for i in active]
        ids[:, :-1] = ids[:, 1:]
        ids[:, -1] = tokens
        mask[:, :-1] = mask[:, 1:]
        mask[:, -1] = 1
        self.stats["tokens"] += len(active)
        for i in active:
            self._after_token(i, actions[i])
        if self.on_step is not None:
            self.on_step()

    def _text(self, i: int) -> str:
        """Row i's text so far, as its env writes it."""
        return self.tokenizer.decode(self.slots[i].tokens, skip_special_tokens=True)

    def _after_token(self, i: int, action: int) -> None:
        row = self.slots[i]
        c = row.completion
        row.tokens.append(action)
        text = None
        if c.stop or row.job.stream:
            text = self._text(i)
            cut = stop_position(text, c.stop) if c.stop else None
            if cut is not None:
                return self._end(i, "stop", text[:cut])
        if action == self.eos_id:
            return self._end(i, "stop", text)
        if len(row.tokens) >= min(c.max_tokens, self.max_new_tokens):
            return self._end(i, "length", text)
        if row.job.stream:
            ready = text[:len(text) - held_back(text, c.stop)] if c.stop else text
            if ready.startswith(row.sent) and len(ready) > len(row.sent):
                row.job._emit("delta", row.index, ready[len(row.sent):])
                row.sent = ready

    def _end(self, i: int, reason: str, text: str | None = None) -> None:
        row = self.slots[i]
        text = self._text(i) if text is None and reason != "cancelled" else text
        self.slots[i] = None
        if reason == "cancelled":
            self.stats["cancelled"] += 1
            return
        self.stats["completions"] += 1
        if row.job.stream and text.startswith(row.sent) and len(text) > len(row.sent):
            row.job._emit("delta", row.index, text[len(row.sent):])
        c = row.completion
        reward = None if c.meta is None else score(self._scorers, self.env_config, c, row.prompt, text)
        row.job._finish(row.index, {"text": text, "finish_reason": reason, "num_generated": len(row.tokens),
                                    "prompt": row.prompt, "prompt_tokens": row.prompt_tokens, "reward": reward})

    def _fail_all(self, message: str) -> None:
        with self.cv:
            jobs = {id(s.job): s.job for s in self.slots if s is not None}
            jobs.update({id(j): j for j, _ in self.waiting})
            self.slots = [None] * self.rows
            self.waiting.clear()
            self.cont[:] = False  # every row restarts: nothing cached is trusted
        for job in jobs.values():
            job._fail(message)
