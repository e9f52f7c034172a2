"""What a weight sync carries of a module's state, one rule for every sync.

`synced_tensors`: each tensor once (tied weights under their first key), less the keys the module's
`sync_skips` names (learner-only parts; with LoRA the frozen base, the same on both sides). The
colocated sync copies exactly these (agents/weight_sync.py); a remote sync sends them as numpy
arrays (`lean_state`), and the receiving module copies them into its own (`from_lean_state`, then
`CausalLMActorCritic._copy_state`).
"""
from __future__ import annotations

import warnings

import torch

SYNC_BF16 = "__bf16_as_int16__"  # a lean state's key: the keys whose bf16 tensors travel as int16 bits


def synced_tensors(module: torch.nn.Module) -> dict:
    """{state key: tensor} a weight sync carries of `module` (see the module docstring)."""
    skip = getattr(module, "sync_skips", lambda key: False)
    out, seen = {}, set()
    for key, t in module.state_dict(keep_vars=True).items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        if not skip(key):
            out[key] = t.detach()
    return out


@torch.no_grad()
def lean_state(module: torch.nn.Module, cast, transfers) -> dict:
    """`synced_tensors` as numpy arrays on the host: each cast by `cast(key, tensor)` (the rollout
    precision), brought down by `transfers` (a `HostTransfers`: from a GPU through pinned buffers
    kept for the next sync, one device sync), bf16 as its bits in int16 arrays (numpy has no
    bfloat16), listed under SYNC_BF16."""
    picked = {k: cast(k, t) for k, t in synced_tensors(module).items()}
    bf16 = [k for k, t in picked.items() if t.dtype == torch.bfloat16]
    state = transfers.to_host({k: t.view(torch.int16) if k in bf16 else t for k, t in picked.items()})
    if bf16:
        state[SYNC_BF16] = bf16
    return state


def from_lean_state(state) -> dict:
    """A state as a module loads it: `lean_state`'s int16 arrays back to bf16 tensors."""
    if SYNC_BF16 not in state:
        return state
    state = dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Ray's arrays are read-only; only read here
        for k in state.pop(SYNC_BF16):
            state[k] = torch.as_tensor(state[k]).view(torch.bfloat16)
    return state
