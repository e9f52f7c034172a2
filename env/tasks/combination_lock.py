"""A hard-exploration synthetic task: open a combination lock.

Every prompt is `prompt_len` pad tokens; the policy writes `max_new_tokens` number tokens
("0".."num_numbers-1"); the reward is 1 when the numbers contain `pattern` (by default three
numbers) as a contiguous run, else 0. With per-token reward (`env.dense_reward`) the 1 is
paid at the token that completes the pattern. A uniformly random policy opens the default
lock in about (20 - 3 + 1) / 50**3 = 1.4e-4 of its episodes, so random exploration almost
never sees a reward; a guide that knows the pattern (`agents.guides:combination_lock`) shows
the way: the situation RL with guided feedback (PPO++, AggreVaTeD, LOLS, DLOLS) was made for.
"""
from __future__ import annotations

from functools import partial

from env.rewards.ordering import contains_pattern_reward
from env.tasks.increasing_numbers import NumberWritingTask

DEFAULT_PATTERN = "7 31 18"


def parse_pattern(pattern, num_numbers: int, max_new_tokens: int | None = None) -> tuple[int, ...]:
    """The pattern as numbers, or ValueError naming `task.pattern`."""
    words = str(pattern).split() if pattern is not None else []
    if not words:
        raise ValueError("task.pattern: give the numbers to write, e.g. '7 31 18'")
    try:
        numbers = tuple(int(w) for w in words)
    except ValueError:
        raise ValueError(f"task.pattern: {pattern!r} is not space-separated numbers") from None
    bad = [n for n in numbers if not 0 <= n < num_numbers]
    if bad:
        raise ValueError(f"task.pattern: {bad[0]} is not among the task's numbers 0..{num_numbers - 1}")
    if max_new_tokens is not None and len(numbers) > max_new_tokens:
        raise ValueError(f"task.pattern: {len(numbers)} numbers do not fit in env.max_new_tokens={max_new_tokens}")
    return numbers


class CombinationLockTask(NumberWritingTask):
    name = "combination_lock"
    metrics = ("unlocked",)

    def __init__(self, num_numbers: int = 50, prompt_len: int = 5, pattern: str | int = DEFAULT_PATTERN,
                 max_new_tokens: int = 20):
        super().__init__(num_numbers, prompt_len)
        self.pattern = parse_pattern(pattern, num_numbers, max_new_tokens)
        self.reward = partial(contains_pattern_reward, pattern=self.pattern)
