"""Rollout throughput: the token env in RLlib vs batched generate(), same run, same weights.

    python benchmarks/rollout_throughput.py [--model tiny-gpt2] [--batch 16] [--prompt 64] [--new 48] [--device cuda]

Measures tokens/s of
  (a)  `model.generate()` with its KV cache, sampling exactly --new tokens per row,
  (a') the same stopping at EOS, counting only tokens up to each row's EOS (the env's work),
  (b)  RLlib's stock SingleAgentEnvRunner stepping TokenGenerationEnv rows, KV-cached module,
  (c)  the same with the cache off (--uncached; every step recomputes the whole window),
  (d)  the fast EnvRunner (agents/env_runner.py) stepping the vector env,
  (d0) the same with prefills never reused: every row that starts is prefilled, as if every prompt
       differed (this task's prompt is always the same, so (d) prefills it once per weight sync),
  (dw) (d) with the module stepping through the window cache (the path before the decode engine),
  (g<k>) with --greedy-blocks k ...: the fast EnvRunner's greedy evaluation (`sample(num_episodes=
       4 x --batch, explore=False)`, as `evaluation.interval` runs it) at `decode_block` k (with
       --count-ops also its ops outside the decode engine's graphs per token, graphs emulated),
  (e)  the decode engine alone: one prefill, then static steps that sample inside the step (a
       replayed CUDA graph on CUDA), with the step's milliseconds beside the floor: the bytes a
       step must read (weights and KV buffers) over the device's measured copy bandwidth,
and prints each EnvRunner's ratio to (a) and (a') and the bytes stored per sampled step.
Repetitions run round-robin over the paths, so all see the same machine state.
With --profile, it also splits the stock cached path's time by area (cProfile).
The vocabulary is --vocab tokens (the synthetic task's number tokens plus pad
and EOS); weights are random (no download). At a small vocabulary EOS ends
many env episodes early: a row then waits or restarts (a prefill) where (a)
keeps generating tokens that count.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
import tree

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks.emulated_capture

from agents.config import algorithm_config, validate  # noqa: E402
from agents.env_runner import decode_block_for  # noqa: E402
from agents.models import DTYPES, build_causal_lm, build_tokenizer  # noqa: E402


def make_cfg(args, kv_cache: bool, runner: str = "stock") -> dict:
    return validate({
        "task": {"name": "increasing_numbers", "num_numbers": args.vocab - 2, "prompt_len": args.prompt},
        "model": {"name_or_path": args.model, "kv_cache": kv_cache},
        "env": {"max_prompt_len": args.prompt, "max_new_tokens": args.new},
        "env_runners": {"num_env_runners": 0, "num_envs_per_env_runner": args.batch, "runner": runner,
                        "precision": args.precision,
                        **({"decode_block": getattr(args, "decode_block", None)} if runner == "fast" else {})},
        "training": {"train_batch_size": args.batch * args.new, "minibatch_size": args.batch},
        "seed": 0,
    })


def generate_path(args, *, stop_at_eos: bool):
    """One rep of batched generate(): (tokens, seconds). Forced to --new tokens, or stopping at EOS
    (then only tokens up to and including each row's EOS count, as the env counts them)."""
    cfg = make_cfg(args, True)
    from agents.config import env_config
    tok = build_tokenizer(env_config(cfg))
    model = build_causal_lm(cfg["model"], tok, seed=0, max_positions=args.prompt + args.new).eval()
    device = torch.device(args.device)
    model.to(device, DTYPES[args.precision])  # the EnvRunners' rollout precision
    prompt = torch.full((args.batch, args.prompt), tok.pad_token_id, device=device)
    mask = torch.ones_like(prompt)
    kw = dict(attention_mask=mask, do_sample=True, top_k=0, max_new_tokens=args.new, use_cache=True,
              pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    if not stop_at_eos:
        kw["min_new_tokens"] = args.new

    @torch.no_grad()
    def rep():
        sync(device)
        start = time.perf_counter()
        out = model.generate(prompt, **kw)
        sync(device)
        elapsed = time.perf_counter() - start
        new = out[:, args.prompt:]
        if not stop_at_eos:
            assert new.shape[1] == args.new
            return new.numel(), elapsed
        is_eos = (new == tok.eos_token_id).int()
        before_eos = is_eos.cumsum(1) - is_eos == 0  # tokens up to and including the first EOS
        return int(before_eos.sum()), elapsed

    return rep


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def stored_bytes_per_step(episodes) -> float:
    total, steps = 0, 0
    for ep in episodes:
        data = [ep.get_observations(), ep.get_actions(), ep.get_rewards(),
                {k: ep.get_extra_model_outputs(k) for k in ep.extra_model_outputs}]
        total += sum(np.asarray(x).nbytes for x in tree.flatten(data))
        steps += len(ep)
    return total / max(steps, 1)


def make_env_runner(args, kv_cache: bool, runner: str):
    config = algorithm_config(make_cfg(args, kv_cache, runner))
    if args.device == "cuda":  # RLlib places only remote EnvRunners (index >= 1) on a GPU
        config.env_runners(num_gpus_per_env_runner=1)
        return config.env_runner_cls(config=config, worker_index=1)
    return config.env_runner_cls(config=config)


def env_runner_path(args, *, kv_cache: bool, runner: str, stored: list, reuse_prefills: bool = True,
                    window_cache: bool = False, greedy_block: int | None = None):
    """One rep of an EnvRunner's sample(): (env steps, seconds). `runner`: fast or stock.
    `reuse_prefills=False`: every row that starts is prefilled, as if every prompt differed.
    `window_cache`: the module steps through `WindowKVCache` (the path before the decode engine).
    `greedy_block` k: greedy evaluation episodes (4 per row) at `decode_block` k."""
    if greedy_block is not None:
        args = argparse.Namespace(**{**vars(args), "decode_block": greedy_block})
    env_runner = make_env_runner(args, kv_cache, runner)
    if window_cache:
        from agents.modules.kv_cache import WindowKVCache

        env_runner.module.kv_cache = env_runner._cache = WindowKVCache()
    if not reuse_prefills and kv_cache:
        env_runner.module.kv_cache.reuse_prefills = False
    steps = args.batch * args.new
    device = torch.device(args.device)

    def rep():
        start = time.perf_counter()
        if greedy_block is not None:
            episodes = env_runner.sample(num_episodes=4 * args.batch, explore=False)
        else:
            episodes = env_runner.sample(num_timesteps=steps, random_actions=False)
        sync(device)
        elapsed = time.perf_counter() - start
        stored.append(stored_bytes_per_step(episodes))
        return sum(len(e) for e in episodes), elapsed

    return rep


def greedy_ops(args, k: int) -> tuple[float, float]:
    """Per token of greedy evaluation at `decode_block` k (a call after the one that captures): the
    ops run outside the decode engine's graphs and the graph replays, its graphs emulated on the
    CPU (benchmarks/emulated_capture.py): what would be kernel launches on a GPU."""
    from benchmarks.emulated_capture import OpCounter, emulate_capture

    args = argparse.Namespace(**{**vars(args), "device": "cpu"})  # the emulation is of a GPU's graphs, on the CPU
    with OpCounter() as ops, emulate_capture(ops):
        rep = env_runner_path(args, kv_cache=True, runner="fast", stored=[], greedy_block=k)
        rep()
        ops.n = ops.replays = 0
        tokens, _ = rep()
    return ops.n / tokens, ops.replays / tokens


def engine_module(args):
    """The fast EnvRunner's module on --device, and a batch of windows holding the prompt (all pad
    tokens) as its rollouts start: (module, device, obs, key of its static rollout step)."""
    module = make_env_runner(args, True, "fast").module
    device = next(module.parameters()).device
    L = args.prompt + args.new
    ids = torch.full((args.batch, L), module.tokenizer.pad_token_id, device=device)
    mask = torch.zeros_like(ids)
    mask[:, L - args.prompt:] = 1
    return module, device, {"input_ids": ids, "attention_mask": mask}, ("explore", module.values_in_rollouts)


def engine_path(args, report: dict):
    """One rep of the decode engine alone (agents/modules/decode_engine.py), as the fast EnvRunner's
    module runs it: every row prefilled on the prompt, then --new - 1 static steps, each drawing
    its token inside the step (a replayed CUDA graph on CUDA). (tokens, seconds); `report` gets
    the step's milliseconds and the bytes a step must read."""
    from ray.rllib.core.columns import Columns

    module, device, obs, key = engine_module(args)
    cache, trunk = module.kv_cache, module.lm.base_model
    L = args.prompt + args.new
    weights = {t.data_ptr(): t.nbytes for t in module.state_dict().values()}  # tied weights once
    kv = 2 * trunk.config.n_layer * args.batch * L * trunk.embed_dim * next(trunk.parameters()).element_size()
    report["bytes"] = sum(weights.values()) + kv

    @torch.no_grad()
    def rep():
        cache.invalidate()
        sync(device)
        start = time.perf_counter()
        uniform = torch.rand(args.batch, 1, dtype=torch.float64, device=device)
        out = cache.hidden_at_last_token(trunk, obs, None, tail=module._sample, tail_inputs=(uniform,), key=key)
        sync(device)
        prefilled = time.perf_counter()
        for _ in range(args.new - 1):
            uniform = torch.rand(args.batch, 1, dtype=torch.float64, device=device)
            out = cache.engine.step(out[Columns.ACTIONS], module._sample, (uniform,), key)
        sync(device)
        end = time.perf_counter()
        report.setdefault("step_s", []).append((end - prefilled) / max(1, args.new - 1))
        return args.batch * args.new, end - start

    return rep


def copy_bandwidth(device, nbytes: int = 256 << 20) -> float:
    """Bytes per second a large device-to-device copy moves (read + write), best of 5."""
    a = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        b.copy_(a)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


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

    config = algorithm_config(make_cfg(args, True, "stock"))
    runner = config.env_runner_cls(config=config)
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
    p.add_argument("--uncached", action="store_true", help="also run the stock EnvRunner with the cache off")
    p.add_argument("--device", default="cpu", help="cpu or cuda (model, cache and rollouts on that device)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                   help="every path's weights in it (the EnvRunners' env_runners.precision)")
    p.add_argument("--decode-block", type=int, default=None,
                   help="the fast EnvRunner rows' env_runners.decode_block (module steps per env round trip; "
                        "default: the config's, 4)")
    p.add_argument("--greedy-blocks", type=int, nargs="*", default=[], metavar="K",
                   help="also the fast EnvRunner's greedy evaluation at each decode_block K (rows g<K>)")
    p.add_argument("--count-ops", action="store_true",
                   help="with --greedy-blocks: also count each row's ops outside the decode engine's graphs per "
                        "token, graphs emulated on the CPU")
    p.add_argument("--tf32", action="store_true",
                   help="TF32 matmuls for every path (what training.precision auto turns on for a GPU run's process)")
    p.add_argument("--profile", action="store_true", help="also profile the stock cached path, by area")
    args = p.parse_args()
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
    print(f"model={args.model} vocab={args.vocab} batch={args.batch} prompt={args.prompt} new={args.new} "
          f"threads={torch.get_num_threads()} device={args.device} precision={args.precision} tf32={args.tf32} "
          f"decode_block={decode_block_for(args.decode_block)} (fast EnvRunner rows)",
          flush=True)
    stored_stock, stored_fast, engine_report = [], [], {}
    paths = {  # label -> one-rep callable; reps run round-robin so every path sees the same machine state
        "a": ("(a) generate(), forced to --new tokens", generate_path(args, stop_at_eos=False)),
        "a_eos": ("(a') generate(), stopping at EOS", generate_path(args, stop_at_eos=True)),
        "b": ("(b) stock RLlib EnvRunner + env, cached", env_runner_path(args, kv_cache=True, runner="stock",
                                                                         stored=stored_stock)),
        "d": ("(d) fast EnvRunner + vector env", env_runner_path(args, kv_cache=True, runner="fast",
                                                                  stored=stored_fast)),
        "d0": ("(d0) fast, every prompt prefilled", env_runner_path(args, kv_cache=True, runner="fast",
                                                                     stored=[], reuse_prefills=False)),
        "dw": ("(dw) fast, window cache (no engine)", env_runner_path(args, kv_cache=True, runner="fast",
                                                                       stored=[], window_cache=True)),
        "e": ("(e) decode engine alone, --new tokens", engine_path(args, engine_report)),
    }
    for k in args.greedy_blocks:
        paths[f"g{k}"] = (f"(g{k}) fast, greedy evaluation, blocks of {k}",
                          env_runner_path(args, kv_cache=True, runner="fast", stored=[], greedy_block=k))
    if args.uncached:
        paths["c"] = ("(c) stock RLlib EnvRunner, no cache", env_runner_path(args, kv_cache=False, runner="stock",
                                                                             stored=[]))
    for _, rep in paths.values():
        rep()  # warm-up (first cache, lazy initialisation)
    tokens = {k: 0 for k in paths}
    seconds = {k: 0.0 for k in paths}
    for _ in range(args.reps):
        for k, (_, rep) in paths.items():
            n, s = rep()
            tokens[k] += n
            seconds[k] += s
    rate = {k: tokens[k] / seconds[k] for k in paths}
    for k, (label, _) in paths.items():
        extra = ""
        if k not in ("a", "a_eos"):
            extra = f"   /a = {rate[k] / rate['a']:.2f}   /a' = {rate[k] / rate['a_eos']:.2f}"
        print(f"{label:42s} {rate[k]:10.1f} tokens/s{extra}", flush=True)
    print(f"stored per step: stock {np.mean(stored_stock):,.0f} B, fast {np.mean(stored_fast):,.0f} B")
    print(f"fast / stock = {rate['d'] / rate['b']:.2f}   engine / window cache (d / dw) = {rate['d'] / rate['dw']:.2f}")
    for k in args.greedy_blocks[1:]:
        first = args.greedy_blocks[0]
        print(f"greedy evaluation, blocks of {k} / blocks of {first} = {rate[f'g{k}'] / rate[f'g{first}']:.2f}")
    for k in args.greedy_blocks if args.count_ops else ():
        ops, replays = greedy_ops(args, k)
        print(f"greedy evaluation, blocks of {k}: {ops * args.batch:.1f} ops outside graphs and "
              f"{replays * args.batch:.2f} graph replays per {args.batch} tokens (a step of every row; graphs "
              f"emulated on the CPU)")
    step_ms = 1e3 * float(np.median(engine_report["step_s"]))
    bandwidth = copy_bandwidth(torch.device(args.device))
    floor_ms = 1e3 * engine_report["bytes"] / bandwidth
    print(f"decode engine step: {step_ms:.3f} ms (median of reps); floor {floor_ms:.3f} ms = "
          f"{engine_report['bytes'] / 1e6:,.1f} MB read per step (weights + KV buffers) at "
          f"{bandwidth / 1e9:,.1f} GB/s (measured copy bandwidth); step / floor = {step_ms / floor_ms:.1f}")
    if args.profile:
        profile_env_runner(args)


if __name__ == "__main__":
    main()
