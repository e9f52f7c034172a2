"""KV cache for token-by-token rollouts, aligned with the env's observation window.

The env's observation is a fixed window of `L` columns, left-padded, newest
token last. One env step appends a token: the new window is the old one
shifted left by one column with the new token in the last column. The cache
stores, per row, the keys/values of the last window it saw, in the same
column layout, so a step that continues a row costs one incremental forward of
one token; the shifted-out column is always padding.

Whether a row continues is told by the caller (`cont`, from the batch's
`ROW_CONTINUES` column: the fast EnvRunner knows which rows it reset), or else
decided from the observations alone (new window minus its last column == old
window minus its first column). So with RLlib's stock EnvRunner, resets,
restarts to an arbitrary state, partial auto-resets of a vector env, and even
reordered rows simply fail the check and are re-prefilled: a stale cache can
never be used. Weight updates make every cached key/value stale:
`invalidate()` on every weight sync.

Prefills are shared by window content: rows that (re)start on the same window
in one call are prefilled once, and a window prefilled since the last
`invalidate()` is not computed again while it is in `PrefillStore` (bounded in
bytes). A window's keys, values and last hidden state depend only on its
tokens, its mask and the weights, so a reused prefill is the one a new pass
would compute (up to float rounding of a different batch). Tasks whose prompts
repeat (one fixed prompt, several samples per prompt, a small prompt set) then
pay for a prompt's prefill once per weight sync instead of once per episode.
"""
from __future__ import annotations

import copy
import weakref

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from agents.models import embed
from agents.modules.prefill_store import (PREFILL_STORE_BYTES, PrefillStore, stack_layers,  # noqa: F401
                                          stored_prefills, unstack_layers, window_keys)


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that ignore left padding: the first real token is position 0."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def first_used_column(mask: torch.Tensor) -> int:
    """The first column that is not padding in every row (left padding): passes over the window
    start there. The columns before it hold nothing any row attends to, and positions
    (`position_ids_for`) count real tokens only, so the pass gives the same hidden states."""
    real = torch.nonzero(mask.any(0))
    return int(real[0, 0]) if len(real) else mask.shape[1] - 1


def sequence_pass_rows(ids: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor | None):
    """The rows of a learner pass: one per sequence (`sequence_groups`), from the first column any
    of them uses. Returns (rep, ids, mask, inverse, column): the pass's rows, its input ids and mask,
    and for each batch row its group and the column of its newest token in the pass's output."""
    rep, inverse, column = sequence_groups(mask, seq_ids)
    ids, mask = ids[rep], mask[rep]
    start = first_used_column(mask)
    return rep, ids[:, start:], mask[:, start:], inverse, column - start


def pad_front(layers, start: int):
    """Per-layer (keys, values) with `start` zero columns put back in front (the columns a pass
    skipped; the attention mask hides them)."""
    if not start:
        return layers
    return [(F.pad(k, (0, 0, start, 0)), F.pad(v, (0, 0, start, 0))) for k, v in layers]


def sequence_groups(mask: torch.Tensor, seq_ids: torch.Tensor | None):
    """One forward pass per sequence: rows of one sequence (same `seq_id`) are prefixes of its
    longest row. Returns (rep, inverse, column): rep[g] is the row holding group g's longest
    window, inverse[r] the group of row r, column[r] where row r's newest token stands in its
    representative's window. Without seq_ids every row is its own group."""
    if seq_ids is None:
        rows = torch.arange(mask.shape[0], device=mask.device)
        return rows, rows, torch.full_like(rows, mask.shape[1] - 1)
    n_real = mask.sum(-1)
    groups, inverse = torch.unique(seq_ids, return_inverse=True)
    longest = torch.zeros(len(groups), dtype=n_real.dtype, device=n_real.device).scatter_reduce(
        0, inverse, n_real, reduce="amax", include_self=False)
    is_longest = n_real == longest[inverse]
    rep = torch.empty(len(groups), dtype=torch.long, device=mask.device)
    rep.scatter_(0, inverse[is_longest], torch.nonzero(is_longest)[:, 0])
    return rep, inverse, mask.shape[1] - longest[inverse] + n_real - 1


