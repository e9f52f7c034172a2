"""Peak memory of one learner update and of one EnvRunner rollout, per model shape and setting.

    python benchmarks/memory.py [--shapes gpt2-small-shaped gpt2-medium-shaped] [--variants ...]
                                [--sequences 8] [--prompt 64] [--new 64] [--rows 16] [--vocab 50257]

Each (shape, setting, part) runs in a fresh process, so every peak is its own:
  learner:   the PPO learner module (`CausalLMActorCritic`, reference for the KL on), Adam over
             what it trains, then one minibatch update as the learner runs it: the value pass
             for GAE and the reference pass (no grad), the training pass, a clipped-ratio loss
             with the value loss, backward, optimizer step. --sequences sequences of --prompt +
             --new tokens (one training row per generated token).
  envrunner: the inference-only module in the rollout precision, --rows rows stepping --new
             tokens through its KV cache.
Settings (model.lora, training.precision, training.gradient_checkpointing, env_runners.precision):
  full-fp32 (the reference), full-bf16, full-fp32-ckpt, full-bf16-ckpt, lora-fp32,
  lora-fp32-ckpt, lora-bf16, lora-bf16-ckpt. LoRA: rank 16 on every attention and MLP projection (c_attn, c_proj, c_fc).
Memory: on CPU, the process's peak RSS (ru_maxrss) and its RSS after the update or rollout
(`held`: what the setting keeps), each minus its RSS before the model was built (Python, torch
and the imports: printed as `base`); on CUDA (--device cuda) peak and current allocated. The
model is built in float32 and then cast, so on CPU the peak includes that float32 build.
Ratios are against full-fp32 of the same shape and part. The weights are random (no download);
the vocabulary is --vocab tokens (GPT-2's size by default: the synthetic task's number tokens).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VARIANTS = {  # name -> (lora, train/rollout precision, gradient checkpointing)
    "full-fp32": (False, "fp32", False),
    "full-bf16": (False, "bf16", False),
    "full-fp32-ckpt": (False, "fp32", True),
    "full-bf16-ckpt": (False, "bf16", True),
    "lora-fp32": (True, "fp32", False),
    "lora-fp32-ckpt": (True, "fp32", True),
    "lora-bf16": (True, "bf16", False),
    "lora-bf16-ckpt": (True, "bf16", True),
}
LORA = {"r": 16, "alpha": 32.0, "target_modules": ["c_attn", "c_proj", "c_fc"]}


def rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def held_mib(args) -> float:
    """Memory in use now, while the module (and its optimizer) are alive."""
    import torch

    return torch.cuda.memory_allocated() / 2**20 if args.device == "cuda" else rss_mib()


def build(args, variant: str, inference_only: bool):
    from agents.modules import CausalLMActorCritic
    from env.text_env import TokenGenerationEnv

    lora, precision, ckpt = VARIANTS[variant]
    env_cfg = {"task": {"name": "increasing_numbers", "num_numbers": args.vocab - 3, "prompt_len": args.prompt},
               "max_prompt_len": args.prompt, "max_new_tokens": args.new}
    env = TokenGenerationEnv(env_cfg)
    module = CausalLMActorCritic(
        observation_space=env.observation_space, action_space=env.action_space, inference_only=inference_only,
        model_config={"model": {"name_or_path": args.shape, **({"lora": LORA} if lora else {})}, "env": env_cfg,
                      "seed": 0, "reference_model": True, "train_precision": precision,
                      "rollout_precision": precision, "gradient_checkpointing": ckpt})
    return module.to(args.device), env.vocab_size


def windows(ids, prompt: int):
    """The rows a learner trains on: for each sequence, its first prompt + t tokens (t = 0 ..
    generated - 1) left-padded to the whole length, with the sequence's id and the next token."""
    import torch

    n, length = ids.shape
    rows = torch.zeros(n * (length - prompt), length, dtype=torch.long)
    masks = torch.zeros_like(rows)
    seq, actions = [], []
    for s in range(n):
        for end in range(prompt, length):
            i = len(seq)
            rows[i, length - end:] = ids[s, :end]
            masks[i, length - end:] = 1
            seq.append(s)
            actions.append(int(ids[s, end]))
    return rows, masks, torch.as_tensor(seq), torch.as_tensor(actions)


