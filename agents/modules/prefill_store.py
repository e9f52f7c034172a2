"""Prefilled windows kept by content, and the stacked layout their keys/values travel in.

A prefill's keys and values travel as one tensor, (2, layers, rows, heads, L, head_dim) (keys at
index 0, values at 1), not as a list of per-layer pairs: writing restarted rows into the decode
engine's ring, storing a window and putting rows together are then one tensor op each, not two
per layer. On a GPU, where every eager op is a kernel launch, that is what a step that restarts
rows costs beyond the captured step.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

PREFILL_STORE_BYTES = 64 << 20  # per cache; a window larger than this is never stored (only shared within a call)


def stack_layers(layers) -> torch.Tensor:
    """Per-layer [(keys, values)] (each (rows, heads, L, hd)) as one (2, layers, rows, heads, L, hd)
    tensor; a tensor already stacked is returned as it is."""
    if isinstance(layers, torch.Tensor):
        return layers
    return torch.stack([torch.stack([k for k, _ in layers]), torch.stack([v for _, v in layers])])


def unstack_layers(kv: torch.Tensor) -> list:
    """`stack_layers`' inverse, as views: [(keys, values)] per layer."""
    return list(zip(kv[0].unbind(0), kv[1].unbind(0)))


def window_keys(ids: torch.Tensor, mask: torch.Tensor) -> list[bytes]:
    """One hashable key per row: its window's tokens and mask."""
    both = torch.cat([ids, mask], dim=-1).cpu().numpy()
    return [row.tobytes() for row in both]


class PrefillStore:
    """Prefilled windows by content, least recently used first out, at most `max_bytes` of
    keys/values: window key -> (hidden at the newest token, keys/values (2, layers, heads, L, hd)),
    one row's (no batch dimension)."""

    def __init__(self, max_bytes: int = PREFILL_STORE_BYTES):
        self.max_bytes = max_bytes
        self.entries: OrderedDict = OrderedDict()
        self.bytes = 0

    @staticmethod
    def size(entry) -> int:
        hidden, kv = entry
        return hidden.nbytes + kv.nbytes

    def get(self, key):
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def put(self, key, entry) -> None:
        size = self.size(entry)
        if size > self.max_bytes or key in self.entries:
            return
        while self.bytes + size > self.max_bytes:
            self.bytes -= self.size(self.entries.popitem(last=False)[1])
        self.entries[key] = entry
        self.bytes += size

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0


def stored_prefills(store: PrefillStore, keys: list, compute) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden (rows, D), keys/values stacked (2, layers, rows, heads, L, hd)) for windows `keys`,
    each distinct window not in `store` computed once: `compute(rows)` -> (hidden, stacked) of
    those batch rows (one pass for all of them). Where every row holds the same window, the keys/values
    are an expanded view of its stored entry (no copy; read only)."""
    entries = {key: store.get(key) for key in dict.fromkeys(keys)}
    todo = [key for key, entry in entries.items() if entry is None]
    if todo:
        first = {key: row for row, key in reversed(list(enumerate(keys)))}
        hidden, kv = compute([first[key] for key in todo])
        if len(todo) == len(keys):  # every row computed, in order: nothing to put together
            for j, key in enumerate(todo):
                store.put(key, (hidden[j].clone(), kv[:, :, j].clone()))
            return hidden, kv
        for j, key in enumerate(todo):
            entries[key] = (hidden[j].clone(), kv[:, :, j].clone())
            store.put(key, entries[key])
    if len(entries) == 1:
        hidden, kv = next(iter(entries.values()))
        n = len(keys)
        return hidden.expand(n, *hidden.shape).clone(), kv.unsqueeze(2).expand(kv.shape[:2] + (n,) + kv.shape[2:])
    rows = [entries[key] for key in keys]
    return torch.stack([h for h, _ in rows]), torch.stack([kv for _, kv in rows], 2)
