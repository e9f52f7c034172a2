"""Where a PPO iteration's time goes: per phase, on the host clock, with the device's work
included, and under torch.profiler (kernel launches, graph replays, device time).

    python benchmarks/ppo_profile.py [--device cuda] [--model gpt2-small-shaped] [--iters 6]
                                     [--trace trace.json] [--set key=value ...]
                                     [--restarts auto|static|eager] [--block-steps graph|each]
                                     [--emulate-capture]

Builds the PPO run of `peer_trl.py`'s project side (the quickstart task, 128 rows, 2,560-step
batches, one epoch, kl 0, lr 1e-4; `--device cuda` gives the learner the GPU and the rollouts
share it), runs two warm-up iterations, then three passes of --iters iterations each:

  host     phases timed by the host clock only: where the Python loop spends its time (a phase
           that queues device work and returns early looks cheap here);
  synced   the same with a device sync as each phase starts and ends: each phase holds its own
           device work (the difference to `host` is device time the host did not overlap);
  profile  torch.profiler over the same phases (on CUDA with kernel activity): per phase the
           torch ops run, the CUDA kernel launches, graph replays and host-device syncs, and
           the device time of its kernels; --trace writes the Chrome trace.

Phases nest (an iteration holds sampling, sampling holds the module's `act`); each row gives
the phase's time and its time outside the phases nested in it ("own"), per iteration and per
sampled token. On the CPU the device is the host: `synced` equals `host`, and the profile counts
torch ops only. `--restarts eager` keeps the prefills of restarting rows out of the captured step
(the path before `DecodeEngine.restart`), and `--block-steps each` a decode block's steps after
the first one call each (before `DecodeEngine.steps`), to measure them side by side. `--emulate-capture`
(CPU): the decode engine's graphs captured and replayed on the CPU (benchmarks/emulated_capture.py),
then a pass counting, per phase, the ops run outside them: each a kernel launch on a GPU.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import nullcontext

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from agents.config import algorithm_config, load  # noqa: E402

PEER_SETTINGS = ["env_runners.num_envs_per_env_runner=128", "training.train_batch_size=2560",
                 "training.minibatch_size=2560", "training.num_epochs=1", "reward.kl_coef=0", "training.lr=1e-4"]
RESTARTS = {"auto": None, "static": True, "eager": False}  # --restarts -> RingKVCache.static_restarts
# phase -> its parent (the tree the report is printed as)
TREE = {"iteration": None, "sample": "iteration", "act": "sample", "env": "sample", "episodes": "sample",
        "update": "iteration", "learner connector": "update", "training passes": "update",
        "weight sync": "iteration"}


class Phases:
    """Inclusive and own (outside nested phases) seconds per phase, from wrapped methods."""

    def __init__(self):
        self.total, self.own, self.calls = dict.fromkeys(TREE, 0.0), dict.fromkeys(TREE, 0.0), dict.fromkeys(TREE, 0)
        self.stack: list = []  # [phase, start, seconds in nested phases, ops at start, ops in nested phases]
        self.sync = lambda: None
        self.ops = lambda: 0  # ops counted so far (`--emulate-capture`)
        self.ops_total, self.ops_own = dict.fromkeys(TREE, 0), dict.fromkeys(TREE, 0)
        self.profiling = False

    def wrap(self, owner, name: str, phase: str) -> None:
        orig = getattr(owner, name)
        phases = self

        def timed(*args, **kwargs):
            if phases.stack and phases.stack[-1][0] == phase:  # a phase calling itself counts once
                return orig(*args, **kwargs)
            phases.sync()
            phases.stack.append([phase, time.perf_counter(), 0.0, phases.ops(), 0])
            label = torch.profiler.record_function(phase) if phases.profiling else nullcontext()
            try:
                with label:
                    return orig(*args, **kwargs)
            finally:
                phases.sync()
                _, t0, nested, ops0, nested_ops = phases.stack.pop()
                dt, ops = time.perf_counter() - t0, phases.ops() - ops0
                phases.total[phase] += dt
                phases.own[phase] += dt - nested
                phases.ops_total[phase] += ops
                phases.ops_own[phase] += ops - nested_ops
                phases.calls[phase] += 1
                if phases.stack:
                    phases.stack[-1][2] += dt
                    phases.stack[-1][4] += ops

        setattr(owner, name, timed)

    def reset(self) -> None:
        for d in (self.total, self.own):
            d.update(dict.fromkeys(d, 0.0))
        for d in (self.calls, self.ops_total, self.ops_own):
            d.update(dict.fromkeys(d, 0))


def instrument(algo, phases: Phases) -> None:
    from env.vector_env import TokenGenerationVectorEnv

    runner = algo.env_runner_group.local_env_runner
    learner = algo.learner_group._learner
    phases.wrap(algo, "training_step", "iteration")
    phases.wrap(runner, "sample", "sample")
    phases.wrap(type(runner.module), "act", "act")
    if hasattr(type(runner.module), "act_steps"):  # env_runners.decode_block > 1
        phases.wrap(type(runner.module), "act_steps", "act")
    phases.wrap(TokenGenerationVectorEnv, "step", "env")
    phases.wrap(TokenGenerationVectorEnv, "reset", "env")
    phases.wrap(type(runner), "_episode", "episodes")
    try:  # the call's episode metrics (before 1abc3bb they were logged inside _episode)
        from agents.runner_episodes import EpisodeMetrics

        phases.wrap(EpisodeMetrics, "flush", "episodes")
    except ImportError:
        pass
    phases.wrap(algo.learner_group, "update", "update")
    phases.wrap(learner, "_make_batch_if_necessary", "learner connector")
    for name in ("_update",):
        phases.wrap(learner, name, "training passes")
    phases.wrap(algo.env_runner_group, "sync_weights", "weight sync")


def report(title: str, phases: Phases, iters: int, tokens: int) -> None:
    print(f"== {title}: {iters} iterations, {tokens:,} sampled tokens")
    print(f"  {'phase':24s} {'ms/iter':>9s} {'own ms/iter':>12s} {'us/token':>9s} {'own us/token':>13s} {'calls/iter':>11s}")

    def rows(parent, depth):
        for phase, p in TREE.items():
            if p == parent:
                t, o = phases.total[phase], phases.own[phase]
                name = "  " * depth + phase
                print(f"  {name:24s} {1e3 * t / iters:9.2f} {1e3 * o / iters:12.2f} {1e6 * t / tokens:9.2f} "
                      f"{1e6 * o / tokens:13.2f} {phases.calls[phase] / iters:11.1f}")
                rows(phase, depth + 1)

    rows(None, 0)


def report_ops(phases: Phases, iters: int, replays: int) -> None:
    print(f"== ops outside the decode engine's graphs (captured on the CPU, emulated: each would be a kernel "
          f"launch on a GPU): {iters} iterations, {replays / iters:.1f} graph replays per iteration")
    print(f"  {'phase':24s} {'ops/iter':>9s} {'own ops/iter':>13s}")

    def rows(parent, depth):
        for phase, p in TREE.items():
            if p == parent:
                name = "  " * depth + phase
                print(f"  {name:24s} {phases.ops_total[phase] / iters:9.1f} {phases.ops_own[phase] / iters:13.1f}")
                rows(phase, depth + 1)

    rows(None, 0)


def run(algo, iters: int) -> int:
    """Runs `iters` iterations; the tokens they sampled."""
    before = algo.env_runner_group.local_env_runner.num_env_steps_sampled_lifetime
    for _ in range(iters):
        algo.train()
    return algo.env_runner_group.local_env_runner.num_env_steps_sampled_lifetime - before


def profile_table(prof, cuda: bool) -> None:
    """Per phase, outside the phases nested in it: top-level torch ops, kernel launches, graph
    replays, host-device syncs and copies, and the device time of its kernels (kernels replayed
    from a CUDA graph may not be attributed by the profiler)."""
    counters = {"torch ops": None, "launches": ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"),
                "graph replays": ("cudaGraphLaunch",),
                "syncs": ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"),
                "copies": ("cudaMemcpyAsync", "cudaMemcpy")}
    counts = {phase: dict.fromkeys(counters, 0) for phase in TREE}
    device_us = dict.fromkeys(TREE, 0.0)
    ranges = dict.fromkeys(TREE, 0)
    unattributed = dict.fromkeys(TREE, 0)
    for e in prof.events():
        if e.name in TREE:
            ranges[e.name] += 1
        phase, parent, top_op = None, e.cpu_parent, True
        while parent is not None:
            if parent.name in TREE:
                phase = parent.name
                break
            top_op = top_op and not parent.name.startswith("aten::")
            parent = parent.cpu_parent
        if phase is None or e.name in TREE:
            continue
        if e.name.startswith("aten::") and top_op:
            counts[phase]["torch ops"] += 1
        for key, names in counters.items():
            if names and e.name in names:
                counts[phase][key] += 1
        if e.name == "cudaGraphLaunch" and not getattr(e, "kernels", []):
            unattributed[phase] += 1  # a replay whose kernels the profiler did not link to its launch
        if cuda:
            device_us[phase] += sum(k.duration for k in getattr(e, "kernels", []))
    print(f"  {'phase':24s} {'ranges':>7s} " + " ".join(f"{k:>13s}" for k in counters) + f" {'device ms':>10s}")
    replayed = False
    for phase in TREE:
        if ranges[phase]:
            mark = "+" if unattributed[phase] else " "  # those replays' kernels are not in the figure
            replayed |= mark == "+"
            print(f"  {phase:24s} {ranges[phase]:7d} " + " ".join(f"{counts[phase][k]:13d}" for k in counters)
                  + f" {device_us[phase] / 1e3:9.2f}{mark}")
    if replayed:
        print("  +: plus the kernels of the phase's CUDA graph replays, which the profiler does not attribute "
              "to it (the synced host clock above bounds the phase's device time)")


def rollout_path(algo) -> str:
    """Which decode path the EnvRunner's module took: the cache's class, the engine (captured or
    eager, its graphs) and the cache's row counts (rows stepped, prefilled, prefills computed)."""
    from agents.env_runner import runner_decode_block

    runner = algo.env_runner_group.local_env_runner
    module = runner.module
    block = f"decode block {runner_decode_block(runner)}; "
    cache = getattr(module, "kv_cache", None)
    if cache is None:
        return block + "no KV cache (every step recomputes the window)"
    engine = getattr(cache, "engine", None)
    where = next(module.parameters())
    desc = block + f"{type(cache).__name__} on {where.device} ({where.dtype})"
    if engine is None:
        desc += ", no decode engine (the window cache's eager step)"
    else:
        desc += (f", decode engine {engine.rows} rows x {engine.length} columns, "
                 f"{'captured: ' + str(len(engine.graphs)) + ' graph(s)' if engine.capture else 'eager'}, "
                 f"restarts {'in the static step' if cache.restarts_in_step else 'eager'}, "
                 f"a block's later steps {'in one function' if cache.static_blocks else 'one call each'}")
    return desc + f"; rows so far: {cache.stats}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="tune_configs/quickstart.yaml")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--model", default="tiny-gpt2")
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--profile-iters", type=int, default=2)
    p.add_argument("--trace", default=None, help="write the profiled iterations' Chrome trace here")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--restarts", default="auto", choices=RESTARTS,
                   help="where rows that restart are prefilled: inside the captured step (static), in eager "
                        "passes shared by window (eager), or the engine's default (auto: static where it captures)")
    p.add_argument("--block-steps", default="graph", choices=("graph", "each"),
                   help="a decode block's steps after the first: one static function (graph) or one call each")
    p.add_argument("--emulate-capture", action="store_true",
                   help="CPU only: the decode engine's graphs captured and replayed on the CPU (emulated), then a "
                        "pass that counts the ops run outside them per phase (each a kernel launch on a GPU)")
    args = p.parse_args()
    import ray

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    if cuda and args.emulate_capture:
        p.error("--emulate-capture: CPU only (on a GPU the graphs are captured; the profile pass counts launches)")
    from benchmarks.emulated_capture import OpCounter, emulate_capture

    counter = OpCounter()
    emulation = emulate_capture(counter) if args.emulate_capture else nullcontext()
    overrides = PEER_SETTINGS + [f"model.name_or_path={args.model}"]
    overrides += ["learners.num_gpus_per_learner=1"] if cuda else []
    cfg = load(args.config, overrides + args.overrides)
    gpu = f" ({torch.cuda.get_device_name()})" if cuda else ""
    print(f"config={args.config} overrides={overrides + args.overrides} torch={torch.__version__} "
          f"device={args.device}{gpu}", flush=True)
    ray.init(num_cpus=2, num_gpus=1 if cuda else 0, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    try:
        emulation.__enter__()
        algo = algorithm_config(cfg).build_algo()
        cache = getattr(algo.env_runner_group.local_env_runner.module, "kv_cache", None)
        if hasattr(cache, "static_restarts"):
            cache.static_restarts, cache.static_blocks = RESTARTS[args.restarts], args.block_steps == "graph"
        torch.set_num_threads(args.threads)
        phases = Phases()
        instrument(algo, phases)
        run(algo, 2)  # warm-up: graphs captured, prefills stored
        phases.reset()
        t0 = time.perf_counter()
        tokens = run(algo, args.iters)
        wall = time.perf_counter() - t0
        report("host clock", phases, args.iters, tokens)
        print(f"  {tokens / wall:,.0f} sampled tokens/s including learning")
        print(f"  rollout path: {rollout_path(algo)}", flush=True)
        if args.emulate_capture:
            phases.reset()
            phases.ops = lambda: counter.n
            counter.replays = 0
            with counter:
                run(algo, args.iters)
            phases.ops = lambda: 0
            report_ops(phases, args.iters, counter.replays)
        if cuda:
            phases.reset()
            phases.sync = torch.cuda.synchronize
            tokens = run(algo, args.iters)
            report("device synced at each phase's start and end", phases, args.iters, tokens)
            phases.sync = lambda: None
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        phases.reset()
        phases.profiling = True
        with torch.profiler.profile(activities=activities) as prof:
            tokens = run(algo, args.profile_iters)
        phases.profiling = False
        print(f"== torch.profiler: {args.profile_iters} iterations, {tokens:,} sampled tokens (counts per run)")
        profile_table(prof, cuda)
        if args.trace:
            prof.export_chrome_trace(args.trace)
            print(f"trace: {args.trace}")
        algo.stop()
    finally:
        emulation.__exit__(None, None, None)
        ray.shutdown()


if __name__ == "__main__":
    main()
