"""Decodes from prompt windows on the decode engine, greedy or sampled: self-critical's greedy
baseline, and generation (`agents.generate`: generation, evaluation, a replica serving one request
at a time, the training run's closing samples).

One `Decoder` keeps one decode engine (`RingKVCache`) from one call to the next. Its rows are a
power of two (at least DECODE_ROWS_MIN, never fewer than an earlier call's; the first prompt
repeated), so calls with different numbers of prompts replay the graphs the first one captured (on
a GPU). The first step loads the windows (the env's left-padded layout); the steps after it run
DECODE_BLOCK at a time as one static function each (`RingKVCache.continue_block`: a CUDA graph on
CUDA), every row appending its own token on the device. The host reads whether every row has met
EOS once a block, and the tokens once a call.

Greedy: the argmax over the sampler's kept tokens where a stateless truncation sampler is on
(typical sampling can drop the most likely token; mirostat keeps the argmax anyway). Sampled:
each row's token drawn at a uniform the caller gives per row and step (`draws`), from the
policy's distribution under the sampler's mask, warped by `temperature` and `top_p`
(`samplers.warp_logits`), by inverting its cumulative sum (`samplers.sample_rows`): the draw
`agents.generate.draw_rows` makes one step at a time. A trunk the engine does not serve, or a
learned mask (NLPO's, which reads the window), takes one call per step instead; sampling needs a
stateless sampler (mirostat's state follows each token: `agents.generate` steps it one call at a
time).
"""
from __future__ import annotations

from typing import Callable

import torch

from agents.modules.acting import shift_windows
from agents.modules.decode_engine import RingKVCache
from agents.samplers import MASKED, row_tokens, sample_rows, warp_logits

DECODE_BLOCK = 8  # steps per static block after the first; EOS is read back between blocks
DECODE_ROWS_MIN = 8
PADDED_ROW_DRAW = 0.5  # the uniform a padding row draws at (its tokens are never read)
# Sampled decodes' graphs are captured per (temperature, top_p), the values inside them as the
# one-call-per-token path has them; past this many settings the oldest one's graphs are dropped
# (a replica serving one request at a time meets each client's settings).
SAMPLING_SETTINGS_KEPT = 4


def keep_graphs_of(engine, keys: list, key, kept: int = SAMPLING_SETTINGS_KEPT) -> None:
    """Notes `key` (a tail's graph key) as the newest in `keys`, and drops the graphs (and compiled
    functions) of the oldest keys past `kept` from `engine` (a step's, its tail's, its restarts' and
    its blocks')."""
    if key in keys:
        keys.remove(key)
    keys.append(key)
    def tail_key(name):  # a graph's name without the rows it runs over (`DecodeEngine.part`)
        return name[-1] if isinstance(name, tuple) and name[:1] == ("part",) else name

    while len(keys) > kept:
        old = keys.pop(0)
        names = {*engine.graphs, *engine.compiled} if engine is not None else ()
        names = [n for n in names if isinstance(tail_key(n), tuple)]
        for name in [n for n in names if old in (tail_key(n), tail_key(n)[-1])]:
            engine.graphs.pop(name, None)
            engine.compiled.pop(name, None)


