"""Where a decode engine step's time goes on a GPU: the step's milliseconds by rollout precision and
TF32, the trunk alone against the whole step (trunk + logits + draw), captured against eager, the
kernels of one captured step (torch.profiler, top by device time), and the eager ops (each a kernel
launch on a GPU) a rollout step runs when no row restarts and when 16 of them restart on a stored
prefill, as the fast EnvRunner calls it (`--restart-ops-only`: just those, on any device).
`--greedy`: self-critical's greedy baseline (`Decoder`), as the learner calls it once per
iteration: milliseconds, ops outside the engine's graphs, replays and graphs captured per call
(`--emulate-capture`: the graphs captured on the CPU, so its ops are those a GPU would launch).

    python benchmarks/decode_step_profile.py [--model gpt2-small-shaped] [--vocab 50257] [--batch 128] [--device cuda]
    python benchmarks/decode_step_profile.py --compile   # the step as it is, then through torch.compile
    python benchmarks/decode_step_profile.py --greedy [--emulate-capture] --device cpu --model tiny-gpt2 --vocab 52

Prints measured figures only. The step is the one `rollout_throughput.py` (e) times.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from contextlib import nullcontext  # noqa: E402

from benchmarks.emulated_capture import OpCounter, count_ops, emulate_capture  # noqa: E402
from benchmarks.rollout_throughput import engine_module, sync  # noqa: E402


def build(args, precision: str, capture: bool, compile_step: bool = False):
    from ray.rllib.core.columns import Columns

    args.precision = precision
    module, device, obs, key = engine_module(args)
    cache, trunk = module.kv_cache, module.lm.base_model
    with torch.no_grad():
        uniform = torch.rand(args.batch, 1, dtype=torch.float64, device=device)
        out = cache.hidden_at_last_token(trunk, obs, None, tail=module._sample, tail_inputs=(uniform,), key=key)
    engine = cache.engine
    engine.capture, engine.compile_step = capture, compile_step
    token = out[Columns.ACTIONS].clone()

    def whole():
        return engine.step(token, module._sample, (uniform,), key)

    def trunk_only():
        return engine.step(token)

    return whole, trunk_only, device


def time_ms(fn, device, n: int = 40) -> float:
    with torch.no_grad():
        for _ in range(3):
            fn()
        times = []
        for _ in range(5):
            sync(device)
            start = time.perf_counter()
            for _ in range(n):
                fn()
            sync(device)
            times.append((time.perf_counter() - start) / n)
    return 1e3 * float(np.median(times))


def restart_ops(args) -> None:
    """Eager ops and milliseconds of the EnvRunner module's rollout step (`hidden_at_last_token`
    with the draw) when every row continues and when 1 in 8 rows restarts on the prompt: prefilled
    eagerly (shared by window: one prompt, one pass) or inside the step (`DecodeEngine.restart`,
    captured on CUDA; eager on the CPU, where its ops count as eager too)."""
    args.precision = "fp32"
    module, device, obs, key = engine_module(args)
    cache, trunk = module.kv_cache, module.lm.base_model
    uniform = torch.rand(args.batch, 1, dtype=torch.float64, device=device)
    restart = np.ones(args.batch, bool)
    restart[::8] = False
    n = (~restart).sum()
    calls = {"every row continues": (np.ones(args.batch, bool), None),
             f"{n} rows restart, eager prefills": (restart, False),
             f"{n} rows restart in the step": (restart, True)}
    with torch.no_grad():
        cache.hidden_at_last_token(trunk, obs, None, tail=module._sample, tail_inputs=(uniform,), key=key)
        for label, (cont, static) in calls.items():
            cache.static_restarts = static
            call = lambda: cache.hidden_at_last_token(trunk, obs, cont, tail=module._sample,  # noqa: E731
                                                      tail_inputs=(uniform,), key=key)
            call()
            print(f"rollout step, {label:34s}: {count_ops(call):4d} eager ops, {time_ms(call, device, n=10):8.3f} ms",
                  flush=True)


def greedy_calls(args, calls: int = 6) -> None:
    """Self-critical's greedy baseline (`Decoder`) over `calls` calls as the learner makes
    them, the weights changed in place between calls (an optimizer's step): --batch prompts,
    --new tokens each (no EOS, so every call decodes them all). Per call: milliseconds, the ops
    run outside the engine's graphs (each a kernel launch on a GPU), graph replays, graphs captured."""
    from agents.modules.decoding import Decoder

    args.precision = "fp32"  # the learner's weights
    counter = OpCounter()
    with emulate_capture(counter) if args.emulate_capture else nullcontext():
        module, device, obs, _ = engine_module(args)
        decoder = Decoder()
        weight = module.lm.base_model.h[0].mlp.c_fc.weight
        for call in range(calls):
            graphs = len(decoder.cache.engine.graphs) if decoder.cache.engine is not None else 0
            counter.n, replays = 0, counter.replays
            sync(device)
            start = time.perf_counter()
            with counter:
                decoder(module, obs["input_ids"], obs["attention_mask"], args.new, -1)
            sync(device)
            ms = 1e3 * (time.perf_counter() - start)
            engine = decoder.cache.engine
            print(f"greedy call {call}: {ms:8.2f} ms  {counter.n:5d} ops outside graphs  "
                  f"{counter.replays - replays:3d} replays  {len(engine.graphs) - graphs} graphs captured  "
                  f"(engine {engine.rows} rows, {'captured' if engine.capture else 'eager'})", flush=True)
            with torch.no_grad():
                weight.mul_(1.0001)


def compile_rows(args) -> None:
    """The whole step as the engine runs it (captured on CUDA, in bf16 there) against the same step
    through torch.compile (`DecodeEngine.compile_step`, inductor) and then captured: milliseconds
    per step and the seconds of the first step (the compile and the capture)."""
    cuda = args.device == "cuda"
    precision = "bf16" if cuda else "fp32"
    for compile_step in (False, True):
        torch._dynamo.reset()
        whole, _, device = build(args, precision, cuda, compile_step)
        start = time.perf_counter()
        with torch.no_grad():
            whole()
        sync(device)
        first = time.perf_counter() - start
        print(f"{precision} {'captured' if cuda else 'eager'} {'compiled' if compile_step else 'as is   '}: whole step "
              f"{time_ms(whole, device):7.3f} ms   first step (compile and capture) {first:6.1f} s", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-small-shaped")
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--device", default="cuda")
    p.add_argument("--restart-ops-only", action="store_true", help="only the eager ops of a rollout step")
    p.add_argument("--compile", action="store_true",
                   help="only the whole step as it is, then through torch.compile (bf16 and captured on CUDA)")
    p.add_argument("--greedy", action="store_true", help="only self-critical's greedy decodes, per call")
    p.add_argument("--emulate-capture", action="store_true",
                   help="with --greedy on the CPU: the engine's graphs captured and replayed on the CPU")
    args = p.parse_args()
    if args.greedy:
        return greedy_calls(args)
    if args.compile:
        name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        print(f"model={args.model} vocab={args.vocab} batch={args.batch} window={args.prompt + args.new} device={name}")
        return compile_rows(args)
    if args.restart_ops_only:
        return restart_ops(args)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"model={args.model} vocab={args.vocab} batch={args.batch} window={args.prompt + args.new} device={name}")
    cuda = args.device == "cuda"
    for precision, tf32, capture in (("fp32", False, cuda), ("fp32", False, False), ("fp32", True, cuda),
                                     ("bf16", False, cuda))[:None if cuda else 1]:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        if True:
            whole, trunk_only, device = build(args, precision, capture)
            w, t = time_ms(whole, device), time_ms(trunk_only, device)
            print(f"{precision} tf32={'on ' if tf32 else 'off'} {'captured' if capture else 'eager   '}: "
                  f"whole step {w:7.3f} ms   trunk alone {t:7.3f} ms   logits + draw {w - t:7.3f} ms", flush=True)
    if args.device == "cuda":
        from torch.profiler import ProfilerActivity, profile

        for precision in ("fp32",):
            torch.backends.cuda.matmul.allow_tf32 = precision == "fp32"
            whole, _, device = build(args, precision, True)
            with torch.no_grad():
                for _ in range(3):
                    whole()
                sync(device)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        whole()
                    sync(device)
            print(f"\nkernels of 10 captured steps, {precision}{' tf32' if precision == 'fp32' else ''}:")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    restart_ops(args)


if __name__ == "__main__":
    main()
