"""A synthetic source -> target task for encoder-decoder policies: sort (or reverse) numbers.

The source is `length` distinct numbers drawn from `0..num_numbers-1`; the
target is the same numbers in ascending order (`mode: sort`) or in reverse
order (`mode: reverse`). The reward is sentence BLEU (0-1) against the target.
Examples are drawn from a seeded generator, so every process sees the same
splits; the splits are disjoint.

`python -m env.tasks.sort_numbers DIR` writes the splits as JSONL (`source`,
`target`) and the task's tokenizer to DIR, the inputs `agents.pretrain` needs
for a supervised warm start on this task.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

from env.rewards.bleu import SentenceBLEU
from env.tokenization import word_level_tokenizer

SPLITS = ("train", "validation", "test")


class SortNumbersTask:
    name = "sort_numbers"
    metrics = ("bleu",)

    def __init__(self, num_numbers: int = 20, length: int = 5, mode: str = "sort", num_train: int = 2000,
                 num_eval: int = 200, seed: int = 0):
        if mode not in ("sort", "reverse"):
            raise ValueError(f"task.mode: expected 'sort' or 'reverse', got {mode!r}")
        if not 2 <= length <= num_numbers:
            raise ValueError(f"task.length: expected 2 <= length <= num_numbers={num_numbers}, got {length}")
        if num_train < 1 or num_eval < 1:
            raise ValueError("task.num_train and task.num_eval must be >= 1")
        self.num_numbers, self.length, self.mode = num_numbers, length, mode
        self.sizes = {"train": num_train, "validation": num_eval, "test": num_eval}
        self.seed = seed
        self._bleu = SentenceBLEU()
        self._examples = None

    def tokenizer(self):
        return word_level_tokenizer([str(i) for i in range(self.num_numbers)])

    def target(self, numbers: list[int]) -> list[int]:
        return sorted(numbers) if self.mode == "sort" else numbers[::-1]

    def _all_examples(self) -> dict:
        """Every split at once, from one seeded stream, with no source in two splits."""
        if self._examples is None:
            rng = np.random.default_rng(self.seed)
            seen, out = set(), {s: [] for s in SPLITS}
            for split in SPLITS:
                tries = 0
                while len(out[split]) < self.sizes[split]:
                    numbers = [int(x) for x in rng.choice(self.num_numbers, self.length, replace=False)]
                    tries += 1
                    if tuple(numbers) in seen and tries < 100 * self.sizes[split]:
                        continue
                    seen.add(tuple(numbers))
                    target = " ".join(map(str, self.target(numbers)))
                    out[split].append({"prompt": " ".join(map(str, numbers)),
                                       "meta": {"references": [target], "split": split}})
            self._examples = out
        return self._examples

    def examples(self, split: str = "train") -> list[dict]:
        if split not in SPLITS:
            raise ValueError(f"split: expected one of {', '.join(SPLITS)}, got {split!r}")
        return self._all_examples()[split]

    def targets(self, example: dict) -> list[str]:
        return list(example["meta"]["references"])

    def reward(self, prompts, generations, metas) -> list[float]:
        return self._bleu(prompts, generations, metas)


def write_dataset(out_dir: str, **task_options) -> dict:
    """Writes `{split}.jsonl` (source, target) and the tokenizer to `out_dir`; returns the file paths."""
    task = SortNumbersTask(**task_options)
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for split in SPLITS:
        paths[split] = os.path.join(out_dir, f"{split}.jsonl")
        with open(paths[split], "w", encoding="utf-8") as f:
            for ex in task.examples(split):
                f.write(json.dumps({"source": ex["prompt"], "target": ex["meta"]["references"][0]}) + "\n")
    task.tokenizer().save_pretrained(os.path.join(out_dir, "tokenizer"))
    return paths


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m env.tasks.sort_numbers OUT_DIR")
    for split, path in write_dataset(sys.argv[1]).items():
        print(f"{split}: {path}")
