"""Continuous batching in one replica: `Batcher` keeps one batch of `rows` rows of the policy
stepping, a block of `block` tokens at a time, in a thread of its own.

A request is a `Job` of one or more `Completion`s (a prompt, a seed and its own sampling
parameters). Each completion waits in a bounded queue for a free row; at the next block boundary
it takes the row (its environment reset with the prompt: the row restarts, so the policy's KV
cache prefills it), and when it finishes (EOS, its `max_tokens`, one of its stop strings, or its
job cancelled) the row is free for the next completion and its text goes back to the job (a scored
one's with its reward, computed in a thread of its own: `scoring.HandOver`). A full
queue refuses a job at once (`Busy`: HTTP 429).

Every row starts in the checkpoint's own environment (`env.text_env.TokenGenerationEnv` with the
policy's `max_new_tokens`, so all rows share one window shape: the prompt's encoding, its
truncation and the window), and its window grows as the env's observation does, as
`agents.generate.generate` runs it: completion i of a request is reset with seed + i and draws
from its own generator seeded with seed + i (one uniform per token); idle rows step too and their
outputs are ignored. What a row computes depends only on its own window, so a completion's text is
the one it gets when it runs alone (tested); the only difference from running alone is the order
of float sums in the KV cache's attention, which a sampled token does not feel in practice.

A block is the decode engine's (`agents.modules.decoding.rows_block`): its first step (rows that
joined prefilled in it), then its other steps as one static function, each step's head, each row's
requested sampler, temperature, top_p and draw inside (`agents.samplers.row_tokens`, per-row
settings as tensors): CUDA graphs on a GPU, one host read of the tokens per block. A row that
finishes mid-block (EOS, its length, a stop string) drops the block's later tokens; streamed text
and cancellations take effect between blocks, so where every row in use has just joined (an idle
replica; also one row, or rows that all ended together) and one streams, the block is one step.
Where a block cannot run (a policy whose sampler is
mirostat or NLPO's learned mask, a module without the engine, a row requesting mirostat, whose mu
follows each token) the batch steps one token per call with the same tail.

A `Job` hands its events to one consumer: an asyncio loop (the HTTP routes, through
`events()`) or a thread (`wait()`).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import queue
import threading

import numpy as np
import torch

from agents.samplers import row_tokens
from agents.serve.scoring import HandOver, one_line
from agents.serve.row_sampling import mirostat_rows, requests_mirostat, row_inputs, row_uniforms, update_mirostat
from agents.serve.options import BATCH_BLOCK  # decode steps per block (defined with the CLI's other defaults)

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
        self._lock = threading.RLock()  # the batch's thread and the scoring one both send events

    def cancel(self) -> None:
        """The client went away: the job's rows are freed at the next block boundary."""
        self.cancelled = True

    def _emit(self, kind: str, index, value) -> None:
        with self._lock:
            if self.error is not None and kind != "error":  # a failed job's other rows: nothing after its error
                return
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, index, value))
            else:
                self._events.put((kind, index, value))

    def _finish(self, index: int, result: dict) -> None:
        with self._lock:
            self.results[index] = result
            self._emit("finish", index, result)
            if all(r is not None for r in self.results):
                self._emit("done", None, None)

    def _fail(self, message: str) -> None:
        with self._lock:
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


def blocks_apply(module, slots: list) -> bool:
    """Whether the batch's next step can be a block on the decode engine: a policy whose greedy
    step after the trunk is static (`acting.static_rollout_step`), and no row in use (`slots`)
    requesting mirostat (its mu follows each token: those steps go one call at a time)."""
    from agents.modules.acting import Acting, static_rollout_step

    return (isinstance(module, Acting) and static_rollout_step(module, explore=False)
            and not any(requests_mirostat(row.completion) for row in slots if row is not None))