def learner_update(args, variant: str) -> dict:
    import torch
    from ray.rllib.core.columns import Columns

    module, vocab = build(args, variant, inference_only=False)
    module.train()
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-5)
    g = torch.Generator().manual_seed(0)
    length = args.prompt + args.new
    ids = torch.randint(3, vocab, (args.sequences, length), generator=g)
    obs_ids, mask, seq, actions = windows(ids, args.prompt)
    dev = args.device
    batch = {Columns.OBS: {"input_ids": obs_ids.to(dev), "attention_mask": mask.to(dev)},
             Columns.ACTIONS: actions.to(dev), "seq_id": seq.to(dev)}
    start = time.perf_counter()
    with torch.no_grad():
        old_values = module.compute_values(batch)
        ref_logp = module.reference_logp(batch)
    out = module.forward_train(batch)
    logp = torch.log_softmax(out[Columns.ACTION_DIST_INPUTS], -1).gather(-1, batch[Columns.ACTIONS][:, None])[:, 0]
    old_logp = logp.detach()
    adv = torch.randn(logp.shape, generator=g).to(dev)
    ratio = torch.exp(logp - old_logp)
    policy = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
    values = module.compute_values(batch, out[Columns.EMBEDDINGS])
    loss = policy + 0.5 * (values - (old_values + adv)).pow(2).mean() + 0.0 * (logp - ref_logp).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {"rows": int(obs_ids.shape[0]), "seconds": time.perf_counter() - start, "held": held_mib(args),
            "params": sum(p.numel() for p in module.parameters()), "trained": sum(p.numel() for p in params)}


def envrunner_rollout(args, variant: str) -> dict:
    import torch
    from ray.rllib.core.columns import Columns

    module, vocab = build(args, variant, inference_only=True)
    length = args.prompt + args.new
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(args.rows, length, dtype=torch.long)
    mask = torch.zeros(args.rows, length, dtype=torch.long)
    ids[:, -args.prompt:] = torch.randint(3, vocab, (args.rows, args.prompt), generator=g)
    mask[:, -args.prompt:] = 1
    start = time.perf_counter()
    for _ in range(args.new):
        out = module.act({Columns.OBS: {"input_ids": ids.to(args.device), "attention_mask": mask.to(args.device)}})
        a = out[Columns.ACTIONS].cpu()
        ids = torch.cat([ids[:, 1:], a[:, None]], 1)
        mask = torch.cat([mask[:, 1:], torch.ones(args.rows, 1, dtype=torch.long)], 1)
    return {"rows": args.rows, "seconds": time.perf_counter() - start, "held": held_mib(args),
            "params": sum(p.numel() for p in module.parameters())}


def one(args) -> None:
    """Child process: one (shape, variant, part); prints a JSON line."""
    import torch

    torch.set_num_threads(args.threads)
    importlib.import_module("agents.modules")  # the imports count in the base

    base = rss_mib()
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    fn = learner_update if args.part == "learner" else envrunner_rollout
    result = fn(args, args.variant)
    peak = torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else peak_rss_mib() - base
    held = result.pop("held") - (0 if args.device == "cuda" else base)
    print(json.dumps({"shape": args.shape, "variant": args.variant, "part": args.part, "base_mib": base,
                      "peak_mib": peak, "held_mib": held, **result}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["gpt2-small-shaped", "gpt2-medium-shaped"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--parts", nargs="+", default=["learner", "envrunner"], choices=["learner", "envrunner"])
    p.add_argument("--sequences", type=int, default=8, help="sequences in the learner's minibatch")
    p.add_argument("--rows", type=int, default=16, help="EnvRunner rows (vector-env size)")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--json", help="also write the rows to this file")
    # one measurement (the child process)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--part", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.variant:
        one(args)
        return 0
    common = [f"--{k}={getattr(args, k)}" for k in ("sequences", "rows", "prompt", "new", "vocab", "threads", "device")]
    rows = []
    print(f"{'shape':20} {'part':9} {'setting':15} {'peak MiB':>9} {'x full-fp32':>11} {'held MiB':>9} "
          f"{'x full-fp32':>11} {'trained':>12} {'s':>6}")
    for shape in args.shapes:
        for part in args.parts:
            ref = ref_held = None
            for variant in args.variants:
                if part == "envrunner" and variant.endswith("-ckpt"):
                    continue  # checkpointing is a learner setting: the EnvRunner is the one without it
                proc = subprocess.run([sys.executable, __file__, *common, f"--shape={shape}", f"--variant={variant}",
                                       f"--part={part}"], capture_output=True, text=True)
                if proc.returncode != 0:
                    print(f"{shape:20} {part:9} {variant:15} failed: {proc.stderr.strip().splitlines()[-1:]}")
                    continue
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                rows.append(row)
                if variant == "full-fp32":
                    ref, ref_held = row["peak_mib"], row["held_mib"]
                ratio = f"{row['peak_mib'] / ref:.2f}" if ref else "-"
                ratio_held = f"{row['held_mib'] / ref_held:.2f}" if ref_held else "-"
                trained = f"{row['trained']:,}" if "trained" in row else "-"
                print(f"{shape:20} {part:9} {variant:15} {row['peak_mib']:9.0f} {ratio:>11} {row['held_mib']:9.0f} "
                      f"{ratio_held:>11} {trained:>12} {row['seconds']:6.1f}", flush=True)
    if rows:
        print(f"(base RSS before building, not counted: {min(r['base_mib'] for r in rows):.0f}-"
              f"{max(r['base_mib'] for r in rows):.0f} MiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
