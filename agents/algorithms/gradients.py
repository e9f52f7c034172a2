"""RLlib's gradient clipping and finite-gradient check, each in a few fused ops.

RLlib's TorchLearner handles gradients one tensor at a time: clipping by global norm takes a
norm, a `nan_to_num` and a multiply per tensor, and `apply_gradients` asks
`torch.isfinite(grad).all()` of every tensor twice (before setting it, and again before the
optimizer steps). Each of those questions is a device-to-host sync, so on a GPU a GPT-2-small
update (150 tensors) waited for the device 313 times and spent 49.5 of its 122 ms of host
time in these loops (`benchmarks/ppo_profile.py --device cuda`, docs/results/gpu.md).

`FusedGradients` gives a learner the same arithmetic with foreach ops and one host read in
`apply_gradients` (RLlib's: two per tensor):
  * clipping by global norm: one `_foreach_norm`, the same `nan_to_num`s on the norms, one
    `_foreach_mul_` (RLlib's other clip modes are RLlib's). On the CPU the results equal RLlib's
    bit for bit; on CUDA the fused norm kernel sums in another order, so the global norm (and
    the clip factor) may differ in the last bits;
  * `apply_gradients`: one screen of every gradient: every per-tensor norm is finite only if every
    element is (a finite tensor whose norm overflows fails the screen too). When it passes, the
    gradients are set and the optimizers step, which is what RLlib does with finite gradients.
    When it fails, and wherever RLlib's method does more (a loss scaler, torch lr schedulers,
    `torch_skip_nan_gradients`), RLlib's own `apply_gradients` decides, per tensor, warnings and
    `nan_to_num` included.
"""
from __future__ import annotations

import torch
from ray.rllib.utils.torch_utils import clip_gradients as rllib_clip_gradients

OVERFLOW = 10e8  # RLlib's `compute_global_norm` replaces +-inf norms by +-this


def clip_gradients(gradients_dict: dict, *, grad_clip=None, grad_clip_by: str = "value"):
    """RLlib's `clip_gradients` (in place; returns the global norm for `global_norm`), with
    `global_norm` computed and applied by foreach ops, no per-tensor loop (RLlib's values on the
    CPU; on CUDA up to the norm's summation order)."""
    if grad_clip is None or grad_clip_by != "global_norm":
        return rllib_clip_gradients(gradients_dict, grad_clip=grad_clip, grad_clip_by=grad_clip_by)
    grads = [g.detach() for g in gradients_dict.values() if g is not None]
    if not grads:
        return torch.tensor(0.0)
    return clip_by_global_norm(grads, grad_clip)[0]


def clip_by_global_norm(grads: list, grad_clip):
    """Scales `grads` (in place) by min(1, grad_clip / global norm), RLlib's `global_norm` clip
    (None: no clipping). Returns (the global norm, each tensor's norm before clipping: finite only
    where every element of the tensor is)."""
    norms = torch.stack(torch._foreach_norm(grads, 2.0))
    total_norm = torch.norm(norms.nan_to_num(neginf=-OVERFLOW, posinf=OVERFLOW), 2.0).nan_to_num(
        neginf=-OVERFLOW, posinf=OVERFLOW)
    if grad_clip is not None:
        coeff = torch.clamp(grad_clip / torch.clamp(total_norm + 1e-6, min=grad_clip), max=1.0)
        torch._foreach_mul_(grads, coeff)
    return total_norm, norms


def all_finite(grads: list) -> bool:
    """True when every element of every tensor is finite (one device sync). A False may also
    mean a finite tensor whose norm overflows: callers then check per tensor."""
    return not grads or bool(torch.stack(torch._foreach_norm(grads, 2.0)).isfinite().all())


class FusedGradients:
    """Mixin for a TorchLearner: gradient clipping and the finite check in fused ops."""

    @staticmethod
    def _get_clip_function():
        return clip_gradients

    def apply_gradients(self, gradients_dict) -> None:
        if (self.config.torch_skip_nan_gradients or self._grad_scalers is not None
                or self._lr_scheduler_classes is not None
                or not all_finite([g for g in gradients_dict.values() if g is not None])):
            return super().apply_gradients(gradients_dict)
        for pid, grad in gradients_dict.items():
            self._params[pid].grad = grad
        for module_id, names in self._module_optimizers.items():
            for name in names:
                self.get_optimizer(module_id, name).step()
