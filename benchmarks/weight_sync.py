"""Weight sync: RLlib's path against the colocated copy and the lean sync, same run, same algorithm.

    python benchmarks/weight_sync.py [--model gpt2-small-shaped] [--vocab 50257] [--reps 5] [--device cuda]
                                     [--remote]

Builds PPO with one local learner and no remote EnvRunner (`num_env_runners: 0`, where
`agents/weight_sync.py` makes every sync a colocated in-place copy), then times, alternately:
  (r0) RLlib's `EnvRunnerGroup.sync_weights` from the learner group: the learner's inference state
      as numpy arrays on the host (RLlib's: every tensor in float32, tied weights twice), `ray.put`
      into the object store, loaded into the local EnvRunner's module;
  (r) the same with the lean state (`CausalLMActorCritic.sync_state`, see --remote);
  (c) the colocated sync: one fused in-place copy of the learner module's tensors into the
      EnvRunner module's own.
and prints, for each, the seconds per sync (median), the bytes put into the object store and
the bytes copied. With --device cuda the learner is on the GPU (the colocated EnvRunner moves
there at its first sync; RLlib's path then goes through the host).

With --remote, one remote EnvRunner samples (`num_env_runners: 1`) and the rows are RLlib's sync
to it, waiting until the EnvRunner has loaded the weights:
  (b) before: RLlib's inference state (every tensor as float32 numpy, tied weights twice) and a
      copy into the driver's EnvRunner too;
  (l) the lean sync (`CausalLMActorCritic.sync_state`): inference weights once each, in the
      rollout precision (--precision), from a GPU through pinned buffers, and no copy into the
      driver's EnvRunner, which does not sample.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import ray
import torch
import tree

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from agents.config import algorithm_config, validate  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-small-shaped")
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--remote", action="store_true", help="one remote EnvRunner: before / after the lean sync")
    p.add_argument("--precision", default="fp32", help="env_runners.precision (the rollout copy's)")
    args = p.parse_args()
    cfg = validate({
        "task": {"name": "increasing_numbers", "num_numbers": args.vocab - 2},
        "model": {"name_or_path": args.model},
        "env": {"max_prompt_len": 5, "max_new_tokens": 20},
        "env_runners": {"num_env_runners": 1 if args.remote else 0, "num_envs_per_env_runner": 8,
                        "num_cpus_per_env_runner": 0.5, "precision": args.precision,
                        "num_gpus_per_env_runner": 0.5 if args.remote and args.device == "cuda" else 0},
        "learners": {"num_gpus_per_learner": (0.5 if args.remote else 1) if args.device == "cuda" else 0},
        "training": {"train_batch_size": 160, "minibatch_size": 160},
        "seed": 0,
    })
    ray.init(num_cpus=2, num_gpus=1 if args.device == "cuda" else 0, include_dashboard=False,
             logging_level="ERROR")
    put_bytes = []
    original_put = ray.put

    def counting_put(value, *a, **kw):
        put_bytes.append(sum(getattr(x, "nbytes", 0) for x in tree.flatten(value)))
        return original_put(value, *a, **kw)

    ray.put = counting_put
    algo = algorithm_config(cfg).build_algo()
    group, learners = algo.env_runner_group, algo.learner_group
    device = torch.device(args.device)
    if args.remote:
        from agents.modules import CausalLMActorCritic

        local = group.local_env_runner

        def mode(lean: bool):
            def sync():
                CausalLMActorCritic.lean_sync = local.hold_back_syncs = lean
                group.sync_weights(from_worker_or_learner_group=learners, inference_only=True, timeout_seconds=600)
            return sync

        rows = (("b", "(b) before: RLlib's state, driver copy too", mode(False)),
                ("l", "(l) lean sync, no driver copy", mode(True)))
    else:
        from agents.modules import CausalLMActorCritic

        assert getattr(algo, "colocated_sync_bytes", 0) > 0, "the colocated sync is not installed"

        def rllib(lean: bool):
            def sync():
                CausalLMActorCritic.lean_sync = lean
                type(group).sync_weights(group, from_worker_or_learner_group=learners, inference_only=True)
            return sync

        rows = (("r0", "(r0) RLlib's sync of RLlib's state", rllib(False)),
                ("r", "(r) RLlib's sync of the lean state", rllib(True)),
                ("c", "(c) colocated in-place copy",
                 lambda: group.sync_weights(from_worker_or_learner_group=learners, inference_only=True)))
    seconds = {k: [] for k, _, _ in rows}
    stored = {k: [] for k, _, _ in rows}
    for _ in range(args.reps + 1):  # the first round warms up
        for k, _, sync in rows:
            put_bytes.clear()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            sync()
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds[k].append(time.perf_counter() - start)
            stored[k].append(sum(put_bytes))
    ray.put = original_put
    module = group.local_env_runner.module
    weights = sum({t.data_ptr(): t.nbytes for t in module.state_dict().values()}.values())
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"model={args.model} vocab={args.vocab} device={args.device} ({gpu}) threads={torch.get_num_threads()} "
          f"rollout precision={args.precision} remote EnvRunners={int(args.remote)}")
    print(f"EnvRunner module: {weights / 1e6:,.1f} MB of distinct tensors")
    for k, label, _ in rows:
        s = float(np.median(seconds[k][1:]))
        copied = f"   copied {algo.colocated_sync_bytes / 1e6:,.1f} MB" if k == "c" else ""
        print(f"{label:42s} {1e3 * s:9.2f} ms per sync   object store {np.mean(stored[k][1:]) / 1e6:8.1f} MB{copied}")
    a, b = rows[0][0], rows[-1][0]
    print(f"{a} / {b} = {np.median(seconds[a][1:]) / np.median(seconds[b][1:]):.1f}x per sync")
    algo.stop()
    ray.shutdown()


if __name__ == "__main__":
    main()
