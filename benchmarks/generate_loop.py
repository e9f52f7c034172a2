"""The decode loop of generation, evaluation and one-request-at-a-time serving
(`agents.generate.generate`): tokens/s by vocabulary size and batch.

    python benchmarks/generate_loop.py [--model tiny-gpt2] [--vocab 52 50257] [--batch 16 64] [--new 20]
                                       [--reps 3] [--device cpu|cuda] [--precision fp32|bf16] [--greedy]
                                       [--paths decoder stepwise] [--count-ops]

For each (vocabulary, batch) it builds the fast EnvRunner's module on --device (random weights,
the synthetic numbers task with --vocab - 2 number tokens, so the vocabulary is --vocab; no
download), makes one warm-up call, then --reps calls of `generate` on --batch drawn prompts
(seeds 1, 2, ...), and prints the median milliseconds per call, the tokens generated (EOS
included) and tokens/s. It also prints the milliseconds of building one `TokenGenerationEnv` of
that config (the loop builds one per prompt) after the first. `--paths`: `decoder` (the default
path: the decode engine in static blocks, `agents.modules.decoding.Decoder`) and/or `stepwise`
(`generate(..., decoder=False)`: one module call per token), each timed in turn in the same run,
with the ratio decoder / stepwise when both run. Measured figures only; it never passes or fails
on a wall time.
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

from benchmarks.rollout_throughput import make_env_runner, sync  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-gpt2")
    p.add_argument("--vocab", type=int, nargs="+", default=[52, 50257])
    p.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    p.add_argument("--new", type=int, default=20)
    p.add_argument("--prompt", type=int, default=5)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--greedy", action="store_true", help="argmax instead of sampling")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="the policy's weights")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--paths", nargs="+", default=["decoder"], choices=("decoder", "stepwise"))
    p.add_argument("--count-ops", action="store_true",
                   help="instead of timing: one call per path with the decode engine's graphs emulated on the CPU "
                        "(benchmarks/emulated_capture.py), and the ops it runs outside them per token generated "
                        "(each a kernel launch on a GPU) and its graph replays")
    args = p.parse_args(argv)
    if args.count_ops:
        return count_ops(args)
    torch.set_num_threads(args.threads)
    from agents.generate import generate
    from env.text_env import TokenGenerationEnv

    print(f"model={args.model} new={args.new} device={args.device} greedy={args.greedy} torch={torch.__version__}",
          flush=True)
    for vocab in args.vocab:
        for batch in args.batch:
            ns = argparse.Namespace(model=args.model, vocab=vocab, batch=batch, prompt=args.prompt, new=args.new,
                                    device=args.device, precision=args.precision)
            runner = make_env_runner(ns, True, "fast")
            module, env_config = runner.module, runner.config.env_config
            device = torch.device(args.device)
            TokenGenerationEnv(env_config)
            start = time.perf_counter()
            for _ in range(5):
                TokenGenerationEnv(env_config)
            env_ms = (time.perf_counter() - start) / 5 * 1e3
            prompts = [None] * batch
            speeds = {}
            for path in args.paths:
                decoder = path == "decoder"
                generate(module, env_config, prompts, seed=0, batch_size=batch, greedy=args.greedy, decoder=decoder)
                times, tokens = [], []
                for rep in range(args.reps):
                    sync(device)
                    start = time.perf_counter()
                    out = generate(module, env_config, prompts, seed=rep + 1, batch_size=batch, greedy=args.greedy,
                                   decoder=decoder)
                    sync(device)
                    times.append(time.perf_counter() - start)
                    tokens.append(sum(r["num_generated"] for r in out))
                ms = 1e3 * float(np.median(times))
                speeds[path] = sum(tokens) / sum(times)
                print(f"vocab {vocab:6d}  batch {batch:4d}  {path:8s}: {ms:9.1f} ms per call, "
                      f"{int(np.median(tokens)):5d} tokens, {speeds[path]:9,.0f} tok/s;  one more env of this "
                      f"config {env_ms:7.2f} ms", flush=True)
            if len(speeds) == 2:
                print(f"vocab {vocab:6d}  batch {batch:4d}: decoder / stepwise {speeds['decoder'] / speeds['stepwise']:.2f}",
                      flush=True)
            runner.stop()
    return 0


def count_ops(args) -> int:
    """`--count-ops`: per path, one warm-up call (the graphs captured), then one counted call."""
    from agents.generate import generate
    from benchmarks.emulated_capture import OpCounter, emulate_capture

    print(f"model={args.model} new={args.new} greedy={args.greedy}: ops outside the engine's graphs per token "
          f"(graphs emulated on the CPU)", flush=True)
    for vocab in args.vocab:
        for batch in args.batch:
            ns = argparse.Namespace(model=args.model, vocab=vocab, batch=batch, prompt=args.prompt, new=args.new,
                                    device="cpu", precision="fp32")
            counter = OpCounter()
            with emulate_capture(counter):
                runner = make_env_runner(ns, True, "fast")
                module, env_config = runner.module, runner.config.env_config
                for path in args.paths:
                    kwargs = dict(batch_size=batch, greedy=args.greedy, decoder=path == "decoder")
                    for seed in (0, 1):  # the second call starts with every graph captured
                        generate(module, env_config, [None] * batch, seed=seed, **kwargs)
                    counter.n = counter.replays = 0
                    with counter:
                        out = generate(module, env_config, [None] * batch, seed=2, **kwargs)
                    tokens = sum(r["num_generated"] for r in out)
                    print(f"vocab {vocab:6d}  batch {batch:4d}  {path:8s}: {counter.n / tokens * batch:7.1f} ops and "
                          f"{counter.replays / tokens * batch:5.2f} replays per step of {batch} rows "
                          f"({tokens} tokens)", flush=True)
                runner.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
