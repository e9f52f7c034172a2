"""KV cache for token-by-token rollouts, aligned with the env's observation window.

The env's observation is a fixed window of `L` columns, left-padded, newest
token last. One env step appends a token: the new window is the old one
shifted left by one column with the new token in the last column. The cache
stores, per row, the keys/values of the last window it saw, in the same
column layout, so a step that continues a row costs one incremental forward of
one token; the shifted-out column is always padding.

Whether a row continues is decided from the observations alone (new window
minus its last column == old window minus its first column). So resets,
restarts to an arbitrary state, partial auto-resets of a vector env, and even
reordered rows simply fail the check and are re-prefilled: a stale cache can
never be used. Weight updates make every cached key/value stale:
`invalidate()` on every weight sync.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that ignore left padding: the first real token is position 0."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


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


class WindowKVCache:
    def __init__(self):
        self.invalidate()
        self.stats = {"prefill_rows": 0, "incremental_rows": 0}

    def invalidate(self) -> None:
        self.ids = self.mask = self.layers = None

    @torch.no_grad()
    def hidden_at_last_token(self, trunk, obs: dict) -> torch.Tensor:
        """The trunk's final hidden state at each row's newest token, using and updating the cache."""
        ids, mask = obs["input_ids"], obs["attention_mask"]
        cont = continuing_rows(self.ids, self.mask, ids, mask)
        rows = torch.arange(ids.shape[0], device=ids.device)
        step_rows, fill_rows = rows[cont], rows[~cont]
        hidden = None
        new_layers = None
        if len(step_rows):
            # All rows continuing (the usual step): drop the shifted-out column as a view, no copy.
            select = slice(None) if len(step_rows) == len(rows) else step_rows
            past = DynamicCache(config=trunk.config)
            for layer, (k, v) in zip(past.layers, self.layers):
                k, v = k[select, :, 1:], v[select, :, 1:]
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
            m = mask[step_rows]
            out = trunk(input_ids=ids[step_rows, -1:], attention_mask=m,
                        position_ids=(m.sum(-1, keepdim=True) - 1), past_key_values=past, use_cache=True)
            h_step = out.last_hidden_state[:, -1]
            hidden = h_step.new_empty((ids.shape[0], h_step.shape[-1]))
            hidden[step_rows] = h_step
            new_layers = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        if len(fill_rows):
            m = mask[fill_rows]
            out = trunk(input_ids=ids[fill_rows], attention_mask=m, position_ids=position_ids_for(m), use_cache=True)
            h_fill = out.last_hidden_state[:, -1]
            if hidden is None:
                hidden = h_fill.new_empty((ids.shape[0], h_fill.shape[-1]))
            hidden[fill_rows] = h_fill
            fill_layers = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
            if new_layers is None:
                new_layers = fill_layers
            else:  # merge step rows and prefilled rows back into batch order
                merged = []
                for (ks, vs), (kf, vf) in zip(new_layers, fill_layers):
                    k = ks.new_empty((ids.shape[0],) + ks.shape[1:])
                    v = vs.new_empty((ids.shape[0],) + vs.shape[1:])
                    k[step_rows], v[step_rows], k[fill_rows], v[fill_rows] = ks, vs, kf, vf
                    merged.append((k, v))
                new_layers = merged
        self.ids, self.mask, self.layers = ids.clone(), mask.clone(), new_layers
        self.stats["prefill_rows"] += len(fill_rows)
        self.stats["incremental_rows"] += len(step_rows)
        return hidden
