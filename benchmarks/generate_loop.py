"""The decode loop of generation, evaluation and one-request-at-a-time serving
(`agents.generate.generate`): tokens/s by vocabulary size and batch.

    python benchmarks/generate_loop.py [--model tiny-gpt2] [--vocab 52 50257] [--batch 16 64] [--new 20]
                                       [--reps 3] [--device cpu|cuda] [--greedy]

For each (vocabulary, batch) it builds the fast EnvRunner's module on --device (random weights,
the synthetic numbers task with --vocab - 2 number tokens, so the vocabulary is --vocab; no
download), makes one warm-up call, then --reps calls of `generate` on --batch drawn prompts
(seeds 1, 2, ...), and prints the median milliseconds per call, the tokens generated (EOS
included) and tokens/s. It also prints the milliseconds of building one `TokenGenerationEnv` of
that config (the loop builds one per prompt) after the first. Measured figures only; it never
passes or fails on a wall time.
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
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from agents.generate import generate
    from env.text_env import TokenGenerationEnv

    print(f"model={args.model} new={args.new} device={args.device} greedy={args.greedy} torch={torch.__version__}",
          flush=True)
    for vocab in args.vocab:
        for batch in args.batch:
            ns = argparse.Namespace(model=args.model, vocab=vocab, batch=batch, prompt=args.prompt, new=args.new,
                                    device=args.device, precision="fp32")
            runner = make_env_runner(ns, True, "fast")
            module, env_config = runner.module, runner.config.env_config
            device = torch.device(args.device)
            TokenGenerationEnv(env_config)
            start = time.perf_counter()
            for _ in range(5):
                TokenGenerationEnv(env_config)
            env_ms = (time.perf_counter() - start) / 5 * 1e3
            prompts = [None] * batch
            generate(module, env_config, prompts, seed=0, batch_size=batch, greedy=args.greedy)
            times, tokens = [], []
            for rep in range(args.reps):
                sync(device)
                start = time.perf_counter()
                out = generate(module, env_config, prompts, seed=rep + 1, batch_size=batch, greedy=args.greedy)
                sync(device)
                times.append(time.perf_counter() - start)
                tokens.append(sum(r["num_generated"] for r in out))
            ms = 1e3 * float(np.median(times))
            print(f"vocab {vocab:6d}  batch {batch:4d}: {ms:9.1f} ms per call, {int(np.median(tokens)):5d} tokens, "
                  f"{sum(tokens) / sum(times):9,.0f} tok/s;  one more env of this config {env_ms:7.2f} ms", flush=True)
            runner.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