def merge_rows(step: torch.Tensor, fill: torch.Tensor, step_rows: torch.Tensor, fill_rows: torch.Tensor):
    """The rows computed in two parts (cached steps and prefills) back in batch order."""
    out = step.new_empty((len(step_rows) + len(fill_rows),) + tuple(step.shape[1:]))
    out[step_rows], out[fill_rows] = step, fill
    return out


def continuing_rows(prev_ids, prev_mask, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Which rows of (ids, mask) are row-for-row one appended token after (prev_ids, prev_mask)."""
    if prev_ids is None or prev_ids.shape != ids.shape:
        return torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    return (
        (ids[:, :-1] == prev_ids[:, 1:]).all(-1)
        & (mask[:, :-1] == prev_mask[:, 1:]).all(-1)
        & (mask[:, -1] == 1)
        & (prev_mask[:, 0] == 0)
    )


def rows_that_continue(prev_ids, prev_mask, ids: torch.Tensor, mask: torch.Tensor, cont=None,
                       host: bool = False) -> torch.Tensor:
    """`cont` when the caller knows it (as a bool tensor on ids' device, or on the host with `host`:
    no round trip for a `cont` the caller holds on the host), else `continuing_rows`."""
    if cont is None or prev_ids is None or prev_ids.shape != ids.shape:
        rows = continuing_rows(prev_ids, prev_mask, ids, mask)
        return rows.cpu() if host else rows
    return torch.as_tensor(cont, dtype=torch.bool, device="cpu" if host else ids.device)


def step_attention_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive (rows, 1, 1, L) mask of a one-token step over an L-column window.

    The new token is the window's last column, so causality adds nothing to the padding mask.
    Given ready-made, the model skips building its general mask every step (the window's left
    padding makes that the costliest part of a small model's step)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        mask == 0, torch.finfo(dtype).min)[:, None, None, :]


@torch.no_grad()
def _same_step_with_4d_mask(trunk, past, ids, mask) -> bool:
    """Whether `trunk` gives the same step output with `step_attention_mask` as with the 2-D mask
    (attention implementations that take no 4-D mask fail or differ: those keep the 2-D mask)."""
    outs = []
    for attention in (mask, step_attention_mask(mask, trunk.dtype)):
        try:
            out = trunk(input_ids=ids[:, -1:], attention_mask=attention, position_ids=mask.sum(-1, keepdim=True) - 1,
                        past_key_values=copy.deepcopy(past), use_cache=True)
        except (RuntimeError, ValueError, TypeError):
            return False
        outs.append(out.last_hidden_state[:, -1].float())
    return bool(torch.allclose(outs[0], outs[1], atol=1e-4, rtol=1e-4))


def _plain_gpt2_blocks(trunk):
    """The blocks of a plain `GPT2Model` (every part exactly GPT-2's, no hooks, none of GPT-2's
    rarer attention options), or None for any other trunk: what `gpt2_step` and `gpt2_forward`
    may run as tensor ops."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Model
    from transformers.pytorch_utils import Conv1D

    if type(trunk) is not GPT2Model:
        return None
    c = trunk.config
    if (getattr(c, "add_cross_attention", False) or getattr(c, "scale_attn_by_inverse_layer_idx", False)
            or getattr(c, "reorder_and_upcast_attn", False) or not getattr(c, "scale_attn_weights", True)):
        return None
    blocks = list(trunk.h)
    parts = [trunk, trunk.wte, trunk.wpe, trunk.ln_f]
    for blk in blocks:
        linear = (blk.attn.c_attn, blk.attn.c_proj, blk.mlp.c_fc, blk.mlp.c_proj)
        if not all(type(m) is Conv1D for m in linear) or not all(
                type(m) is torch.nn.LayerNorm for m in (blk.ln_1, blk.ln_2)):
            return None
        parts += [blk, blk.attn, blk.mlp, blk.ln_1, blk.ln_2, blk.mlp.act, *linear]
    if type(trunk.ln_f) is not torch.nn.LayerNorm or any(
            m._forward_hooks or m._forward_pre_hooks for m in parts):
        return None
    return blocks


MATMUL_ATTENTION_MAX_COLUMNS = 128  # CPU passes over windows up to this long attend by two batched matmuls


def attention_mask_per_head(attention: torch.Tensor, heads: int) -> torch.Tensor:
    """The additive (rows, 1, queries, T) mask as `window_attention` takes it: (rows * heads,
    queries, T) where its batched matmuls apply (one query, a cached step, on any device: on an
    H100 at GPT-2-small shape, 128 rows over 112 columns in float32, PyTorch's fused attention
    took 124 us per layer for the one query, 54% of a captured step's device time; on the CPU also
    windows of at most MATMUL_ATTENTION_MAX_COLUMNS; made once per pass, shared by the layers),
    else the mask as it is (PyTorch's fused attention broadcasts it). Passes over fp16 windows keep the
    fused op: a padding query row masks every key, and fp16's mask value (-65504) plus a score
    below about -16 rounds to -inf, so the matmuls' softmax of that row would be NaN (the fused
    op adds the mask in float32). A cached step's new token always attends to itself."""
    B, _, Tq, T = attention.shape
    if Tq > 1 and (attention.device.type != "cpu" or T > MATMUL_ATTENTION_MAX_COLUMNS
                   or attention.dtype == torch.float16):
        return attention
    return attention.expand(B, heads, Tq, T).reshape(B * heads, Tq, T)


def window_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attention: torch.Tensor):
    """Attention of (rows, heads, queries, hd) over (rows, heads, T, hd) keys/values with the
    additive mask from `attention_mask_per_head`. Where that left the mask 4-D, PyTorch's fused
    attention; else two batched matmuls and a softmax. On 2 cores at tiny-gpt2 to gpt2-medium
    head sizes the matmuls were at most 5% slower than the fused op for one query and up to 2x
    faster (64 rows of tiny-gpt2 over 25 columns); over whole 25-column windows (a learner pass,
    forward and backward, 57 sequences x 4 heads) 0.70 against 2.02 ms (one-off timings); the
    two were level at 128 columns and the fused op 2x faster at 512. The matmuls keep the
    (rows * heads, queries, T) softmax for the backward pass (at 64 rows, 12 heads and 128
    columns about 50 MB per layer, float32); the fused CPU kernel keeps less."""
    if attention.dim() == 4:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=attention)
    B, H, Tq, hd = q.shape
    T = keys.shape[2]
    w = torch.baddbmm(attention, q.reshape(B * H, Tq, hd), keys.reshape(B * H, T, hd).transpose(1, 2),
                      alpha=hd ** -0.5)
    out = torch.bmm(torch.softmax(w.float(), -1).to(values.dtype), values.reshape(B * H, T, hd))
    return out.view(B, H, Tq, hd)