class Decoder:
    """Greedy or sampled decodes of a policy module from prompt windows (see the module docstring)."""

    def __init__(self):
        self.cache = RingKVCache()
        self.rows = 0

    def __getstate__(self) -> dict:  # a copy starts with no engine (captured graphs do not copy)
        return {"cache": RingKVCache(), "rows": 0}

    @staticmethod
    def samples(module) -> bool:
        """Whether `module`'s sampled decodes can take a Decoder: a policy whose sampler keeps no
        per-row state (mirostat's follows each token)."""
        sampler = getattr(module, "sampler", None)
        return sampler is not None and not sampler.stateful

    @torch.no_grad()
    def __call__(self, module, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 eos_id: int | None, draws: Callable[[int], torch.Tensor] | None = None, temperature: float = 1.0,
                 top_p: float = 1.0) -> list[list[int]]:
        """Each row's tokens up to its first EOS (included) or `max_new_tokens`. `draws(k)`: None
        (greedy), or each row's next k uniforms, a (k, rows) float64 tensor (on the host: each row
        draws from its own generator, so a row's text does not depend on the others)."""
        sampled = draws is not None
        if sampled and not self.samples(module):
            raise ValueError("Decoder: sampling needs a sampler with no per-row state (not mirostat)")
        n = input_ids.shape[0]
        self.rows = max(self.rows, DECODE_ROWS_MIN, 1 << (n - 1).bit_length())
        pad = self.rows - n
        obs = {"input_ids": torch.cat([input_ids, input_ids[:1].expand(pad, -1)]),
               "attention_mask": torch.cat([attention_mask, attention_mask[:1].expand(pad, -1)])}
        device = input_ids.device
        cache, trunk, sampler = self.cache, module._trunk(module.lm), module.sampler
        cache.invalidate()  # the weights changed since the last call: nothing held is current
        masked = sampler.active and not sampler.stateful
        static = not (masked and sampler.learned)  # a learned mask reads the window: one call per step
        eos = -1 if eos_id is None else eos_id

        def kept(hidden, window) -> torch.Tensor:  # static unless a learned mask reads the window
            logits = module._logits(module.lm, hidden).float()
            if masked:
                source = module.mask_lm_logits(window) if sampler.learned else logits
                logits = logits.masked_fill(~sampler.keep(source, None), MASKED)
            return logits

        def argmax(hidden, _unused=None, window=None) -> dict:  # the greedy step after the trunk
            return {"token": kept(hidden, window).argmax(-1)}

        def draw(hidden, uniform, window=None) -> dict:  # the sampled step after the trunk
            probs = torch.softmax(warp_logits(kept(hidden, window), temperature, top_p), -1)
            return {"token": sample_rows(probs, uniform)}

        def uniforms(k: int) -> torch.Tensor:  # (k, rows, 1): the tail's per-step input
            u = torch.full((k, self.rows), PADDED_ROW_DRAW, dtype=torch.float64)
            u[:, :n] = draws(k)
            return u[..., None].to(device)

        placeholder = torch.zeros(DECODE_BLOCK, 1, device=device)  # a greedy block's unused per-step input
        tail, inputs = (draw, uniforms) if sampled else (argmax, lambda k: placeholder[:k])
        key = ("sample", masked, float(temperature), float(top_p)) if sampled else ("greedy", masked)
        if sampled:
            keep_graphs_of(self.cache.engine, self.cache.tail_keys, key)

        def step(obs, u) -> torch.Tensor:  # one call: the token of each row after its window
            if static:  # a copy: a replayed graph's output is overwritten by its next replay
                return cache.hidden_at_last_token(trunk, obs, None, tail=tail, tail_inputs=(u,), key=key)["token"].clone()
            return tail(cache.hidden_at_last_token(trunk, obs), u, window=obs)["token"]

        tokens = [step(obs, inputs(1)[0])[None]]
        done = tokens[0][0] == eos
        left = max_new_tokens - 1
        while left > 0 and not bool(done[:n].all()):  # one host read per block
            k = min(DECODE_BLOCK, left)
            given = inputs(k)
            block = cache.continue_block(trunk, tokens[-1][-1], k, lambda: (given,), tail, key,
                                         lambda out: out["token"]) if static else None
            if block is not None:
                block = block["token"].clone()
                obs = {"input_ids": cache.ids, "attention_mask": cache.mask}  # the windows it now holds
            else:  # one call per step
                block = []
                for j in range(k):
                    obs = shift_windows(obs, block[-1] if block else tokens[-1][-1])
                    block.append(step(obs, given[j]))  # the cache tells from the windows which rows continue
                block = torch.stack(block)
            tokens.append(block)
            done = done | (block == eos).any(0)
            left -= k
        cache.store.clear()  # eager prefills stored by window: the next call's weights differ
        out = []
        for row in torch.cat(tokens).T[:n].tolist():  # the tokens up to each row's first EOS, EOS included
            out.append(row[:row.index(eos) + 1] if eos in row else row)
        return out


ROW_KEYS_KEPT = 4  # a serving batch's tails kept captured: one per spec (requested samplers, warps)


@torch.no_grad()
def rows_block(module, obs: dict, cont: torch.Tensor, settings: tuple, uniforms: torch.Tensor,
               spec: dict) -> torch.Tensor:
    """`len(uniforms)` decode steps of a serving batch's rows, each row with its own settings:
    the tokens (steps, rows), on the policy's device. `obs`: the rows' windows on the device (rows
    that `cont` (rows,) bool on the host does not mark restart there); `settings`: `row_tokens`'
    per-row tensors (greedy, temperature, top_p, kind, param) and `spec` its static choices (kinds,
    sampled, nucleus, subsets); `uniforms` (steps, rows, 1): each row's draws. The first step is
    the engine's step (restarts in it), the others one static function
    (`RingKVCache.continue_block`); all with the head, the masks and the draw inside (`row_tokens`:
    a CUDA graph per step or block on a GPU, graphs kept for the last ROW_KEYS_KEPT specs). Needs
    `acting.static_rollout_step(module, explore=False)`."""
    cache, trunk = module.kv_cache, module._trunk(module.lm)
    key = ("rows", *sorted(spec.items()))
    keep_graphs_of(cache.engine, cache.tail_keys, key, ROW_KEYS_KEPT)

    def tail(hidden, uniform, *per_row) -> dict:
        return {"token": row_tokens(module._masked_logits(hidden)[0], uniform, *per_row, **spec)}

    def step(obs, cont, j) -> torch.Tensor:  # a copy: a replayed graph's output is overwritten by its next replay
        return cache.hidden_at_last_token(trunk, obs, cont, tail=tail, tail_inputs=(uniforms[j], *settings),
                                          key=key)["token"].clone()

    k = len(uniforms)
    tokens = [step(obs, cont, 0)]
    if k > 1:
        rest = cache.continue_block(trunk, tokens[0], k - 1, lambda: (uniforms[1:], *(s.expand(k - 1, *s.shape)
                                                                                          for s in settings)),
                                    tail, key, lambda out: out["token"])
        if rest is not None:
            return torch.cat([tokens[0][None], rest["token"].clone()])
        every_row = torch.ones(len(tokens[0]), dtype=torch.bool)
        for j in range(1, k):  # no engine holding the rows (a trunk it does not serve): one call per step
            obs = shift_windows(obs, tokens[-1])
            tokens.append(step(obs, every_row, j))
    return torch.stack(tokens)
