"""The synthetic task of the CS224N report: generate increasing numbers.

Every prompt is `prompt_len` pad tokens; the policy writes `max_new_tokens`
number tokens; the reward is the fraction of adjacent pairs in strictly
ascending order. A uniformly random policy scores about 0.39 (EOS and pad are actions
too, and an early EOS forfeits the missing pairs).
"""
from __future__ import annotations

from functools import partial

from env.rewards.ordering import increasing_pairs_reward
from env.tokenization import PAD_TOKEN, word_level_tokenizer


class NumberWritingTask:
    """Pad-token prompts, number tokens "0".."num_numbers-1" to write; subclasses set `reward`."""

    def __init__(self, num_numbers: int = 50, prompt_len: int = 5):
        if num_numbers < 2:
            raise ValueError("task.num_numbers must be >= 2")
        if prompt_len < 1:
            raise ValueError("task.prompt_len must be >= 1")
        self.num_numbers = num_numbers
        self.prompt_len = prompt_len

    def tokenizer(self):
        return word_level_tokenizer([str(i) for i in range(self.num_numbers)])

    def examples(self, split: str = "train") -> list[dict]:
        # One prompt for every split: the task is about what the policy writes.
        return [{"prompt": " ".join([PAD_TOKEN] * self.prompt_len), "meta": {}}]


class IncreasingNumbersTask(NumberWritingTask):
    name = "increasing_numbers"
    metrics = ("increasing_pairs",)

    def __init__(self, num_numbers: int = 50, prompt_len: int = 5, max_new_tokens: int = 20):
        super().__init__(num_numbers, prompt_len)
        self.reward = partial(increasing_pairs_reward, length=max_new_tokens)