def gpt2_forward_blocks(trunk, autocast_dtype=None):
    """The blocks `gpt2_forward` runs as tensor ops on this trunk under autocast in
    `autocast_dtype` (None: no autocast), or None where it keeps transformers' forward: not a
    plain `GPT2Model` (`_plain_gpt2_blocks`), gradient checkpointing, training mode with dropout,
    or an autocast dtype other than bf16."""
    blocks = _plain_gpt2_blocks(trunk)
    c = trunk.config
    if (blocks is None or any(getattr(m, "gradient_checkpointing", False) for m in [trunk, *blocks])
            or autocast_dtype not in (None, torch.bfloat16)
            or (trunk.training and max(c.resid_pdrop, c.embd_pdrop, c.attn_pdrop) > 0)):
        return None
    return blocks


def gpt2_forward(trunk, ids: torch.Tensor, mask: torch.Tensor, *, keys_values: bool = False, each_layer=None):
    """A plain `GPT2Model`'s pass over whole left-padded windows as tensor ops: what
    `trunk(input_ids=ids, attention_mask=mask, position_ids=position_ids_for(mask))` computes
    (last hidden states (rows, T, D), and with `keys_values` the per-layer (keys, values)), without
    transformers' per-module calls, output-capturing wrappers and mask building (the fixed cost of
    a pass, which a small model's short passes, such as one prompt's prefill, feel).
    Differentiable (the learner's passes take it). Under bf16 autocast (the learner's passes on a
    GPU) each op takes autocast's dtype as transformers' ops do. Returns None where the trunk does
    not qualify (`_plain_gpt2_blocks`), uses gradient checkpointing, runs in training mode with
    dropout, or under another autocast dtype (fp16: the padding rows' mask would overflow in the
    batched matmuls): those keep transformers' forward. `lean_forward` checks it against
    transformers' forward once per trunk. `each_layer(i, keys, values)`: called with each layer's
    keys and values as they are computed (none kept: one layer's activations alive at a time)."""
    autocast = torch.is_autocast_enabled(ids.device.type)
    blocks = gpt2_forward_blocks(trunk, torch.get_autocast_dtype(ids.device.type) if autocast else None)
    if blocks is None:
        return None
    c = trunk.config
    D, heads = trunk.embed_dim, c.n_head
    hd = D // heads
    B, T = ids.shape
    h = embed(ids, trunk.wte.weight) + embed(position_ids_for(mask), trunk.wpe.weight)
    allowed = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril_()[None] & mask[:, None, :].bool()
    # under bf16 autocast the batched matmuls cast the mask to bf16, where float32's lowest value
    # would round to -inf (a padding row, all keys masked, would then give NaN): bf16's lowest
    lowest = torch.finfo(torch.bfloat16 if autocast else h.dtype).min
    attention = attention_mask_per_head(torch.zeros(allowed.shape, dtype=h.dtype, device=h.device).masked_fill_(
        ~allowed, lowest)[:, None], heads)
    layers = []
    for i, blk in enumerate(blocks):
        x = F.layer_norm(h, (D,), blk.ln_1.weight, blk.ln_1.bias, blk.ln_1.eps)
        q, k, v = torch.addmm(blk.attn.c_attn.bias, x.reshape(B * T, D), blk.attn.c_attn.weight).view(
            B, T, 3, heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
        if each_layer is not None:
            each_layer(i, k, v)
        elif keys_values:
            layers.append((k, v))
        a = window_attention(q, k, v, attention).transpose(1, 2).reshape(B * T, D)
        h = h + torch.addmm(blk.attn.c_proj.bias, a, blk.attn.c_proj.weight).view(B, T, D)
        x = F.layer_norm(h, (D,), blk.ln_2.weight, blk.ln_2.bias, blk.ln_2.eps)
        x = blk.mlp.act(torch.addmm(blk.mlp.c_fc.bias, x.reshape(B * T, D), blk.mlp.c_fc.weight))
        h = h + torch.addmm(blk.mlp.c_proj.bias, x, blk.mlp.c_proj.weight).view(B, T, D)
    return F.layer_norm(h, (D,), trunk.ln_f.weight, trunk.ln_f.bias, trunk.ln_f.eps), layers


_LEAN_FORWARD_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def lean_forward_verdict(trunk):
    """Whether `lean_forward` takes `gpt2_forward` on this trunk: True or False once checked
    against transformers' forward (its first pass), None before."""
    return _LEAN_FORWARD_CHECKED.get(trunk)


def lean_forward(trunk, ids: torch.Tensor, mask: torch.Tensor, *, keys_values: bool = False):
    """`gpt2_forward` where it applies and gave transformers' results on this trunk's first batch
    (checked once per trunk, at real tokens only, within float rounding of its dtype), else
    transformers' forward. Returns (last hidden states, [(keys, values)] per layer or None)."""
    lean = _LEAN_FORWARD_CHECKED.get(trunk)
    if lean is not False:
        out = gpt2_forward(trunk, ids, mask, keys_values=keys_values)
        if out is not None and lean is None:
            lean = _same_forward(trunk, ids, mask, out)
            _LEAN_FORWARD_CHECKED[trunk] = lean
        if out is not None and lean:
            return out[0], (out[1] if keys_values else None)
    result = trunk(input_ids=ids, attention_mask=mask, position_ids=position_ids_for(mask), use_cache=keys_values)
    layers = [(l.keys, l.values) for l in result.past_key_values.layers] if keys_values else None
    return result.last_hidden_state, layers


@torch.no_grad()
def _same_forward(trunk, ids, mask, out) -> bool:
    """Whether `gpt2_forward`'s `out` equals transformers' forward on this batch (real tokens)."""
    ref = trunk(input_ids=ids, attention_mask=mask, position_ids=position_ids_for(mask), use_cache=True)
    tol = 1e-4 if trunk.dtype == torch.float32 and not torch.is_autocast_enabled(ids.device.type) else 3e-2
    real = mask.bool()
    same = lambda a, b: a.shape == b.shape and bool(torch.allclose(a[real].float(), b[real].float(), atol=tol, rtol=tol))
    if not same(ref.last_hidden_state, out[0].detach()):
        return False
    if not out[1]:
        return True
    per_token = lambda t: t.detach().transpose(1, 2)  # (rows, heads, T, hd) -> (rows, T, heads, hd)
    return all(same(per_token(l.keys), per_token(k)) and same(per_token(l.values), per_token(v))
               for l, (k, v) in zip(ref.past_key_values.layers, out[1]))


def gpt2_step(trunk):
    """A one-token cached step of a plain `GPT2Model` as tensor ops, or None for any other trunk.

    `step(past, ids, mask)` does what `trunk(input_ids=ids[:, -1:], attention_mask=4-D step mask,
    position_ids=..., past_key_values=past)` does to `past` (its keys/values lose their first
    column and gain the new token's) and returns the hidden state at the new token, without the
    per-layer module calls, wrappers and attention dispatch of transformers' forward (about half of
    a tiny model's step). Only a trunk whose parts are exactly GPT-2's qualifies: a LoRA-wrapped
    one (its projections are adapters), one with hooks, cross-attention or GPT-2's rarer attention
    options keeps transformers' forward. `WindowKVCache` also checks the step against that forward
    on its first call and keeps the forward when they differ."""
    blocks = _plain_gpt2_blocks(trunk)
    if blocks is None:
        return None
    D, heads = trunk.embed_dim, trunk.config.n_head
    hd = D // heads

    def step(past, ids, mask):
        B = ids.shape[0]
        h = F.embedding(ids[:, -1], trunk.wte.weight) + F.embedding(mask.sum(-1) - 1, trunk.wpe.weight)
        attention = attention_mask_per_head(step_attention_mask(mask, h.dtype), heads)
        for blk, layer in zip(blocks, past.layers):
            x = F.layer_norm(h, (D,), blk.ln_1.weight, blk.ln_1.bias, blk.ln_1.eps)
            q, k, v = torch.addmm(blk.attn.c_attn.bias, x, blk.attn.c_attn.weight).view(B, 3, heads, 1, hd).unbind(1)
            layer.keys = torch.cat([layer.keys[:, :, 1:], k.to(layer.keys.dtype)], 2)
            layer.values = torch.cat([layer.values[:, :, 1:], v.to(layer.values.dtype)], 2)
            a = window_attention(q, layer.keys, layer.values, attention).reshape(B, D)
            h = h + torch.addmm(blk.attn.c_proj.bias, a.to(h.dtype), blk.attn.c_proj.weight)
            x = F.layer_norm(h, (D,), blk.ln_2.weight, blk.ln_2.bias, blk.ln_2.eps)
            x = blk.mlp.act(torch.addmm(blk.mlp.c_fc.bias, x, blk.mlp.c_fc.weight))
            h = h + torch.addmm(blk.mlp.c_proj.bias, x, blk.mlp.c_proj.weight)
        return F.layer_norm(h, (D,), trunk.ln_f.weight, trunk.ln_f.bias, trunk.ln_f.eps)

    return step


def _transformers_step(trunk, past, ids, mask, mask_4d: bool) -> torch.Tensor:
    """transformers' own one-token cached step (drops the first column of `past` first)."""
    for layer in past.layers:
        layer.keys, layer.values = layer.keys[:, :, 1:], layer.values[:, :, 1:]
    attention = step_attention_mask(mask, trunk.dtype) if mask_4d else mask
    out = trunk(input_ids=ids[:, -1:], attention_mask=attention, position_ids=mask.sum(-1, keepdim=True) - 1,
                past_key_values=past, use_cache=True)
    return out.last_hidden_state[:, -1]


@torch.no_grad()
def _same_step(trunk, step, past, ids, mask) -> bool:
    """Whether `step` gives transformers' step output and caches on this batch (within float
    rounding of the trunk's dtype)."""
    tol = 1e-4 if trunk.dtype == torch.float32 else 3e-2
    ref_past, own_past = copy.deepcopy(past), copy.deepcopy(past)
    ref = _transformers_step(trunk, ref_past, ids, mask, mask_4d=False).float()
    try:
        own = step(own_past, ids, mask).float()
    except (RuntimeError, ValueError, TypeError):
        return False
    same = lambda a, b: a.shape == b.shape and bool(torch.allclose(a.float(), b.float(), atol=tol, rtol=tol))
    return same(ref, own) and all(same(a.keys, b.keys) and same(a.values, b.values)
                                  for a, b in zip(ref_past.layers, own_past.layers))


def cache_from_layers(config, layers) -> DynamicCache:
    """A `DynamicCache` holding the given per-layer (keys, values)."""
    past = DynamicCache(config=config)
    for layer, (k, v) in zip(past.layers, layers):
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
    return past


def prefill_pass(trunk, ids: torch.Tensor, mask: torch.Tensor, stacked: bool = False):
    """(hidden at each row's newest token, [(keys, values)] per layer) of whole windows, in one
    pass that skips the leading columns that are padding in every row (a fresh episode's window
    is mostly left padding: prompt 64 + 48 new tokens prefills 64 columns, not 112). Those
    columns' keys/values come back as zeros; the attention mask hides them either way.
    `stacked`: the keys/values as one (2, layers, rows, heads, L, hd) tensor (`stack_layers`)."""
    start = first_used_column(mask)
    hidden, layers = lean_forward(trunk, ids[:, start:], mask[:, start:], keys_values=True)
    if stacked:
        kv = stack_layers(layers)
        return hidden[:, -1], F.pad(kv, (0, 0, start, 0)) if start else kv
    return hidden[:, -1], pad_front(layers, start)


class WindowKVCache:
    def __init__(self, store_bytes: int = PREFILL_STORE_BYTES):
        self.store = PrefillStore(store_bytes)
        self.invalidate()
        # prefill_rows: rows that (re)started (needed a prefill); prefill_computed_rows: of those,
        # the ones a forward pass computed (the others reused a prefill of the same window)
        self.stats = {"prefill_rows": 0, "prefill_computed_rows": 0, "incremental_rows": 0}
        self.mask_4d = None  # whether one-token steps pass a ready 4-D mask (decided at the first step)
        self.use_lean_step = True  # False: steps always go through transformers' forward
        self.lean_step = None  # the step as tensor ops (gpt2_step), False where it does not apply (first step)
        self.reuse_prefills = True  # False: every row that starts is prefilled (as if no two windows were alike)

    def __getstate__(self) -> dict:  # a copy picks its step again: `lean_step` computes with this trunk
        return {**self.__dict__, "lean_step": None}

    def invalidate(self) -> None:
        """The weights changed: nothing cached holds."""
        self.forget_rows()
        self.store.clear()

    def forget_rows(self) -> None:
        """The next call continues no row (the stored prefills stay: the weights did not change)."""
        self.ids = self.mask = self.past = None

    @property
    def layers(self):
        """Per layer (keys, values) of the last window seen, or None."""
        return None if self.past is None else [(layer.keys, layer.values) for layer in self.past.layers]

    @torch.no_grad()
    def hidden_at_last_token(self, trunk, obs: dict, cont=None) -> torch.Tensor:
        """The trunk's final hidden state at each row's newest token, using and updating the cache.
        `cont`: which rows continue (else decided from the observations)."""
        ids, mask = obs["input_ids"], obs["attention_mask"]
        cont = rows_that_continue(self.ids, self.mask, ids, mask, cont)
        n = ids.shape[0]
        n_step = int(cont.sum())
        self.stats["prefill_rows"] += n - n_step
        self.stats["incremental_rows"] += n_step
        self.ids, self.mask = ids, mask  # callers never modify a batch in place
        if n_step == n:  # the usual step: every row appends one token; the cache object carries on
            return self._step(trunk, self.past, ids, mask)
        if n_step == 0:
            hidden, kv = self._prefill(trunk, ids, mask)
            self.past = cache_from_layers(trunk.config, unstack_layers(kv))
            return hidden
        # Every row takes the cached step (a row that starts computes a throwaway token on its old
        # cache, as idle rows do), then the rows that start get their prefill written over theirs:
        # one pass over the whole batch, with no gathering of the continuing rows' keys/values.
        hidden = self._step(trunk, self.past, ids, mask)
        fill_rows = torch.nonzero(~cont)[:, 0]
        h_fill, filled = self._prefill(trunk, ids[fill_rows], mask[fill_rows])
        for layer, (k, v) in zip(self.past.layers, unstack_layers(filled)):
            layer.keys[fill_rows], layer.values[fill_rows] = k.to(layer.keys.dtype), v.to(layer.values.dtype)
        hidden[fill_rows] = h_fill.to(hidden.dtype)
        return hidden

    def _step(self, trunk, past, ids, mask) -> torch.Tensor:
        """One cached token per row; the column shifted out of the window (padding) is dropped.
        At the first step the cache picks how: GPT-2's step as tensor ops (`gpt2_step`) where it
        matches transformers' forward on that batch, else the forward with a ready 4-D mask where
        that matches the 2-D one, else the forward with the 2-D mask."""
        if self.lean_step is None:
            step = gpt2_step(trunk) if self.use_lean_step else None
            self.lean_step = step if step is not None and _same_step(trunk, step, past, ids, mask) else False
        if self.lean_step is not False:
            return self.lean_step(past, ids, mask)
        if self.mask_4d is None:  # check the cheap mask against the model's own (else keep the 2-D one)
            shifted = copy.deepcopy(past)
            for layer in shifted.layers:
                layer.keys, layer.values = layer.keys[:, :, 1:], layer.values[:, :, 1:]
            self.mask_4d = _same_step_with_4d_mask(trunk, shifted, ids, mask)
        return _transformers_step(trunk, past, ids, mask, self.mask_4d)

    def _prefill(self, trunk, ids, mask):
        """(hidden at each row's newest token, keys/values stacked (2, layers, rows, heads, L, hd))
        of whole windows. Each distinct window not in the store is computed once (one pass for
        all of them); rows of one stored window share its tensors (an expanded view: read only)."""
        if not self.reuse_prefills:
            self.stats["prefill_computed_rows"] += len(ids)
            return prefill_pass(trunk, ids, mask, stacked=True)

        def compute(rows):
            self.stats["prefill_computed_rows"] += len(rows)
            rows = torch.tensor(rows, device=ids.device)
            return prefill_pass(trunk, ids[rows], mask[rows], stacked=True)

        return stored_prefills(self.store, window_keys(ids, mask), compute)
