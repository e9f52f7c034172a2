"""The learner's update as one static function of bucketed shapes, replayed as a CUDA graph on a
GPU (`training.static_update`).

On a GPU a PPO update at GPT-2-small shape is bound by the host's kernel launches: about 9 ms of
device time against about 60 ms of host time per update (docs/results/gpu.md, run 4). Here a
minibatch's forward pass, loss, backward pass, gradient clipping and optimizer step are one
function of tensors of fixed shapes, with no host sync and no Python branch on data:
  * the minibatch's sequences (one learner pass each, `sequence_groups`, made beforehand) are
    padded to a multiple of SEQ_BUCKET rows over the env's whole window, its steps to a multiple
    of ROW_BUCKET; a padding step weighs 0 in every mean;
  * means over the loss steps are weighted sums (`WeightedMean`: no boolean indexing), and so is
    the explained variance (over the loss steps; RLlib's is over every row, the same where every
    row is a loss step, as in token episodes that all terminated);
  * a non-finite gradient skips the whole optimizer step on the device (fused Adam's
    `found_inf`; RLlib's `apply_gradients` would drop the non-finite tensors' gradients only);
  * the learning rate and the entropy coefficient are device tensors filled before each update,
    so schedules apply.
On CUDA a bucket's first update runs the function eagerly on a side stream with device syncs
made errors (kernels picked, workspaces allocated, optimizer state made; a sync means it cannot be
captured, and the bucket stays eager), its second is captured as a `torch.cuda.CUDAGraph` and
replayed, later ones replayed: one launch where there were thousands. The graphs share one memory
pool (replays run one at a time, outputs are copied out at once). The learner logs
`static_update_replays` per iteration. On the CPU the same function runs eagerly, which the tests
compare with RLlib's update. Still on the host per update: the sequence groups (`sequence_groups`,
a few device syncs) and the padding.

It applies (`static_blocker`) to one learner updating one module with a `loss_terms` method (PPO, A2C/A3C),
a plain GPT-2 trunk that `gpt2_forward` runs, no truncation sampler, no MLE term, no fp16 loss
scaler or torch lr scheduler, one fused Adam optimizer and `grad_clip_by: global_norm`; else the
update is RLlib's. A restored optimizer state drops the captured graphs (they hold its tensors).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from ray.rllib.core.columns import Columns

from agents.algorithms.gradients import clip_by_global_norm, log_clip_scale, update_clipping_of
from agents.core import PASS_ROWS, SEQ_ID
from agents.models import static_pass
from agents.modules.kv_cache import gpt2_forward_blocks, lean_forward_verdict, sequence_groups

logger = logging.getLogger(__name__)

SEQ_BUCKET = 16  # a static pass's sequences: a multiple of this
ROW_BUCKET = 128  # its steps: a multiple of this
MAX_GRAPHS = 8  # captured buckets per learner (one memory pool); updates of further buckets run eagerly
# The captured buckets share one memory pool. PyTorch calls that safe where graphs replay in the
# order they were captured, which buckets do not keep; this update's graphs hold nothing in the
# pool from one replay to the next (outputs are copied out at once), but False gives each graph
# its own pool (more memory) to rule that out (`peer_trl.py --static-private-pools`).
SHARED_POOL = True
STEP_WEIGHT = "static_step_weight"  # each step's weight in a mean: 1 / (loss steps) or 0
STEP_COUNT = "static_step_count"  # the number of loss steps (the explained variance's n)
ENTROPY_COEFF = "static_entropy_coeff"
PASS_KEYS = ("ids", "mask", "inverse", "column")
SMALL_NUMBER = 1e-6  # RLlib's, in its explained variance


def round_up(n: int, k: int) -> int:
    return -(-n // k) * k


class WeightedMean:
    """The static update's reductions: means and RLlib's explained variance over the loss steps as
    sums weighted by `weight` (1/n at a loss step, 0 elsewhere, padding included)."""

    def __init__(self, weight: torch.Tensor, count: torch.Tensor):
        self.weight, self.count, self.kept = weight, count, weight > 0

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        # a row of weight 0 adds nothing even where it holds inf or NaN (as RLlib's x[mask] leaves it out)
        return (torch.where(self.kept, x, 0.0) * self.weight).sum()

    def _variance(self, x: torch.Tensor) -> torch.Tensor:  # unbiased, as torch.var
        return self.mean((x - self.mean(x)).pow(2)) * self.count / (self.count - 1).clamp(min=1)

    def explained_variance(self, y: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
        return torch.clamp(1 - self._variance(y - pred) / (self._variance(y) + SMALL_NUMBER), min=-1.0)


def static_inputs(batch: dict, entropy_coeff) -> tuple[tuple, dict]:
    """(bucket, inputs): a minibatch's tensors for the static function, its sequences and steps
    padded to multiples of SEQ_BUCKET and ROW_BUCKET; the bucket is every input's name, dtype and
    shape (what a captured graph's static inputs must match). Eager (`sequence_groups` reads the
    groups back to the host)."""
    obs = batch[Columns.OBS]
    ids, mask = obs["input_ids"], obs["attention_mask"]
    rep, inverse, column = sequence_groups(mask, batch[SEQ_ID])
    steps = len(inverse)
    padded = (round_up(len(rep), SEQ_BUCKET), round_up(steps, ROW_BUCKET))

    def pad(x: torch.Tensor, n: int) -> torch.Tensor:
        return F.pad(x, [0, 0] * (x.dim() - 1) + [0, n - len(x)])

    valid = batch[Columns.LOSS_MASK].float() if Columns.LOSS_MASK in batch else torch.ones(steps, device=ids.device)
    count = valid.sum()
    inputs = {"ids": pad(ids[rep], padded[0]), "mask": pad(mask[rep], padded[0]),
              "inverse": pad(inverse, padded[1]), "column": pad(column, padded[1]),
              STEP_WEIGHT: pad(valid / count, padded[1]), STEP_COUNT: count,
              ENTROPY_COEFF: torch.as_tensor(entropy_coeff, dtype=torch.float32).to(ids.device).reshape(())}
    for key, value in batch.items():
        if key not in (Columns.OBS, SEQ_ID) and torch.is_tensor(value) and value.dim() and len(value) == steps:
            inputs[key] = pad(value, padded[1])
    return tuple(sorted((k, str(v.dtype), tuple(v.shape)) for k, v in inputs.items())), inputs


def static_config_blocker(cfg: dict) -> str | None:
    """What in a validated YAML config keeps the static update from applying (the reason, naming
    the field), None: nothing (the model's own structure is checked when the learner runs)."""
    t, model = cfg["training"], cfg["model"]
    if cfg["sampler"]["name"] != "none":
        return f"does not apply with a truncation sampler (sampler.name: {cfg['sampler']['name']})"
    checks = (
        (t.get("mle_coef", 0) > 0, "training.mle_coef > 0 (the MLE term draws reference pairs on the host)"),
        (t["precision"] == "fp16", "training.precision fp16 (its loss scaler steps on the host)"),
        (t["gradient_checkpointing"], "training.gradient_checkpointing"),
        (model.get("lora") is not None, "model.lora"),
        (model.get("kind") == "seq2seq", "model.kind seq2seq"),
        ((cfg["learners"]["num_learners"] or 0) > 1, "learners.num_learners > 1"),
    )
    return next((f"does not apply with {why}" for hit, why in checks if hit), None)


def trunks(module) -> list:
    """The trunks a module's training pass runs."""
    return [module._trunk(module.lm)] + ([module.value_trunk] if hasattr(module, "value_trunk") else [])


def static_blocker(learner, batch: dict) -> str | None:
    """Why this learner's update of `batch` cannot run as the static function; None: it can."""
    if len(batch) != 1:
        return "the batch holds several modules"
    (module_id, module_batch), = batch.items()
    module = learner.module[module_id].unwrapped()
    cfg = learner.config
    if not hasattr(learner, "loss_terms"):
        return f"{type(learner).__name__} has no loss_terms"
    if not getattr(module, "serves_static_update", False):
        return f"{type(module).__name__}'s training pass is not a static one"
    if module.sampler.active:
        return "a truncation sampler masks the training logits"
    if getattr(learner, "mle_pairs", None) is not None:
        return "the MLE term draws reference pairs on the host"
    if learner._grad_scalers is not None or learner._lr_scheduler_classes is not None:
        return "fp16's loss scaler or a torch lr scheduler steps on the host"
    if cfg.num_learners > 1:
        return "several learners all-reduce their gradients"
    if cfg.grad_clip is not None and cfg.grad_clip_by != "global_norm":
        return f"grad_clip_by {cfg.grad_clip_by!r} (only global_norm)"
    optimizers = learner.get_optimizers_for_module(module_id)
    if len(optimizers) != 1 or not (isinstance(optimizers[0][1], torch.optim.Adam)
                                    and all(g.get("fused") for g in optimizers[0][1].param_groups)):
        return "the module's optimizer is not one fused Adam (a restored state keeps its saved kernel choice)"
    if SEQ_ID not in module_batch or not isinstance(module_batch.get(Columns.OBS), dict):
        return "the batch has no sequence ids or no windows"
    device = next(module.lm.parameters()).device.type
    with module.autocast():
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    for trunk in trunks(module):
        if gpt2_forward_blocks(trunk, dtype) is None or lean_forward_verdict(trunk) is False:
            return f"the trunk ({type(trunk).__name__}) is not one the tensor-op pass runs"
    return None


class _Bucket:
    """One bucket's capture: its static inputs, graph (None: not captured yet; False: not to be
    captured), outputs and learning rates (device tensors, one per param group)."""

    def __init__(self, static: dict):
        self.static, self.graph, self.out, self.lrs = static, None, None, None


class StaticUpdate:
    """Mixin for a TorchLearner (before RLlib's class): `_update` as the static function where
    `training.static_update` is on and `static_blocker` finds nothing, else RLlib's."""

    def build(self) -> None:
        super().build()
        self.drop_static_graphs()
        self._static_warned = False

    def drop_static_graphs(self) -> None:
        """Forgets the captured graphs (they hold the optimizer state's tensors)."""
        self._static_graphs: dict = {}  # bucket -> _Bucket
        self._static_pool = None  # the graphs' shared memory pool (replays run one at a time)
        self.static_last_bucket = None  # the last static update's bucket

    def set_state(self, state):
        super().set_state(state)
        self.drop_static_graphs()

    def _update(self, batch):
        self.static_last_bucket = None
        if not getattr(self.config, "static_update", False):
            return super()._update(batch)
        blocker = static_blocker(self, batch)
        if blocker is not None:
            if not self._static_warned:
                logger.warning("training.static_update: %s; the update runs RLlib's way", blocker)
                self._static_warned = True
            return super()._update(batch)
        self._compute_off_policyness(batch)
        (module_id, module_batch), = batch.items()
        entropy_coeff = self.entropy_coeff_schedulers_per_module[module_id].get_current_value()
        bucket, inputs = static_inputs(module_batch, entropy_coeff)
        self.static_last_bucket = bucket
        (total, metrics), replayed = self._static_run(module_id, bucket, inputs)
        scale = metrics.pop("update_clip_scale", None)
        if scale is not None:  # as the eager path logs it (FusedGradients.log_update_clipping)
            log_clip_scale(self.metrics, module_id, scale)
        self.metrics.log_dict(metrics, key=module_id, window=1)
        self.metrics.log_value((module_id, "static_update_replays"), float(replayed), reduce="sum")
        return {}, {module_id: total}, {}

    def _static_run(self, module_id, bucket, inputs) -> tuple:
        """The update of one padded minibatch, eager or a CUDA graph's replay: ((the loss, its
        metrics), whether it was a replay). On CUDA a bucket's first update is eager on a side
        stream with device syncs made errors (a sync there means the function cannot be captured:
        the bucket stays eager), its second is captured and replayed, later ones replayed."""
        module = self.module[module_id]
        optimizer = self.get_optimizers_for_module(module_id)[0][1]
        entry = self._static_graphs.get(bucket)
        checked = all(lean_forward_verdict(t) is True for t in trunks(module.unwrapped()))
        # a bucket not captured yet, with MAX_GRAPHS captured, stays eager (no warm-up, no inputs kept)
        full = ((entry is None or entry.graph is None)
                and sum(1 for e in self._static_graphs.values() if e.graph) >= MAX_GRAPHS)
        if (next(module.parameters()).device.type != "cuda" or not checked or full
                or (entry is not None and entry.graph is False)):
            return self._eager(module_id, optimizer, inputs), False
        if entry is None:
            entry = self._static_graphs[bucket] = _Bucket(inputs)
            out = self._warm_up(module_id, optimizer, inputs)
            if out is None:
                entry.graph = False
                return self._eager(module_id, optimizer, inputs), False
            return out, False
        for key, value in inputs.items():
            entry.static[key].copy_(value)
        if entry.graph is None:
            self._capture(module_id, optimizer, entry)
        for group, lr in zip(optimizer.param_groups, entry.lrs):
            lr.fill_(group["lr"])
        entry.graph.replay()
        values, names = entry.out
        return self._unpack(module_id, values.clone(), names), True

    def _eager(self, module_id, optimizer, inputs) -> tuple:
        optimizer.zero_grad(set_to_none=True)
        return self._unpack(module_id, *self._static_step(module_id, inputs))

    def _warm_up(self, module_id, optimizer, inputs):
        """The static function run eagerly on a side stream (kernels picked, workspaces and the
        optimizer state made before capture) with device syncs made errors: its outputs, or None
        where it synced (nothing was stepped: the optimizer steps last)."""
        stream, mode = torch.cuda.Stream(), torch.cuda.get_sync_debug_mode()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                torch.cuda.set_sync_debug_mode("error")
                optimizer.zero_grad(set_to_none=True)
                out = self._static_step(module_id, inputs)
        except RuntimeError as err:
            logger.warning("training.static_update: the update synced with the host (%s); it runs eagerly, "
                           "not as a CUDA graph", str(err).splitlines()[0])
            return None
        finally:
            torch.cuda.set_sync_debug_mode(mode)
            torch.cuda.current_stream().wait_stream(stream)
        return self._unpack(module_id, *out)

    def _capture(self, module_id, optimizer, entry: _Bucket) -> None:
        """Captures the static function on `entry.static` as a CUDA graph. The optimizer steps from
        device tensor learning rates, filled before each replay (the param groups keep their float
        `lr` for RLlib's schedules and checkpoints). A capture that fails stops the run with one
        line: PyTorch leaves a failed capture's stream and memory pool unusable."""
        if self._static_pool is None and SHARED_POOL:
            self._static_pool = torch.cuda.graph_pool_handle()
        optimizer.zero_grad(set_to_none=True)  # backward in the graph writes fresh gradient buffers
        saved = [(group["lr"], group["capturable"]) for group in optimizer.param_groups]
        lrs = [torch.full((), float(group["lr"]), device=entry.static["ids"].device) for group in optimizer.param_groups]
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"], group["capturable"] = lr, True
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(torch.cuda.current_stream()):  # the stream comes back even if capture fails
                with torch.cuda.graph(graph, pool=self._static_pool if SHARED_POOL else None):
                    out = self._static_step(module_id, entry.static)
        except Exception as err:
            raise RuntimeError(f"training.static_update: capturing the update as a CUDA graph failed "
                               f"({str(err).splitlines()[0]}); set training.static_update: false") from err
        finally:
            for group, (lr, capturable) in zip(optimizer.param_groups, saved):
                group["lr"], group["capturable"] = lr, capturable
        entry.graph, entry.out, entry.lrs = graph, out, lrs

    def _static_step(self, module_id, inputs: dict):
        """The static function: forward pass, loss, backward pass, clipping and the optimizer step
        on padded inputs. Returns (a vector of the loss, its metrics and the gradients' global
        norm and skip flag, their names)."""
        module = self.module[module_id]
        config = self.config.get_config_for_module(module_id)
        batch = {key: value for key, value in inputs.items() if key not in PASS_KEYS}
        batch[PASS_ROWS] = tuple(inputs[key] for key in PASS_KEYS)
        with static_pass():
            fwd_out = module.forward_train(batch)
            reduce = WeightedMean(inputs[STEP_WEIGHT], inputs[STEP_COUNT])
            total, metrics = self.loss_terms(module_id, config, batch, fwd_out, reduce, inputs[ENTROPY_COEFF])
            total.backward()
        name, optimizer = self.get_optimizers_for_module(module_id)[0]
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        global_norm, norms = clip_by_global_norm(grads, config.grad_clip)
        skipped = (~norms.isfinite().all()).float()
        optimizer.found_inf = skipped
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
        out = {"total_loss": total, **metrics, f"gradients_{name}_global_norm": global_norm,
               "static_update_skipped": skipped}
        clipping = update_clipping_of(optimizer)
        if clipping is not None and clipping.last_scale is not None:
            out["update_clip_scale"] = clipping.last_scale
        return torch.stack([v.detach().float().reshape(()) for v in out.values()]), list(out)

    def _unpack(self, module_id, values: torch.Tensor, names: list) -> tuple:
        """(the loss, the metrics to log) from the static function's output vector."""
        out = dict(zip(names, values.unbind()))
        total = out.pop("total_loss")
        if self.config.get_config_for_module(module_id).grad_clip is None:
            out = {k: v for k, v in out.items() if not k.endswith("_global_norm")}
        return total, out
