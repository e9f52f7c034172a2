"""Colocated weight syncs: the learner's weights to the local EnvRunner's module, device to device.

RLlib's sync (`EnvRunnerGroup.sync_weights`) turns the learner's whole inference state into
numpy arrays on the host, puts them into the object store (even with no remote EnvRunner), and
loads them into the local EnvRunner's module. Where one local learner (`learners.num_learners:
0`) and no remote EnvRunner (`env_runners.num_env_runners: 0`) train together, which is the
default on one GPU and on a CPU, the local EnvRunner samples on the learner's device and each
sync is one fused in-place copy (`torch._foreach_copy_`) of the learner module's tensors into
the EnvRunner module's own (cast to the rollout precision where that differs; tied weights once;
with LoRA, the adapters only: the frozen base is the same on both sides). No numpy, no object
store, no host copy; tensors are never shared (the learner trains, the EnvRunner's module stays
in eval mode and may hold another precision), and a captured decode step stays valid since its
weights are written in place. Evaluation (`evaluation.interval`) samples in the learner's process
too (RLlib's local evaluation EnvRunner), so with a local learner and the fast EnvRunner its syncs
are colocated the same way, remote training EnvRunners or not: on one GPU it evaluates on that
GPU. `env_runners.colocated`: unset for this wherever it applies, true to require it (refused
where it cannot apply), false for RLlib's sync (evaluation's included).
"""
from __future__ import annotations

import torch
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.rl_module.multi_rl_module import MultiRLModule
from ray.rllib.utils.metrics import WEIGHTS_SEQ_NO

from agents.modules.sync_state import synced_tensors

COLOCATED = "colocated"  # env_config key: env_runners.colocated (None: wherever it applies)


def colocation_refusal(num_env_runners: int, num_learners: int) -> str | None:
    """Why rollouts cannot share the learner's process and device with these settings, or None."""
    if num_env_runners:
        return f"env_runners.num_env_runners is {num_env_runners} (remote EnvRunners sample in their own processes)"
    if num_learners:
        return f"learners.num_learners is {num_learners} (the learners run in their own processes)"
    return None


@torch.no_grad()
def copy_module_weights(dst: torch.nn.Module, src: torch.nn.Module) -> int:
    """Copies `src`'s tensors into `dst`'s in place, one fused copy, for every state key `dst`
    has (each tensor once: tied weights share one), and returns the bytes written. `dst` is moved
    to `src`'s device first where they differ (the first colocated sync of a GPU learner).
    What is copied is `synced_tensors(dst)`: what any weight sync carries."""
    device = next(src.parameters()).device
    if next(dst.parameters()).device != device:
        dst.to(device)
        if hasattr(dst, "settle_rollout_precision"):  # env_runners.precision auto: by its new device
            dst.settle_rollout_precision()
    own, theirs = synced_tensors(dst), src.state_dict(keep_vars=True)
    missing = [k for k in own if k not in theirs]
    if missing:
        raise ValueError(f"colocated weight sync: the learner's module lacks {missing[:5]}")
    targets, sources = list(own.values()), [theirs[k].detach() for k in own]
    torch._foreach_copy_(targets, sources)
    if hasattr(dst, "weights_changed"):
        dst.weights_changed()
    return sum(t.nbytes for t in targets)


def modules_by_id(module) -> dict:
    """{module id: module} of a MultiRLModule, {DEFAULT_MODULE_ID: module} of a single one."""
    return dict(module.items()) if isinstance(module, MultiRLModule) else {DEFAULT_MODULE_ID: module}


def sync_colocated(learner_group, env_runner) -> int:
    """The learner's modules into `env_runner`'s (same process); returns the bytes copied."""
    def copy(learner):
        learned = modules_by_id(learner.module)
        total = sum(copy_module_weights(m.unwrapped(), learned[mid].unwrapped())
                    for mid, m in modules_by_id(env_runner.module).items())
        if hasattr(env_runner, "weights_changed"):
            env_runner.weights_changed()
        # The weights' version, as RLlib's sync sets it (its `weights_seq_no` metric, checkpoints)
        env_runner._weights_seq_no = learner.get_state(components=[])[WEIGHTS_SEQ_NO]
        return total

    results = learner_group.foreach_learner(copy)
    return sum(r.get() for r in results)


