"""A task of your own: write the prompt's words in reverse order.

A task is any class with `examples(split)`, `reward(prompts, generations, metas)` and
`tokenizer()`. Name it in the config by its import path, `module:Class`; the other keys of
the `task` section are its constructor's arguments (and a `max_new_tokens` parameter, if it
has one, gets the env's when the section does not set it).
"""
import random

from env.tokenization import word_level_tokenizer


class Reverse:
    name = "reverse"

    def __init__(self, length: int = 3, vocabulary: int = 6, seed: int = 0):
        if length < 2:
            raise ValueError("task.length: expected an integer >= 2")
        self.length, self.words = length, [f"w{i}" for i in range(vocabulary)]
        rng = random.Random(seed)
        self.prompts = [" ".join(rng.choice(self.words) for _ in range(length)) for _ in range(500)]

    def tokenizer(self):
        return word_level_tokenizer([*self.words, "="])  # None would use the model's tokenizer

    def examples(self, split: str = "train") -> list[dict]:
        # {"prompt": str, "meta": dict}; the meta reaches the reward.
        part = {"train": self.prompts[:400], "validation": self.prompts[400:450], "test": self.prompts[450:]}[split]
        return [{"prompt": p + " =", "meta": {"target": p.split()[::-1]}} for p in part]

    def reward(self, prompts, generations, metas) -> list[float]:
        # Batched: the fraction of positions that hold the right word.
        return [sum(a == b for a, b in zip(text.split(), meta["target"])) / self.length
                for text, meta in zip(generations, metas)]
