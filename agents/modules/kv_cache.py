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
"""
from __future__ import annotations

import torch
from transformers import DynamicCache


# Batch column an EnvRunner may add: bool per row, True where the row's observation is the
# previous call's same row plus one appended token (its cache and per-row state carry on).
ROW_CONTINUES = "row_continues"


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that ignore left padding: the first real token is position 0."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


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


def rows_that_continue(prev_ids, prev_mask, ids: torch.Tensor, mask: torch.Tensor, cont=None) -> torch.Tensor:
    """`cont` when the caller knows it (as a bool tensor on ids' device), else `continuing_rows`."""
    if cont is None or prev_ids is None or prev_ids.shape != ids.shape:
        return continuing_rows(prev_ids, prev_mask, ids, mask)
    return torch.as_tensor(cont, dtype=torch.bool, device=ids.device)


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
    import copy

    outs = []
    for attention in (mask, step_attention_mask(mask, trunk.dtype)):
        try:
            out = trunk(input_ids=ids[:, -1:], attention_mask=attention, position_ids=mask.sum(-1, keepdim=True) - 1,
                        past_key_values=copy.deepcopy(past), use_cache=True)
        except (RuntimeError, ValueError, TypeError):
            return False
        outs.append(out.last_hidden_state[:, -1].float())
    return bool(torch.allclose(outs[0], outs[1], atol=1e-4, rtol=1e-4))


class WindowKVCache:
    def __init__(self):
        self.invalidate()
        self.stats = {"prefill_rows": 0, "incremental_rows": 0}
        self.mask_4d = None  # whether one-token steps pass a ready 4-D mask (decided at the first step)

    def invalidate(self) -> None:
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
            hidden, self.past = self._prefill(trunk, ids, mask)
            return hidden
        step_rows, fill_rows = torch.nonzero(cont)[:, 0], torch.nonzero(~cont)[:, 0]
        past = DynamicCache(config=trunk.config)
        for layer, (k, v) in zip(past.layers, self.layers):
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k[step_rows], v[step_rows]
        h_step = self._step(trunk, past, ids[step_rows], mask[step_rows])
        h_fill, filled = self._prefill(trunk, ids[fill_rows], mask[fill_rows])
        for layer, fill in zip(past.layers, filled.layers):  # both parts back in batch order
            layer.keys = merge_rows(layer.keys, fill.keys, step_rows, fill_rows)
            layer.values = merge_rows(layer.values, fill.values, step_rows, fill_rows)
        self.past = past
        return merge_rows(h_step, h_fill, step_rows, fill_rows)

    def _step(self, trunk, past, ids, mask) -> torch.Tensor:
        """One cached token per row: drop the column shifted out of the window (padding, a view)."""
        for layer in past.layers:
            layer.keys, layer.values = layer.keys[:, :, 1:], layer.values[:, :, 1:]
        if self.mask_4d is None:  # first step: check the cheap mask against the model's own (else keep 2-D)
            self.mask_4d = _same_step_with_4d_mask(trunk, past, ids, mask)
        attention = step_attention_mask(mask, trunk.dtype) if self.mask_4d else mask
        out = trunk(input_ids=ids[:, -1:], attention_mask=attention, position_ids=mask.sum(-1, keepdim=True) - 1,
                    past_key_values=past, use_cache=True)
        return out.last_hidden_state[:, -1]

    @staticmethod
    def _prefill(trunk, ids, mask):
        out = trunk(input_ids=ids, attention_mask=mask, position_ids=position_ids_for(mask), use_cache=True)
        return out.last_hidden_state[:, -1], out.past_key_values
