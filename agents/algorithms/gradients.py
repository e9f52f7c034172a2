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

`UpdateClipping` (`training.update_clipping`) adds StableAdamW's update clipping to a torch Adam.
"""
from __future__ import annotations

import math

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
            super().apply_gradients(gradients_dict)
            return self.log_update_clipping()
        for pid, grad in gradients_dict.items():
            self._params[pid].grad = grad
        for module_id, names in self._module_optimizers.items():
            for name in names:
                self.get_optimizer(module_id, name).step()
        self.log_update_clipping()

    def log_update_clipping(self) -> None:
        """With `training.update_clipping`: the smallest scale any tensor's step took in this
        iteration's updates (`update_clip_scale`; 1: none was clipped)."""
        for module_id, names in self._module_optimizers.items():
            for name in names:
                clipping = update_clipping_of(self.get_optimizer(module_id, name))
                if clipping is not None and clipping.last_scale is not None:
                    log_clip_scale(self.metrics, module_id, clipping.last_scale)
                    clipping.last_scale = None  # a later update whose optimizer does not step logs nothing


class UpdateClipping:
    """StableAdamW's update clipping (Wortsman et al. 2023, "Stable and low-precision training for
    large-scale vision-language models", Adafactor's clipping in AdamW) on a torch Adam: each
    parameter tensor's step is scaled by 1 / max(1, RMS), where RMS = sqrt(mean(g^2 / max(v, eps^2)))
    over the tensor, g its gradient and v Adam's bias-corrected second moment after this step.
    Where v still describes the gradients (RMS about 1 or below) Adam's step is unchanged. Where a
    gradient far larger than those of recent steps arrives, as when a nearly deterministic policy
    samples a rare continuation after hundreds of updates with gradients near zero, v is out of
    date, and plain Adam would step each coordinate by up to about 3x the lr at once
    (docs/results/plateau.md).

    It hooks the optimizer's step (a pre-hook copies the parameters, a post-hook scales each
    tensor's change), so every path that steps the optimizer takes it: RLlib's, the fused one and
    the static update, captured with it (tensor ops only, no host read). A skipped step (a
    non-finite gradient) stays skipped. `last_scale` is the smallest scale of the last step (1: no
    tensor clipped), a tensor on the parameters' device."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.before: dict = {}  # parameter -> its copy from before the step (made once, reused)
        self.last_scale = None
        self._sizes: dict = {}  # (group index, ids of its stepped tensors) -> sqrt(numel) of each, on their device
        optimizer.update_clipping = self
        optimizer.register_step_pre_hook(self._copy_params)
        optimizer.register_step_post_hook(self._scale_steps)

    @staticmethod
    def _stepped(group) -> list:
        return [p for p in group["params"] if p.grad is not None]

    @torch.no_grad()
    def _copy_params(self, optimizer, args, kwargs) -> None:
        params = [p for group in optimizer.param_groups for p in self._stepped(group)]
        for p in params:
            if p not in self.before:
                self.before[p] = torch.empty_like(p)
        if params:
            torch._foreach_copy_([self.before[p] for p in params], params)

    @torch.no_grad()
    def _scale_steps(self, optimizer, args, kwargs) -> None:
        smallest = []
        for index, group in enumerate(optimizer.param_groups):
            params = [p for p in self._stepped(group) if p in self.before and "exp_avg_sq" in optimizer.state[p]]
            if not params:
                continue
            beta2, eps = group["betas"][1], group["eps"]
            step = optimizer.state[params[0]]["step"]
            correction = (1.0 - beta2 ** step.to(device=params[0].device, dtype=torch.float32))
            denominators = torch._foreach_div([optimizer.state[p]["exp_avg_sq"] for p in params], correction)
            torch._foreach_clamp_min_(denominators, eps * eps)
            torch._foreach_sqrt_(denominators)
            ratios = torch._foreach_div([p.grad for p in params], denominators)
            norms = torch.stack(torch._foreach_norm(ratios, 2.0)).float()
            key = (index, *map(id, params))
            if key not in self._sizes:  # made on the first (eager) step, by fills: no host-to-device copy
                self._sizes[key] = torch.stack([torch.full((), math.sqrt(p.numel()), device=norms.device)
                                                for p in params])
            rms = norms / self._sizes[key]
            # 1 / max(1, RMS); 1 where the step was skipped (fused Adam's found_inf) or RMS is not
            # finite (a non-finite gradient): the parameters did not move, and the scale says so
            clip = torch.isfinite(rms) & (rms > 1.0)
            found_inf = getattr(optimizer, "found_inf", None)
            if found_inf is not None:
                clip = clip & (found_inf.to(rms.device) == 0)
            scale = torch.where(clip, 1.0 / rms, torch.ones_like(rms))
            # p + (1 - scale) (before - p): the step scaled; a scale of 1 leaves p as it is, bit for bit
            weights = (1.0 - scale).unbind()
            torch._foreach_lerp_(params, [self.before[p] for p in params],
                                 [w if w.dtype == p.dtype else w.to(p.dtype) for w, p in zip(weights, params)])
            smallest.append(scale.min())
        self.last_scale = torch.stack(smallest).min() if smallest else None


def log_clip_scale(metrics, module_id, scale) -> None:
    """`update_clip_scale`: the smallest of the iteration's updates (a windowed min: its pushes only
    append, so no device sync before the iteration's reduce)."""
    metrics.log_value((module_id, "update_clip_scale"), scale.detach(), reduce="min", window=1000)


def update_clipping_of(optimizer) -> UpdateClipping | None:
    """The optimizer's `UpdateClipping`, or None."""
    return getattr(optimizer, "update_clipping", None)