def install_colocated_sync(algo) -> bool:
    """Makes `algo`'s weight syncs to its local EnvRunner colocated where that applies (see the
    module's docstring) and says whether it did. Syncs from anything else, to remote EnvRunners
    or with global vars keep RLlib's path. The EnvRunner gets the learner's weights (and device)
    at once. Evaluation that samples in the learner's process (`evaluation.interval` set: RLlib's
    local evaluation EnvRunner) is colocated too, whatever the training EnvRunners are
    (`colocate_evaluation`)."""
    setting = algo.config.env_config.get(COLOCATED)
    group, learners = algo.env_runner_group, algo.learner_group
    if setting is False or learners is None or not learners.is_local:
        return False
    colocate_evaluation(algo)
    if group is None or group.local_env_runner is None or group.num_remote_workers() > 0:
        return False
    algo.colocated_sync_bytes = 0  # bytes copied by the last colocated sync
    _colocate(group, learners, lambda copied: setattr(algo, "colocated_sync_bytes", copied))
    return True


def colocate_evaluation(algo) -> bool:
    """Evaluation's weight syncs from the learners (RLlib makes one before each evaluation) as
    colocated copies, where RLlib's local evaluation EnvRunner samples (no remote evaluation
    EnvRunner) and it is the project's fast runner, which samples on its module's device: on one
    GPU the evaluation then runs on the learner's GPU (in the rollout precision), not on the CPU
    with the weights through the host. That module is a second copy of the rollout weights on the
    GPU, with its own KV ring and graphs (`env_runners.colocated: false` keeps evaluation on the
    CPU, by RLlib's sync). Says whether it did; `algo.colocated_eval_sync_bytes` holds the bytes
    of the last such sync."""
    group = getattr(algo, "eval_env_runner_group", None)
    runner = None if group is None else group.local_env_runner
    if runner is None or group.num_remote_workers() > 0 or not getattr(runner, "samples_on_module_device", False):
        return False
    algo.colocated_eval_sync_bytes = 0
    _colocate(group, algo.learner_group, lambda copied: setattr(algo, "colocated_eval_sync_bytes", copied))
    return True


def _colocate(group, learners, record) -> None:
    """Wraps `group.sync_weights`: a sync from `learners` to its local EnvRunner alone becomes
    `sync_colocated` (the bytes copied go to `record`); one sync at once."""
    original = group.sync_weights

    def sync_weights(policies=None, from_worker_or_learner_group=None, to_worker_indices=None, global_vars=None,
                     timeout_seconds=0.0, inference_only=False):
        if from_worker_or_learner_group is learners and global_vars is None and group.num_remote_workers() == 0:
            record(sync_colocated(learners, group.local_env_runner))
            return None
        return original(policies=policies, from_worker_or_learner_group=from_worker_or_learner_group,
                        to_worker_indices=to_worker_indices, global_vars=global_vars,
                        timeout_seconds=timeout_seconds, inference_only=inference_only)

    group.sync_weights = sync_weights
    record(sync_colocated(learners, group.local_env_runner))


def settled_rollout_dtypes(env_runner) -> set:
    """The dtypes the LMs of `env_runner`'s modules hold under `env_runners.precision: auto`
    (settled on the runner's device; runs on the EnvRunner); empty where no module is under auto."""
    return {str(next(m.unwrapped().lm.parameters()).dtype) for m in modules_by_id(env_runner.module).values()
            if getattr(m.unwrapped(), "model_config", {}).get("rollout_precision") == "auto"}


def settle_sync_dtype(algo) -> str | None:
    """Under `env_runners.precision: auto` remote EnvRunners settle their rollout dtype on their own
    device (bf16 on a GPU with bf16 in hardware), which the learners do not know: they send float32.
    Where every remote EnvRunner (evaluation ones included) settled bf16, the learners' syncs send
    bf16 from now on: half the bytes, the weights the runners would cast to anyway. Returns the
    dtype the syncs send ("torch.bfloat16"), or None where they stay as they were: also where
    evaluation samples in the driver's process by RLlib's sync (its EnvRunner stays fp32 on the CPU
    and would get bf16-rounded weights; a colocated one copies the learner's). The driver's own
    copy of the module (`Algorithm.get_module`) then holds bf16-rounded weights, as with
    `precision: bf16` named; checkpoints hold the learners' weights."""
    evaluation = getattr(algo, "eval_env_runner_group", None)
    if (evaluation is not None and not evaluation.num_remote_workers()
            and getattr(algo, "colocated_eval_sync_bytes", None) is None):
        return None
    groups = [g for g in (algo.env_runner_group, evaluation) if g is not None and g.num_remote_workers()]
    if not groups or algo.learner_group is None:
        return None
    settled = set()
    for group in groups:
        for dtypes in group.foreach_env_runner(settled_rollout_dtypes, local_env_runner=False):
            settled |= dtypes or {"none"}
    if settled != {str(torch.bfloat16)}:
        return None
    algo.learner_group.foreach_learner(_send_bf16)
    return str(torch.bfloat16)


def _send_bf16(learner) -> None:
    for module in modules_by_id(learner.module).values():
        module.unwrapped().__dict__["sync_dtype"] = torch.bfloat16
