"""Rollout throughput: the token env in RLlib vs batched generate(), same run, same weights.

    python benchmarks/rollout_throughput.py [--model tiny-gpt2] [--batch 16] [--prompt 64] [--new 48]

Measures tokens/s of
  (a) `model.generate()` with its KV cache (sampling, exactly --new tokens),
  (b) RLlib's SingleAgentEnvRunner stepping TokenGenerationEnv, KV-cached module,
  (c) the same with the cache off (every step recomputes the whole window),
and prints b/a, c/a and the bytes RLlib stores per sampled step. With
--profile, it also splits the cached path's time by area (cProfile).
The vocabulary is --vocab tokens (the synthetic task's number tokens plus pad
and EOS); weights are random (no download). EOS can end an env episode early,
which costs the env path an extra prefill and never helps it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
import tree

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from agents.config import algorithm_config, validate  # noqa: E402
from agents.models import build_causal_lm, build_tokenizer  # noqa: E402


def make_cfg(args, kv_cache: bool) -> dict:
    return validate({
        "task": {"name": "increasing_numbers", "num_numbers": args.vocab - 2, "prompt_len": args.prompt},
        "model": {"name_or_path": args.model, "kv_cache": kv_cache},
        "env": {"max_prompt_len": args.prompt, "max_new_tokens": args.new},
        "env_runners": {"num_env_runners": 0, "num_envs_per_env_runner": args.batch},
        "training": {"train_batch_size": args.batch * args.new, "minibatch_size": args.batch},
        "seed": 0,
    })


def bench_generate(args) -> float:
    cfg = make_cfg(args, True)
    from agents.config import env_config
    tok = build_tokenizer(env_config(cfg))
    model = build_causal_lm(cfg["model"], tok, seed=0, max_positions=args.prompt + args.new).eval()
    prompt = torch.full((args.batch, args.prompt), tok.pad_token_id)
    mask = torch.ones_like(prompt)
    kw = dict(attention_mask=mask, do_sample=True, top_k=0, max_new_tokens=args.new, min_new_tokens=args.new,
              use_cache=True, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        model.generate(prompt, **kw)  # warm-up
        start = time.perf_counter()
        for _ in range(args.reps):
            out = model.generate(prompt, **kw)
        elapsed = time.perf_counter() - start
    assert out.shape[1] == args.prompt + args.new
    return args.batch * args.new * args.reps / elapsed


def stored_bytes_per_step(episodes) -> float:
    total, steps = 0, 0
    for ep in episodes:
        data = [ep.get_observations(), ep.get_actions(), ep.get_rewards(),
                {k: ep.get_extra_model_outputs(k) for k in ep.extra_model_outputs}]
        total += sum(np.asarray(x).nbytes for x in tree.flatten(data))
        steps += len(ep)
    return total / max(steps, 1)


def bench_env_runner(args, kv_cache: bool, reps: int):
    from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner

    runner = SingleAgentEnvRunner(config=algorithm_config(make_cfg(args, kv_cache)))
    steps = args.batch * args.new
    runner.sample(num_timesteps=steps, random_actions=False)  # warm-up (builds the first cache)
    start = time.perf_counter()
    episodes = []
    for _ in range(reps):
        episodes += runner.sample(num_timesteps=steps, random_actions=False)
    elapsed = time.perf_counter() - start
    sampled = sum(len(e) for e in episodes)
    return sampled / elapsed, stored_bytes_per_step(episodes)


PROFILE_PARTS = (  # (label, file suffix, function): inclusive time of these calls
    ("RLModule forward_exploration", "actor_critic.py", "forward_exploration"),
    ("  of which cached LM step", "kv_cache.py", "hidden_at_last_token"),
    ("RLlib connector pipelines", "connector_pipeline_v2.py", "__call__"),
    ("vector env step (16 envs)", "env_runner.py", "_try_env_step"),
)


def profile_env_runner(args) -> None:
    """Where the cached path's time goes: inclusive time of its main parts (cProfile)."""
    import cProfile
    import pstats

    from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner

    runner = SingleAgentEnvRunner(config=algorithm_config(make_cfg(args, True)))
    steps = args.batch * args.new
    runner.sample(num_timesteps=steps, random_actions=False)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.reps):
        runner.sample(num_timesteps=steps, random_actions=False)
    prof.disable()
    stats = pstats.Stats(prof).stats
    total = sum(cum for (f, _, fn), (_, _, _, cum, _) in stats.items() if fn == "sample" and f.endswith("single_agent_env_runner.py"))
    print(f"profile of the cached path: {args.reps * steps} steps, {total:.2f} s under cProfile")
    accounted = 0.0
    for label, suffix, func in PROFILE_PARTS:
        t = sum(cum for (f, _, fn), (_, _, _, cum, _) in stats.items() if fn == func and f.endswith(suffix))
        if not label.startswith(" "):
            accounted += t
        print(f"  {label:32s} {t:6.2f} s  {100 * t / total:5.1f}%")
    print(f"  {'rest (episodes, metrics, loop)':32s} {total - accounted:6.2f} s  {100 * (total - accounted) / total:5.1f}%")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-gpt2")
    p.add_argument("--vocab", type=int, default=52)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--uncached-reps", type=int, default=1)
    p.add_argument("--profile", action="store_true", help="also profile the cached path, by area")
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"model={args.model} vocab={args.vocab} batch={args.batch} prompt={args.prompt} new={args.new} "
          f"threads={torch.get_num_threads()}", flush=True)
    a = bench_generate(args)
    print(f"(a) generate() with KV cache     {a:10.1f} tokens/s", flush=True)
    b, b_bytes = bench_env_runner(args, True, args.reps)
    print(f"(b) RLlib + env, cached module   {b:10.1f} tokens/s   b/a = {b / a:.2f}   "
          f"stored {b_bytes:,.0f} B/step", flush=True)
    c, _ = bench_env_runner(args, False, args.uncached_reps)
    print(f"(c) RLlib + env, no cache        {c:10.1f} tokens/s   c/a = {c / a:.2f}", flush=True)
    if args.profile:
        profile_env_runner(args)


if __name__ == "__main__":
    main()
