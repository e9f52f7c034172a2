"""Rewards on sequences of numbers."""
from __future__ import annotations


def _numbers(text: str) -> list[int]:
    out = []
    for word in text.split():
        try:
            out.append(int(word))
        except ValueError:
            continue  # not a number token: it breaks no pair and makes none
    return out


def increasing_pairs_reward(
    prompts: list[str],
    generations: list[str],
    metas: list[dict] | None = None,
    *,
    length: int = 20,
) -> list[float]:
    """Fraction of the `length - 1` adjacent pairs that are in strictly ascending order.

    The denominator is fixed by the full generation length, so stopping early
    (EOS) cannot raise the score: "3 7 <eos>" scores 1/19 at length 20, not 1.0.
    """
    pairs = max(length - 1, 1)
    scores = []
    for text in generations:
        nums = _numbers(text)
        ascending = sum(1 for a, b in zip(nums, nums[1:]) if b > a)
        scores.append(min(ascending, pairs) / pairs)
    return scores


def contains_pattern_reward(
    prompts: list[str],
    generations: list[str],
    metas: list[dict] | None = None,
    *,
    pattern: tuple[int, ...] = (),
) -> list[float]:
    """1.0 when the generation's numbers contain `pattern` as a contiguous run, else 0.0
    (non-number tokens are skipped, as in `increasing_pairs_reward`)."""
    k = len(pattern)
    target = list(pattern)
    scores = []
    for text in generations:
        nums = _numbers(text)
        hit = k > 0 and any(nums[i:i + k] == target for i in range(len(nums) - k + 1))
        scores.append(1.0 if hit else 0.0)
    return scores
