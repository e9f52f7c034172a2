"""Generate text with a trained policy.

    python -m agents.generate --checkpoint PATH [--prompt TEXT ...] [-n N] [--greedy] [--device cuda]
                              [--precision bf16]

PATH is a checkpoint directory written by `agents.train` (or the RLModule
directory inside it). The task, tokenizer and lengths come from the checkpoint.

The module imports the standard library only at its top, and numpy, torch, RLlib and transformers
in the functions that need them: a wrong flag or PATH is refused in one line before they load, and
`agents.export` and `agents.evaluate` import it as lightly.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import weakref
from typing import TYPE_CHECKING

from agents.saved_policy import PRECISIONS, check_base, check_whole, find_module_dir

if TYPE_CHECKING:  # the annotations' names; torch itself is imported where it is used
    import torch

MAX_N = 1000  # generations per prompt, all printed (evaluate samples more and writes them to files)


def load_policy(checkpoint: str):
    """The RLModule stored in `checkpoint`, in eval mode, in float32."""
    where = find_module_dir(checkpoint)  # a wrong path is refused before RLlib and torch are imported
    import torch
    from ray.rllib.core.rl_module.rl_module import RLModule

    from agents.core import DropLogLines

    check_base(stored_model_config(where))  # its model's and tokenizer's directories as they were
    check_whole(where)  # its files as its save listed them
    quiet = DropLogLines("RLModuleConfig")  # RLlib builds every RLModule through it, and warns
    deprecation_log = logging.getLogger("ray._common.deprecation")
    deprecation_log.addFilter(quiet)
    try:
        module = RLModule.from_checkpoint(where)
    except Exception as e:  # a truncated or corrupted file: unpickling or torch.load fails deep inside
        raise ValueError(f"--checkpoint: the policy in {where} cannot be loaded "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no message'})") from e
    finally:
        deprecation_log.removeFilter(quiet)
    module.eval()
    if any(p.dtype != torch.float32 for p in module.parameters() if p.is_floating_point()):
        module.float()  # a bf16/fp16 learner's stored weights, computed in float32 when generating
        module.precision = "fp32"
    return module


def stored_model_config(where: str) -> dict:
    """The module's config as its checkpoint stores it ({} where it cannot be read: loading then
    says why)."""
    import pickle

    try:
        with open(os.path.join(where, "class_and_ctor_args.pkl"), "rb") as f:
            return dict(pickle.load(f)["ctor_args_and_kwargs"][1].get("model_config") or {})
    except Exception:
        return {}


def reward_needs_meta(task) -> bool:
    """True when the task's reward cannot score a text without the example's metadata
    (references, labels): a prompt typed by a user then gets no reward."""
    try:
        examples = task.examples("train")
    except (OSError, ValueError):  # a task without a train split here: any text will do
        examples = []
    prompt = examples[0]["prompt"] if examples else "a"
    try:
        task.reward([prompt], [prompt], [{}])
    except (ValueError, KeyError, TypeError):
        return True
    return False


def generate(module, env_config: dict, prompts: list[str | None], *, greedy: bool = False, seed: int = 0,
             metas: list[dict] | None = None, score: bool = True, batch_size: int = 64,
             temperature: float = 1.0, top_p: float = 1.0, decoder: bool = True) -> list[dict]:
    """The decode loop of generation, evaluation, serving and the training summary: the policy
    runs in one `TokenGenerationEnv` per prompt (the prompt cut, EOS and lengths of training),
    up to `batch_size` rows decoded together. A causal policy with its KV cache decodes on the
    decode engine in static blocks (`agents.modules.decoding.Decoder`: a CUDA graph per block on a
    GPU, one host read per block), then each row's tokens go through its env; other policies
    (seq2seq, Q-networks, sampling with mirostat), or `decoder=False`, take one module call per
    token with the envs stepped in between. Both give the same tokens on the CPU (tested); on a GPU
    up to the rounding of the decoder's padded batch.

    A prompt of None draws one (with its metadata) from the task, seeded with seed + i; a given
    prompt takes `metas[i]` (default none). Row i samples from its own generator seeded with
    seed + i, one uniform per token (`draw_rows`: the draws a serving replica's continuous
    batching makes too). Returns `[{"prompt", "generation", "reward", "prompt_tokens",
    "num_generated", "eos"}]`: the reward is the episode's return (the task's reward, sparse or
    dense), or None with `score=False` (given prompts only); `prompt_tokens` counts the prompt as
    the policy saw it (after the env's truncation), `num_generated` the tokens the policy wrote
    (EOS included), and `eos` says whether EOS ended the episode (else it reached its
    max_new_tokens).

    `temperature` and `top_p` (sampling only) act on top of the policy's own distribution, which
    already has the configured sampler's mask applied: the kept logits are divided by
    `temperature`, then only the nucleus of mass `top_p` of what is left is kept. The defaults
    (1.0, 1.0) leave the policy's distribution as trained.
    """
    from agents.samplers import MIN_TEMPERATURE

    if not temperature >= MIN_TEMPERATURE:
        raise ValueError(f"generate: temperature must be >= {MIN_TEMPERATURE:g} (use greedy=True for argmax), "
                         f"got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"generate: top_p must be in (0, 1], got {top_p}")
    import torch

    out = []
    with torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            rows = range(start, min(start + batch_size, len(prompts)))
            out.extend(_generate_rows(module, env_config, [prompts[i] for i in rows],
                                      [metas[i] if metas else {} for i in rows], greedy, seed + start, score,
                                      temperature, top_p, decoder))
    return out


def policy_device(module) -> torch.device:
    """Where the policy's weights are (a serve replica may hold it on a GPU); the CPU for a policy
    that shows none (a wrapper that places its own inputs)."""
    import torch

    parameters = getattr(module, "parameters", None)
    first = next(parameters(), None) if parameters is not None else None
    return first.device if first is not None else torch.device("cpu")


def draw_rows(logits: torch.Tensor, generators: list, temperature=1.0, top_p=1.0) -> list[int]:
    """One token per row of `logits` (float32, on any device), drawn from the row's softmax after
    `warp_logits` at one float64 uniform from the row's own CPU generator, by inverting the row's
    cumulative sum where the logits are (`samplers.sample_rows`): the uniforms go to the device and
    the tokens come back, where the draws used to copy every row's logits to the host. `temperature`
    and `top_p`: numbers, or (rows, 1) tensors on the logits' device. `torch.multinomial` row by
    row on the host took about 1 ms a row at 50,257 tokens on 2 cores (docs/results/generation.md)."""
    import torch

    from agents.samplers import sample_rows, warp_logits

    uniform = torch.cat([torch.rand(1, dtype=torch.float64, generator=g) for g in generators])
    probs = torch.softmax(warp_logits(logits, temperature, top_p), -1)
    return sample_rows(probs, uniform[:, None].to(logits.device)).tolist()


def _generate_rows(module, env_config, prompts, metas, greedy, seed, score, temperature=1.0,
                   top_p=1.0, decoder=True) -> list[dict]:
    import torch

    from env.text_env import TokenGenerationEnv

    envs = [TokenGenerationEnv(env_config) for _ in prompts]
    obs = []
    for i, (env, prompt) in enumerate(zip(envs, prompts)):
        options = None if prompt is None else {"prompt": prompt, "meta": metas[i], "score": score}
        obs.append(env.reset(seed=seed + i, options=options)[0])
    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(prompts))]
    scored = [score or prompt is None for prompt in prompts]
    if decoder and decodes_on_engine(module, greedy):
        return _decoded_rows(module, envs, obs, gens, scored, greedy, temperature, top_p)
    return _stepped_rows(module, envs, obs, gens, scored, greedy, temperature, top_p)


def decodes_on_engine(module, greedy: bool) -> bool:
    """Whether `generate` decodes with a `Decoder` (the decode engine in static blocks): a causal
    policy with its KV cache on, greedy, or sampling with a sampler that keeps no per-row state.
    Others (seq2seq, Q-networks, mirostat's sampled decodes) take one module call per token."""
    from agents.modules.acting import Acting
    from agents.modules.decode_engine import RingKVCache
    from agents.modules.decoding import Decoder

    return (isinstance(module, Acting) and isinstance(getattr(module, "kv_cache", None), RingKVCache)
            and (greedy or Decoder.samples(module)))


_DECODERS = weakref.WeakKeyDictionary()  # policy module -> its Decoder (one engine kept across calls)


def _decoded_rows(module, envs, obs, gens, scored, greedy, temperature, top_p) -> list[dict]:
    """`_stepped_rows`' results from one `Decoder` call (all rows' tokens computed on the policy's
    device, a host read per block of steps), then each row's tokens stepped through its env (the
    texts, rewards and EOS of training). Row i draws its k uniforms of a block from its own
    generator at once: the draws one call per token makes, the same tokens."""
    import numpy as np
    import torch

    from agents.modules.decoding import Decoder

    device = policy_device(module)
    ids, mask = (torch.as_tensor(np.stack([o[k] for o in obs])).to(device) for k in ("input_ids", "attention_mask"))
    draws = None if greedy else (lambda k: torch.stack([torch.rand(k, dtype=torch.float64, generator=g)
                                                        for g in gens], 1))
    decoder = _DECODERS.get(module)
    if decoder is None:
        decoder = _DECODERS[module] = Decoder()
        for name in ("capture", "use_engine", "static_restarts"):  # as the policy's own cache (never compiled)
            setattr(decoder.cache, name, getattr(module.kv_cache, name))
    training = module.training
    module.eval()  # as RLlib's forward_inference runs it
    try:
        tokens = decoder(module, ids, mask, envs[0].max_new_tokens, envs[0].eos_id, draws, temperature, top_p)
    finally:
        module.train(training)
    results = []
    for i, (env, row) in enumerate(zip(envs, tokens)):
        total = 0.0
        for token in row:
            _, reward, done, _, info = env.step(token)
            total += reward
            if done:
                break
        if not done:
            raise RuntimeError(f"generate: row {i}'s decode ended before its episode ({len(row)} tokens)")
        results.append(_result(env, info, total if scored[i] else None, token))
    return results


def _result(env, info: dict, reward, action: int) -> dict:
    return {"prompt": info["prompt"], "generation": info["generation"], "reward": reward,
            "prompt_tokens": len(env.prompt_ids), "num_generated": info["num_generated"],
            "eos": action == env.eos_id}


def _stepped_rows(module, envs, obs, gens, scored, greedy, temperature, top_p) -> list[dict]:
    """The rows' results, one module call per token: each step's observations from the envs."""
    import numpy as np
    import torch
    from ray.rllib.core.columns import Columns

    device = policy_device(module)
    done = [False] * len(envs)
    returns = [0.0] * len(envs)
    results = [None] * len(envs)
    # Every row stays in the batch until all are done, so row i is always env i: the module's
    # per-row KV cache and sampler state (mirostat) follow each episode. Finished rows repeat
    # their last observation and their actions are ignored. The draws run where the logits
    # are (`draw_rows`): only the running rows' tokens come back to the host.
    while not all(done):
        batch = {Columns.OBS: {k: torch.as_tensor(np.stack([o[k] for o in obs])).to(device) for k in obs[0]}}
        logits = module.forward_inference(batch)[Columns.ACTION_DIST_INPUTS].float()
        running = [i for i in range(len(envs)) if not done[i]]
        if greedy:
            actions = logits.argmax(-1).tolist()
        else:
            rows = logits if len(running) == len(envs) else logits[torch.tensor(running, device=logits.device)]
            actions = dict(zip(running, draw_rows(rows, [gens[i] for i in running], temperature, top_p)))
        for i in running:
            action = actions[i]
            obs[i], reward, done[i], _, info = envs[i].step(action)
            returns[i] += reward
            if done[i]:
                results[i] = _result(envs[i], info, returns[i] if scored[i] else None, action)
    return results


def check_seed(seed: int) -> str | None:
    """The --seed error line, None for a seed in [0, MAX_SEED]."""
    from agents.saved_policy import MAX_SEED

    return None if 0 <= seed <= MAX_SEED else f"--seed: expected an integer in [0, {MAX_SEED}], got {seed}"


def use_device(device: str) -> None:
    """Makes a CUDA `device` the current one (graph captures take the current device's stream)."""
    import torch

    where = torch.device(device)
    if where.type == "cuda" and where.index is not None:
        torch.cuda.set_device(where)


def check_device_name(device: str) -> str | None:
    """The --device error line for a string that names no CPU or CUDA device (cpu or cuda, then :N
    as torch writes an index), None otherwise: the standard library only, so that a command line
    refuses it before it imports torch."""
    if re.fullmatch(r"(cpu|cuda)(:(0|[1-9][0-9]*))?", device, re.ASCII) is None:
        return f"--device: expected cpu or cuda[:N], got {device!r}"
    return None


def check_device(device: str) -> str | None:
    """The --device error line, None for a device torch has here (torch is imported for any
    device but the plain cpu)."""
    bad = check_device_name(device)
    if bad or device == "cpu":
        return bad
    import torch

    try:
        where = torch.device(device)
    except RuntimeError:  # an index torch cannot hold
        return f"--device: expected cpu or cuda[:N], got {device!r}"
    if where.type == "cuda" and not torch.cuda.is_available():
        return f"--device {device}: torch sees no CUDA device here"
    if where.type == "cuda" and where.index is not None and where.index >= torch.cuda.device_count():
        return f"--device {device}: torch sees {torch.cuda.device_count()} CUDA device(s)"
    return None


def check_precision(precision: str, device: str) -> str | None:
    """The --precision error line, None for a precision the device has (torch is imported for bf16
    on a CUDA device only: the name alone, or a CPU's answer, needs the standard library alone)."""
    if precision not in PRECISIONS:
        return f"--precision: expected one of {', '.join(PRECISIONS)}, got {precision!r}"
    if precision != "bf16" or not str(device).startswith("cuda"):
        return None
    import torch

    from agents.models import gpu_has_bf16

    where = torch.device(device)
    if where.type == "cuda" and not gpu_has_bf16(where):  # emulated bf16 counts as none
        return f"--precision bf16: {torch.cuda.get_device_name(where)} has no bf16; use fp32"
    return None


def decode_in(module, precision: str):
    """`module` (a loaded policy) with its weights in `precision` for decoding: bf16 halves the
    weights' and the KV cache's memory and, on a GPU, shortens each decode step; its texts can
    differ from fp32's where two tokens' logits are within bf16's rounding."""
    if precision == "bf16":
        import torch

        module.to(torch.bfloat16)
        module.weights_changed()  # cached keys and values were fp32
    return module


def check_prompts(tokenizer, prompts: list[str]) -> str | None:
    """The first problem with the prompts given with --prompt as one line, or None: a word the
    task's tokenizer can only encode as its unknown token (a word-level task's unknown token is
    EOS, so the prompt would silently end there), or a prompt with no tokens."""
    from env.tokenization import unknown_words

    for i, text in enumerate(prompts):
        where = f"--prompt {text!r}" if len(prompts) == 1 else f"--prompt #{i + 1} ({text!r})"
        unknown = unknown_words(tokenizer, text)
        if unknown:
            return f"{where}: {unknown[0]!r} is not in the task's vocabulary"
        if not tokenizer(text, add_special_tokens=False)["input_ids"]:
            return f"{where}: empty after tokenization"
    return None


def main(argv=None, prog: str = "python -m agents.generate") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory from agents.train")
    parser.add_argument("--prompt", action="append", help="prompt text (repeatable); default: the task's prompts")
    parser.add_argument("-n", type=int, default=3, help="generations per prompt (default 3)")
    parser.add_argument("--greedy", action="store_true", help="argmax decoding instead of sampling")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where the policy decodes: cpu (default) or cuda[:N] "
                        "(its steps then replay as CUDA graphs)")
    parser.add_argument("--precision", default="fp32", help="the policy's weights while it decodes: fp32 (default) "
                        "or bf16 (less memory, faster steps on a GPU; texts can differ from fp32's)")
    args = parser.parse_args(argv)
    if not 1 <= args.n <= MAX_N:
        parser.error(f"-n: expected an integer in [1, {MAX_N}] (for larger samples: python -m agents.evaluate "
                     f"--num-samples), got {args.n}")
    # The flags and the checkpoint's path first, with the standard library alone (a wrong one is
    # refused at once), then what needs torch: the device's presence, its bf16.
    try:
        bad = check_device_name(args.device) or check_precision(args.precision, "cpu") or check_seed(args.seed)
        if not bad:
            find_module_dir(args.checkpoint)
            bad = check_device(args.device) or check_precision(args.precision, args.device)
    except FileNotFoundError as e:
        bad = str(e)
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from agents.core import no_transformers_bars

    no_transformers_bars()
    try:
        use_device(args.device)
        module = decode_in(load_policy(args.checkpoint).to(args.device), args.precision)
    except (FileNotFoundError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    bad = check_prompts(module.tokenizer, args.prompt or [])
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    prompts = [p for p in (args.prompt or [None]) for _ in range(args.n)]
    env_config = module.model_config["env"]
    try:
        from env.tasks import make_task

        score = not (args.prompt and reward_needs_meta(make_task(env_config["task"],
                                                                 max_new_tokens=env_config["max_new_tokens"])))
        if not score:
            print(f"note: task {env_config['task'].get('name')!r} scores a text against references; "
                  f"prompts given with --prompt have none, so no reward is shown", file=sys.stderr)
        results = generate(module, env_config, prompts, greedy=args.greedy, seed=args.seed, score=score)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in results:
        reward = "n/a" if r["reward"] is None else f"{r['reward']:.3f}"
        print(f"[reward {reward}] {r['prompt']!s}|| {r['generation']}")
    return 0


if __name__ == "__main__":
    from agents import exit_with

    exit_with(main())