@torch.no_grad()
def next_tokens(module, slots: list, obs: dict, cont: np.ndarray, block: int, device: torch.device,
                queued: bool = False) -> torch.Tensor:
    """The rows' next tokens (steps, rows) on the host: a block of up to `block` steps on the decode
    engine (`decoding.rows_block`) where `blocks_apply`, else one step, the module's own call with
    the same tail (`samplers.row_tokens`; a mirostat request's mask and mu row by row). `obs`: the
    rows' windows (numpy); `cont`: which rows continue the last step's (the others restart)."""
    from ray.rllib.core.columns import Columns

    from agents.core import ROW_CONTINUES
    from agents.modules.decoding import rows_block

    blocks = blocks_apply(module, slots)
    used = [i for i, row in enumerate(slots) if row is not None]
    if not cont[used].any() and any(slots[i].job.stream for i in used):  # an idle replica's first text
        block = 1  # after one step
    # a block fits the window, and takes no step after every row's last
    lefts = [slots[i].tokens_left for i in used]
    left = min(lefts) if queued else max(lefts)
    k = min(block, obs["input_ids"].shape[1] - 1, left) if blocks else 1
    engine = getattr(getattr(module, "kv_cache", None), "engine", None)
    captured = engine.capture if engine is not None else device.type == "cuda"
    per_row, spec = row_inputs(slots, device, subsets=not captured)
    uniforms = row_uniforms(slots, k, device)
    # observations on the policy's device; which rows continue stays on the CPU (the caches branch
    # on it with no device sync)
    batch = {Columns.OBS: {name: torch.from_numpy(v.copy()).to(device) for name, v in obs.items()},
             ROW_CONTINUES: torch.from_numpy(cont.copy())}
    if blocks:  # the head, each row's sampler and draw inside the engine's static steps
        if module.training:
            module.eval()
        return rows_block(module, batch[Columns.OBS], batch[ROW_CONTINUES], per_row, uniforms, spec).cpu()
    act = getattr(module, "act", None)  # RLlib's forward_inference flips train/eval each call
    logits = (act(batch, explore=False) if act is not None else module.forward_inference(batch))[
        Columns.ACTION_DIST_INPUTS].float()
    miro = {i: row for i, row in enumerate(slots) if row is not None and requests_mirostat(row.completion)}
    tokens = row_tokens(mirostat_rows(logits, miro) if miro else logits, uniforms[0], *per_row, **spec).cpu()
    update_mirostat(logits, miro, tokens.tolist())
    return tokens[None]


def steps_row_prefixes(module, rows: int) -> bool:
    """Whether a batch of `rows` rows of `module` may step only its first rows in use: where the
    decode engine keeps the other rows' keys and values. Then the module's caches (its mask LM's
    too) and its stateful sampler's per-row state are told to take calls over any number of their
    first rows, continuing the rows the batch says (`engine_rows`, `row_prefixes`)."""
    cache = getattr(module, "kv_cache", None)
    if not (hasattr(cache, "steps_row_prefixes") and cache.steps_row_prefixes(module._trunk(module.lm))):
        return False
    for c in (cache, getattr(module, "mask_kv_cache", None)):
        if hasattr(c, "engine_rows"):
            c.engine_rows = rows
    if getattr(module, "row_sampler_state", None) is not None:
        module.row_sampler_state.row_prefixes = True
    return True


def append_windows(obs: dict, tokens: np.ndarray) -> None:
    """Appends each row's tokens ((steps, rows)) to its window in `obs` in place, as the env's
    observation does: the prompt and generated tokens right-aligned in a window that holds them all."""
    k = len(tokens)
    ids, mask = obs["input_ids"], obs["attention_mask"]
    ids[:, :-k] = ids[:, k:].copy()
    ids[:, -k:] = tokens.T
    mask[:, :-k] = mask[:, k:].copy()
    mask[:, -k:] = 1


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
    limit: int = 0  # the most tokens it may write (its max_tokens, within the policy's max_new_tokens)

    @property
    def tokens_left(self) -> int:
        return self.limit - len(self.tokens)

    def text(self, tokenizer) -> str:
        """The text so far, as the env writes it."""
        return tokenizer.decode(self.tokens, skip_special_tokens=True)

    def append(self, token: int, tokenizer, eos_id: int) -> tuple[str, str | None] | None:
        """Appends a drawn token: (finish reason, text or None) where the completion ends with it;
        else None, a streaming job sent what of its text the next tokens cannot change."""
        c = self.completion
        self.tokens.append(token)
        text = None
        if c.stop or self.job.stream:
            text = self.text(tokenizer)
            cut = stop_position(text, c.stop) if c.stop else None
            if cut is not None:
                return "stop", text[:cut]
        if token == eos_id:
            return "stop", text
        if self.tokens_left <= 0:
            return "length", text
        if self.job.stream:  # a trailing U+FFFD: a character whose bytes are not all written yet
            ready = (text[:len(text) - held_back(text, c.stop)] if c.stop else text).rstrip("\ufffd")
            if getattr(tokenizer, "clean_up_tokenization_spaces", False):  # "do n" + "'t" decodes as "don't":
                ready = ready[:max(ready.rfind(" "), 0)]  # the last space and word wait for the next token
            if ready.startswith(self.sent) and len(ready) > len(self.sent):
                self.job._emit("delta", self.index, ready[len(self.sent):])
                self.sent = ready
        return None


