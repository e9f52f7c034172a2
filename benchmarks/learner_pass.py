"""A learner pass over whole sequences (forward and backward of a GPT-2 trunk), by transformers'
forward against the project's tensor-op pass (`agents.modules.kv_cache.gpt2_forward`), with the
precision a learner uses: the milliseconds a pass takes (host clock, the device synced after each
pass) and the ops it runs (on CUDA: the kernels it launches), per pass.

    python benchmarks/learner_pass.py [--device cuda] [--precision bf16] [--layers 12 --width 768 --heads 12]
                                      [--rows 150 --columns 25] [--reps 10]

The defaults are the shape of `peer_trl.py --model gpt2-small-shaped`'s learner passes (about
150 sequences of up to 25 tokens per 2,560-step batch). The loss is the mean square of the final
hidden states at the real tokens (the pass's cost does not depend on it). Under bf16 autocast the
tensor-op pass is what the learner takes since it was allowed there (before, transformers'
forward). Prints measured figures only.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import nullcontext

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agents.model_edits import fuse_activations  # noqa: E402
from agents.modules.kv_cache import gpt2_forward, position_ids_for  # noqa: E402


def windows(rows: int, columns: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded windows of 5 to `columns` real tokens."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(min(5, columns), columns + 1, (rows,), generator=g)
    mask = (torch.arange(columns)[None] >= columns - lengths[:, None]).long()
    ids = torch.randint(0, vocab, (rows, columns), generator=g) * mask
    return ids.to(device), mask.to(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=52)
    p.add_argument("--rows", type=int, default=150)
    p.add_argument("--columns", type=int, default=25)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    from transformers import GPT2Config, GPT2Model

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # as the learner's process has it
    torch.manual_seed(0)
    trunk = GPT2Model(GPT2Config(vocab_size=args.vocab, n_positions=max(64, args.columns), n_layer=args.layers,
                                 n_embd=args.width, n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0,
                                 attn_pdrop=0.0)).to(device).train()
    fuse_activations(trunk)  # as the project's models are built
    ids, mask = windows(args.rows, args.columns, args.vocab, device)
    real = mask.bool()

    def autocast():
        if args.precision == "fp32":
            return nullcontext()
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)

    def transformers_pass():
        return trunk(input_ids=ids, attention_mask=mask, position_ids=position_ids_for(mask)).last_hidden_state

    def tensor_op_pass():
        return gpt2_forward(trunk, ids, mask)[0]

    def step(forward):
        trunk.zero_grad(set_to_none=True)
        with autocast():
            hidden = forward()
        (hidden[real].float() ** 2).mean().backward()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, {args.precision}; GPT-2 trunk {args.layers} layers x {args.width} "
          f"({args.heads} heads), {args.rows} rows x {args.columns} columns, forward and backward")
    with autocast():
        if gpt2_forward(trunk, ids, mask) is None:
            print("the tensor-op pass does not apply here (gpt2_forward gave None)")
            return
    print(f"  {'pass':20s} {'ms per pass (median)':>21s} {'min':>8s} {'ops per pass':>13s} {'kernel launches':>16s}")
    for label, forward in (("transformers", transformers_pass), ("tensor ops", tensor_op_pass)):
        for _ in range(3):
            step(forward)
        sync()
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            step(forward)
            sync()
            times.append(time.perf_counter() - t0)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            step(forward)
            sync()
        events = prof.events()
        ops = sum(1 for e in events if e.name.startswith("aten::")  # outermost aten ops, backward's too
                  and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))
        launches = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
        print(f"  {label:20s} {1e3 * statistics.median(times):21.2f} {1e3 * min(times):8.2f} {ops:13d} "
              f"{launches if device.type == 'cuda' else '-':>16}", flush=True)


if __name__ == "__main__":
    main()
