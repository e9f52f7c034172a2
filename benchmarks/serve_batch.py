"""A serving replica's continuous batching (`agents.serve.batching.Batcher`) driven in-process, no
HTTP: completions/s and tokens/s with blocks on the decode engine against one call per token.

    python benchmarks/serve_batch.py [--model tiny-gpt2] [--vocab 52 50257] [--rows 16] [--completions 160]
                                     [--new 20] [--block 8] [--mix default|settings] [--reps 3]
                                     [--device cpu|cuda] [--precision fp32|bf16] [--paths blocks stepwise]
                                     [--count-ops] [--one-by-one]

For each vocabulary it builds the fast EnvRunner's module on --device (random weights, the
synthetic numbers task with --vocab - 2 number tokens; no download), then per path runs one
warm-up round and --reps timed rounds: --completions completions of up to --new tokens submitted
at once (`--one-by-one`: each once the one before it finished, as a lone client sends them), one
job each, to a Batcher of --rows rows, and prints the median completions/s and
generated tokens/s. `--mix default`: every completion sampled at temperature 1; `settings`: a mix
of greedy rows, temperatures, top_p and every stateless requested sampler. `--paths`: `blocks`
(the default path: blocks of --block steps on the decode engine, `decoding.rows_block`) and/or
`stepwise` (one module call per token, the path a mirostat request takes), with the ratio when
both run. `--count-ops`: instead of timing, the ops each path runs outside the engine's graphs
per step of the rows, graphs emulated on the CPU (each op a kernel launch on a GPU), and the graphs
the engine captured (as many as a GPU would; a key dropped and seen again is captured again). Measured
figures only; it never passes or fails on a wall time.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.rollout_throughput import make_env_runner, sync  # noqa: E402

PROMPTS = ["3 7 12", "1 2", "40 41 42 43", "5", "9 8 7 6 5"]


def completions(n: int, new: int, mix: str, seed: int) -> list:
    from agents.serve.batching import Completion

    settings = [dict()]
    if mix == "settings":
        settings = [dict(), dict(greedy=True), dict(temperature=0.7, top_p=0.9), dict(temperature=1.5),
                    dict(sampler=(("name", "top_k"), ("k", 5))), dict(sampler=(("name", "top_p"), ("p", 0.8))),
                    dict(sampler=(("name", "typical"), ("p", 0.6))), dict(sampler=(("name", "epsilon"), ("epsilon", 3e-3))),
                    dict(sampler=(("name", "eta"), ("eta", 3e-3)))]
    return [Completion(PROMPTS[i % len(PROMPTS)], seed + i, new, **settings[i % len(settings)]) for i in range(n)]


def run_round(batcher, items, one_by_one: bool = False) -> int:
    from agents.serve.batching import Job

    if one_by_one:  # a lone client: each completion submitted once the one before it finished
        return sum(batcher.submit(Job([c])).wait(timeout=600)[0]["num_generated"] for c in items)
    jobs = [batcher.submit(Job([c])) for c in items]
    return sum(j.wait(timeout=600)[0]["num_generated"] for j in jobs)


def drive(batcher, items) -> int:
    """`run_round` with the batch stepped in this thread (an op counter counts this thread's ops)."""
    from agents.serve.batching import Job

    batcher._thread = True  # submit starts no thread: this loop is the batch's
    jobs = [batcher.submit(Job([c])) for c in items]
    while not all(all(r is not None for r in j.results) for j in jobs):
        batcher._start(batcher._admit())
        batcher.step()
    return sum(j.results[0]["num_generated"] for j in jobs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-gpt2")
    p.add_argument("--vocab", type=int, nargs="+", default=[52, 50257])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--completions", type=int, default=160)
    p.add_argument("--new", type=int, default=20)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--mix", default="default", choices=("default", "settings"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="the policy's weights")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--one-by-one", action="store_true",
                   help="submit each completion once the one before it finished (a lone client), not all at once")
    p.add_argument("--paths", nargs="+", default=["blocks", "stepwise"], choices=("blocks", "stepwise"))
    p.add_argument("--count-ops", action="store_true",
                   help="instead of timing: one round per path with the decode engine's graphs emulated on the "
                        "CPU (benchmarks/emulated_capture.py), and the ops it runs outside them per step")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import agents.serve.batching as batching
    from benchmarks.emulated_capture import OpCounter, emulate_capture

    blocks_apply = batching.blocks_apply
    device = "cpu" if args.count_ops else args.device
    what = "ops outside the engine's graphs (emulated on the CPU)" if args.count_ops else "timed"
    print(f"model={args.model} rows={args.rows} completions={args.completions} new={args.new} block={args.block} "
          f"mix={args.mix} one_by_one={args.one_by_one} device={device} precision={args.precision} "
          f"torch={torch.__version__}: {what}", flush=True)
    for vocab in args.vocab:
        ns = argparse.Namespace(model=args.model, vocab=vocab, batch=args.rows, prompt=5, new=args.new,
                                device=device, precision="fp32" if args.count_ops else args.precision)
        counter = OpCounter() if args.count_ops else None
        with emulate_capture(counter) if args.count_ops else nullcontext():
            runner = make_env_runner(ns, True, "fast")
            module, env_config = runner.module, runner.config.env_config
            speeds = {}
            for path in args.paths:
                # each path a fresh engine in the module's cache (its graphs its own)
                module.kv_cache.engine = None
                batching.blocks_apply = blocks_apply if path == "blocks" else (lambda module, slots: False)
                batcher = batching.Batcher(module, env_config, rows=args.rows, max_queue=args.completions,
                                           block=args.block)
                try:
                    if args.count_ops:
                        drive(batcher, completions(args.completions, args.new, args.mix, 0))  # warm-up: captures
                        warm = batcher.load()["graphs_captured"]
                        counter.n = counter.replays = 0
                        steps = batcher.stats["steps"]
                        with counter:
                            tokens = drive(batcher, completions(args.completions, args.new, args.mix, 1))
                        steps = batcher.stats["steps"] - steps
                        load = batcher.load()
                        print(f"vocab {vocab:6d}  {path:8s}: {counter.n / steps:7.1f} ops and "
                              f"{counter.replays / steps:5.2f} replays per step of {args.rows} rows "
                              f"({steps} steps, {tokens} tokens); graphs captured {load['graphs_captured']} "
                              f"({load['graphs_captured'] - warm} in this round)", flush=True)
                        continue
                    run_round(batcher, completions(args.completions, args.new, args.mix, 0))  # warm-up
                    warm = batcher.load()["graphs_captured"]
                    times, tokens = [], []
                    for rep in range(args.reps):
                        sync(torch.device(device))
                        start = time.perf_counter()
                        tokens.append(run_round(batcher, completions(args.completions, args.new, args.mix, rep + 1),
                                                args.one_by_one))
                        sync(torch.device(device))
                        times.append(time.perf_counter() - start)
                finally:
                    if batcher._thread is not True:
                        batcher.close()
                    batching.blocks_apply = blocks_apply
                speeds[path] = sum(tokens) / sum(times)
                print(f"vocab {vocab:6d}  {path:8s}: {args.completions / float(np.median(times)):8.1f} completions/s, "
                      f"{speeds[path]:9,.0f} tokens/s ({int(np.median(tokens))} tokens a round, "
                      f"{1e3 * float(np.median(times)):.0f} ms; graphs captured in the timed rounds: "
                      f"{batcher.load()['graphs_captured'] - warm})", flush=True)
            if len(speeds) == 2:
                print(f"vocab {vocab:6d}: blocks / stepwise {speeds['blocks'] / speeds['stepwise']:.2f}", flush=True)
            runner.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