class Batcher:
    """`rows` rows of `module` stepping together in a thread (see the module docstring).
    `max_queue`: completions that may wait for a row; `submit` refuses a job (Busy) beyond it."""

    def __init__(self, module, env_config: dict, rows: int = 16, max_queue: int = 256, block: int = BATCH_BLOCK):
        from agents.generate import policy_device
        from env.text_env import TokenGenerationEnv

        if rows < 1 or max_queue < 0 or block < 1:
            raise ValueError(f"Batcher: rows and block must be >= 1 and max_queue >= 0, got {rows}, {block} "
                             f"and {max_queue}")
        self.module, self.env_config = module, dict(env_config)
        self.rows, self.max_queue, self.block = int(rows), int(max_queue), int(block)
        self.env = TokenGenerationEnv(self.env_config)  # resets a row's window (the rows' windows live in obs)
        self.device = policy_device(module)
        self.eos_id, self.tokenizer, self.max_new_tokens = self.env.eos_id, self.env.tokenizer, self.env.max_new_tokens
        self.hand_over = HandOver(self.env_config, self._count)  # a finished completion to its job
        self.slots: list[_Row | None] = [None] * self.rows
        self.obs: dict[str, np.ndarray] | None = None
        self.cont = np.zeros(self.rows, dtype=bool)
        self.waiting: collections.deque = collections.deque()  # (job, index) not yet in a row
        self.cv = threading.Condition()
        # tokens: kept; dropped: drawn in a block after their row's completion ended
        self.stats = dict.fromkeys(("steps", "blocks", "tokens", "dropped", "completions", "cancelled", "failed", "refused",
                                    "max_active"), 0)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._starting = 0  # completions taken from the queue whose rows are being started
        self.prefixes = steps_row_prefixes(module, self.rows)  # steps only its first rows in use
        self.on_step = None  # called after each block, in the batch's thread (tests pause it here)

    # -- the consumers' side (any thread) ------------------------------------------------------

    def submit(self, job: Job) -> Job:
        """Queues the job's completions for rows; raises Busy when they would leave more than
        `max_queue` completions waiting for a row."""
        with self.cv:
            if len(self.waiting) + len(job.completions) - self._open_rows() > self.max_queue:
                self.stats["refused"] += 1
                raise Busy(f"server busy: {self._queued()} completions are waiting for one of the {self.rows} rows, "
                           f"and this request's {len(job.completions)} would pass --max-queue {self.max_queue}; retry later")
            self.waiting.extend((job, i) for i in range(len(job.completions)))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="batcher", daemon=True)
                self._thread.start()
            self.cv.notify()
        return job

    def load(self) -> dict:
        """Rows in use and completions waiting, the counters since the start, the engine's captures."""
        engine = getattr(getattr(self.module, "kv_cache", None), "engine", None)
        with self.cv:
            return {"rows": self.rows, "active": self.rows - self._open_rows(),
                    "waiting": self._queued(), "max_queue": self.max_queue, "scoring": self.hand_over.scoring,
                    **self.stats, "graphs_captured": getattr(engine, "captures", 0)}

    def close(self) -> None:
        with self.cv:
            self._stopping = True
            self.cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.hand_over.close()

    # -- the batch (its own thread) ------------------------------------------------------------

    def _open_rows(self) -> int:  # rows free and not taken by a completion about to start in them
        return self.slots.count(None) - self._starting

    def _queued(self) -> int:
        """Completions waiting for a row (the ones open rows take at the next block are not)."""
        return max(0, len(self.waiting) - self._open_rows())

    def _lost(self, job: Job) -> None:
        """Counts a completion of `job` that ends unfinished: failed with its job, else cancelled."""
        self._count("failed" if job.error is not None else "cancelled")

    def _count(self, outcome: str) -> None:  # from the batch's thread or the scoring one
        with self.cv:
            self.stats[outcome] += 1

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
                self._start(admitted)
                if any(s is not None for s in self.slots):
                    self.step()
            except Exception as e:  # a bug or a task failure: fail what is running, keep serving
                logger.exception("the batch failed")
                self._fail_all(f"internal error: {one_line(e)}",
                               [job for _, job, _, _ in admitted])  # taken from the queue, not started

    def _drop_cancelled(self) -> None:
        for i, row in enumerate(self.slots):
            if row is not None and row.job.cancelled:
                self._end(i, "cancelled")
        if any(job.cancelled for job, _ in self.waiting):
            for job in [j for j, _ in self.waiting if j.cancelled]:
                self._lost(job)
            self.waiting = collections.deque((j, k) for j, k in self.waiting if not j.cancelled)

    def _admit(self) -> list:
        """Takes the queue's first completions, one for each free row: [(row, job, index, completion)]."""
        free = [i for i, s in enumerate(self.slots) if s is None]
        taken = [self.waiting.popleft() for _ in free[:len(self.waiting)]]
        self._starting = len(taken)  # their rows are not open to a submit's count until they start
        return [(i, job, k, job.completions[k]) for i, (job, k) in zip(free, taken)]

    def _start(self, admitted: list) -> None:
        """Starts `_admit`'s completions in their rows, popping each from `admitted` once started; a
        job refused at an earlier row's start, or cancelled meanwhile, starts no more (counted)."""
        while admitted:
            i, job, k, c = admitted[0]
            row = None if job.cancelled else self._start_row(i, job, k, c)
            with self.cv:
                if row is None:
                    self._lost(job)
                self.slots[i] = row
                self._starting -= 1
            admitted.pop(0)

    def _start_row(self, i: int, job: Job, index: int, c: Completion) -> _Row | None:
        """Row i's window reset with the completion's prompt; its `_Row`, or None where the prompt is refused."""
        try:
            obs, info = self.env.reset(seed=c.seed, options={"prompt": c.prompt, "meta": c.meta or {},
                                                                 "score": False})
        except ValueError as e:  # checked before submit; kept from failing the batch all the same
            job._fail(f"prompt: {e}")
            job.cancel()  # its other completions' rows are freed
            return None
        if self.obs is None:  # the first row: every row's window starts as a copy of it
            self.obs = {k: np.repeat(v[None], self.rows, axis=0) for k, v in obs.items()}
        for k, v in obs.items():
            self.obs[k][i] = v
        self.cont[i] = False
        return _Row(job, index, c, torch.Generator().manual_seed(c.seed), info["prompt"],
                    len(self.env.prompt_ids), limit=min(c.max_tokens, self.max_new_tokens))

    def step(self) -> None:
        """A block of up to `block` tokens (one where it cannot be a block: `next_tokens`) of the first
        1, 2, 4, ... rows that hold every row in use (all `rows` where the module's cache cannot keep
        the others' keys and values); idle rows among them step too, their outputs ignored."""
        active = [i for i, s in enumerate(self.slots) if s is not None]
        n = min(self.rows, 1 << active[-1].bit_length()) if self.prefixes and active else self.rows
        obs = {name: v[:n] for name, v in self.obs.items()}  # views: the windows below append in place
        tokens = next_tokens(self.module, self.slots[:n], obs, self.cont[:n], self.block, self.device,
                             bool(self.waiting))
        k = len(tokens)
        self.cont[:] = True
        self.stats["steps"] += k
        self.stats["blocks"] += 1
        self.stats["max_active"] = max(self.stats["max_active"], len(active))
        append_windows(obs, tokens.numpy())
        per_row = tokens.T.tolist()
        for i in active:
            row = self.slots[i]
            for kept, token in enumerate(per_row[i], 1):  # up to the row's end (its later tokens are dropped)
                self.stats["tokens"] += 1
                end = row.append(token, self.tokenizer, self.eos_id)
                if end is not None:
                    self._end(i, *end)
                if self.slots[i] is not row:
                    self.stats["dropped"] += k - kept
                    break
        if self.on_step is not None:
            self.on_step()

    def _end(self, i: int, reason: str, text: str | None = None) -> None:
        """Frees row i; a completion of a job still going goes to it (`HandOver`: a scored one in a
        thread of its own, while the rows go on)."""
        row, self.slots[i] = self.slots[i], None
        if row.job.error is not None or reason == "cancelled":
            return self._lost(row.job)
        self.hand_over(row, reason, row.text(self.tokenizer) if text is None else text)

    def _fail_all(self, message: str, admitted: list = ()) -> None:
        """The batch failed: every completion it holds (in a row, starting, waiting) fails with `message`."""
        with self.cv:
            lost = [*admitted, *(s.job for s in self.slots if s is not None), *(j for j, _ in self.waiting)]
            self.stats["failed"] += len(lost)
            self.slots = [None] * self.rows
            self.waiting.clear()
            self._starting = 0
            self.cont[:] = False  # every row restarts: nothing cached is trusted
        for job in {id(j): j for j in lost}.values():
            job._fail(message)
