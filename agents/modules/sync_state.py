"""What a weight sync carries of a module's state, one rule for every sync.

`synced_tensors`: each tensor once (tied weights under their first key), less the keys the module's
`sync_skips` names (learner-only parts; with LoRA the frozen base, the same on both sides). The
colocated sync copies exactly these (agents/weight_sync.py); a remote sync sends them as numpy
arrays (`lean_state`), and the receiving module copies them into its own (`from_lean_state`, then
`SyncedState._copy_state`). `SyncedState` is the policy modules' state API built on it
(mixed into `CausalLMActorCritic`).
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from agents.models import DTYPES, has_lora, is_adapter_key
from agents.modules.host_transfers import HostTransfers

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


class SyncedState:
    """A policy module's state: RLlib's, the lean state of a weight sync, and the copy-in that
    receives either (the module provides `lm`, `inference_only`, `model_config`)."""

    lean_sync = True  # False: weight syncs send RLlib's inference state (benchmarks/weight_sync.py's "before")

    def get_state(self, *args, inference_only: bool = False, **kwargs):
        """RLlib's state (numpy arrays), bf16 weights as float32 (numpy has no bfloat16). With
        LoRA, the state EnvRunners receive (inference_only) holds the adapters only: the base
        weights are frozen, and every module builds the same ones from the config. A learner's
        inference state (what a weight sync sends) is `sync_state`'s."""
        if inference_only and not self.inference_only and self.lean_sync:  # (components: as TorchRLModule, none)
            return self.sync_state()
        if not any(p.dtype == torch.bfloat16 for p in self.parameters()):
            state = super().get_state(*args, inference_only=inference_only, **kwargs)
        else:
            from ray.rllib.utils.numpy import convert_to_numpy

            state = self.state_dict()
            if inference_only and not self.inference_only:  # as TorchRLModule.get_state
                drop = tuple(a + "." for a in self.get_non_inference_attributes())
                state = {k: v for k, v in state.items() if not k.startswith(drop)}
            state = convert_to_numpy({k: v.float() if v.dtype == torch.bfloat16 else v for k, v in state.items()})
        if inference_only and has_lora(self.lm):
            state = {k: v for k, v in state.items() if not self._frozen_base_key(k)}
        return state

    def sync_state(self) -> dict:
        """What a weight sync sends EnvRunners (`agents.modules.sync_state.lean_state`): the
        inference weights once each, with LoRA the adapters only, the LM in the rollout precision,
        from a GPU through pinned buffers. `set_state` takes it back."""
        # auto: float32, or what every EnvRunner settled on its device (`settle_sync_dtype`)
        dtype = self.__dict__.get("sync_dtype") or DTYPES.get(self.model_config.get("rollout_precision"), torch.float32)
        cast = lambda key, t: t.to(dtype) if t.is_floating_point() and key.startswith(("lm.", "mask_lm.")) else t  # noqa: E731
        if "_sync_transfers" not in self.__dict__:
            self.__dict__["_sync_transfers"] = HostTransfers()
        return lean_state(self, cast, self.__dict__["_sync_transfers"])

    def _copy_state(self, state) -> bool:
        """Copies `state` into the module's tensors where it holds exactly the module's state
        keys with their shapes, or those less tied duplicates and keys a sync leaves out
        (`sync_state`; a weight sync: on the quickstart's module a `set_state` took 190 us this
        way against 460 us through `load_state_dict`, one-off timing), and says whether it did."""
        own = self.state_dict(keep_vars=True)
        if own.keys() != state.keys() and synced_tensors(self).keys() != state.keys():
            return False
        if any(tuple(own[k].shape) != tuple(np.shape(v)) for k, v in state.items()):
            return False
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # Ray's arrays are read-only; copy_ only reads them
            for k, v in state.items():
                own[k].copy_(torch.as_tensor(v))
        return True

    @staticmethod
    def _frozen_base_key(key: str) -> bool:
        return key.startswith(("lm.", "mask_lm.")) and not is_adapter_key(key)

    def set_state(self, state) -> None:
        from ray.rllib.utils.torch_utils import convert_to_torch_tensor

        state = from_lean_state(state)
        if has_lora(self.lm) and self.inference_only:  # adapters only (see get_state)
            missing, _ = self.load_state_dict(convert_to_torch_tensor(state), strict=False)
            lacking = [k for k in missing if not self._frozen_base_key(k)]
            if lacking:
                raise ValueError(f"the policy's state lacks {lacking}")
        else:
            if not self._copy_state(state):
                super().set_state(state)
        self.weights_changed()


    def sync_skips(self, key: str) -> bool:
        """State keys a weight sync leaves out (`agents.modules.sync_state`): the learner-only
        parts, and with LoRA the frozen base (the same weights on both sides; only adapters train)."""
        if not self.inference_only and key.startswith(tuple(a + "." for a in self.get_non_inference_attributes())):
            return True
        return has_lora(self.lm) and self._frozen_base_key(key)
