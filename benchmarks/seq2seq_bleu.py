"""BLEU of encoder-decoder policies on a task's test split: warm-start directories and PPO checkpoints.

    python benchmarks/seq2seq_bleu.py --config tune_configs/seq2seq_sort_numbers.yaml \
        results/seq2seq_sort_numbers/warm_start results/seq2seq_sort_numbers/<trial>/checkpoint_000NNN

Each model generates once per test source through the token env (greedy, then sampled with a
fixed seed); the task's reward (sentence BLEU for sort_numbers) is averaged. Prints one line per
model and decoding.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402


def load(path: str, env_cfg: dict, seed: int):
    """A PPO checkpoint's policy, or an encoder-decoder model directory wrapped as one."""
    from agents.generate import load_policy
    from agents.saved_policy import find_module_dir
    from agents.modules.seq2seq import Seq2SeqActorCritic

    try:
        find_module_dir(path)
        return load_policy(path)
    except FileNotFoundError:
        return Seq2SeqActorCritic(model_config={"model": {"name_or_path": os.path.abspath(path)}, "env": env_cfg,
                                                "seed": seed}, inference_only=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--config", required=True)
    parser.add_argument("--max-examples", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from agents.config import env_config, load as load_config
    from agents.evaluate import rollout
    from env.tasks import make_task

    cfg = load_config(args.config)
    env_cfg = {**env_config(cfg), "split": "test"}
    task = make_task(env_cfg["task"], max_new_tokens=env_cfg["max_new_tokens"])
    examples = task.examples("test")[:args.max_examples]
    for path in args.models:
        policy = load(path, env_cfg, cfg["seed"])
        for greedy in (True, False):
            start = time.perf_counter()
            gens = rollout(policy, env_cfg, examples, greedy=greedy, seed=0)
            bleu = np.mean(task.reward([e["prompt"] for e in examples], gens, [e["meta"] for e in examples]))
            print(f"{path}: {'greedy ' if greedy else 'sampled'} BLEU {bleu:.3f} over {len(examples)} test "
                  f"sources ({time.perf_counter() - start:.1f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
