"""Batched rewards: env steps/s with a text-classifier reward, one call per row vs one per vector step.

    python benchmarks/batched_rewards.py [--envs 64] [--new 20] [--episodes 4] [--hidden 128] [--layers 2]

Both sides are the same `text` task with the `sentiment` reward on a classifier saved here (a
randomly initialised BERT of --layers x --hidden; no download), the same actions and the same
episodes:
  per row:  a gymnasium SyncVectorEnv of --envs TokenGenerationEnv rows (RLlib's stock EnvRunner
            path): every row that needs scoring calls the reward alone;
  batched:  TokenGenerationVectorEnv (the fast EnvRunner's env): one reward call per step over
            all rows that need scoring.
With sparse rewards only finished rows are scored; with `env.dense_reward` every live row is,
at every step. Prints env steps/s of each and the ratio; the rewards of both are checked equal.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build(folder: str, hidden: int, layers: int) -> dict:
    """A prompt file, a word-level tokenizer for the policy and a BERT classifier over the same words."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    from env.tokenization import word_level_tokenizer

    words = [f"w{i}" for i in range(200)]
    with open(os.path.join(folder, "prompts.jsonl"), "w") as f:
        for i in range(256):
            f.write(json.dumps({"prompt": " ".join(words[(i + k) % 200] for k in range(6))}) + "\n")
    word_level_tokenizer(words).save_pretrained(os.path.join(folder, "tokenizer"))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    torch.manual_seed(0)
    clf = BertForSequenceClassification(BertConfig(
        vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
        intermediate_size=4 * hidden, max_position_embeddings=128, num_labels=2,
        id2label={0: "NEGATIVE", 1: "POSITIVE"}, label2id={"NEGATIVE": 0, "POSITIVE": 1}))
    clf.save_pretrained(os.path.join(folder, "classifier"))
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}, model_max_length=128).save_pretrained(
        os.path.join(folder, "classifier"))
    return {"dataset": os.path.join(folder, "prompts.jsonl"), "tokenizer": os.path.join(folder, "tokenizer"),
            "classifier": os.path.join(folder, "classifier")}


def measure(make_env, cfg: dict, n: int, episodes: int, seed: int = 0):
    """(env steps/s, rewards): `episodes` rounds of n rows, each row writing cfg's max_new_tokens
    tokens (no EOS, so every round is the same work on both sides)."""
    env = make_env()
    vocab = env.single_action_space.n
    rng = np.random.default_rng(seed)
    env.reset(seed=seed)
    for _ in range(cfg["max_new_tokens"]):  # one whole episode, not timed: loads the classifier
        env.step(np.full(n, 2))
    env.reset(seed=seed)
    rewards, steps = [], 0
    start = time.perf_counter()
    for _ in range(episodes):
        for _ in range(cfg["max_new_tokens"]):
            actions = rng.integers(2, vocab, size=n)  # never pad (0) or EOS (1)
            _, reward, terminated, _, _ = env.step(actions)
            rewards.append(reward.copy())
            steps += n
        env.step(np.full(n, 2))  # the autoreset step (NEXT_STEP): not an env step of any episode
    return steps / (time.perf_counter() - start), np.concatenate(rewards)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--envs", type=int, default=64)
    p.add_argument("--new", type=int, default=20, help="tokens per episode")
    p.add_argument("--episodes", type=int, default=4, help="episodes per row, per measurement")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--reps", type=int, default=3, help="repetitions, alternating the two sides")
    args = p.parse_args(argv)

    import torch
    from gymnasium.vector import SyncVectorEnv

    from env.text_env import TokenGenerationEnv
    from env.vector_env import TokenGenerationVectorEnv

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    with tempfile.TemporaryDirectory() as folder:
        paths = build(folder, args.hidden, args.layers)
        print(f"{args.envs} rows, {args.new} tokens per episode, classifier BERT {args.layers}x{args.hidden}, "
              f"{os.cpu_count()} CPU threads, torch {torch.__version__}")
        print(f"{'reward':>8}  {'per row (steps/s)':>18}  {'batched (steps/s)':>18}  {'batched / per row':>18}")
        for dense in (False, True):
            cfg = {"task": {"name": "text", "dataset": paths["dataset"],
                            "reward": {"name": "sentiment", "model": paths["classifier"], "batch_size": 64}},
                   "tokenizer": paths["tokenizer"], "max_prompt_len": 8, "max_new_tokens": args.new,
                   "dense_reward": dense, "split": "train", "truncation_side": "left", "encoder_decoder": False}
            per_row = lambda: SyncVectorEnv([lambda: TokenGenerationEnv(cfg) for _ in range(args.envs)])  # noqa: E731
            batched = lambda: TokenGenerationVectorEnv(cfg, args.envs)  # noqa: E731
            rates = {"per row": [], "batched": []}
            for _ in range(args.reps):
                for name, make in (("per row", per_row), ("batched", batched)):
                    rate, rewards = measure(make, cfg, args.envs, args.episodes)
                    rates[name].append(rate)
                    if name == "per row":
                        reference = rewards
                    else:
                        np.testing.assert_allclose(rewards, reference, rtol=1e-5, atol=1e-6)
            a, b = np.median(rates["per row"]), np.median(rates["batched"])
            print(f"{'dense' if dense else 'sparse':>8}  {a:>18,.0f}  {b:>18,.0f}  {b / a:>17.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
