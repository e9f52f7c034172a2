"""Reward functions: `reward(prompts, generations, metas) -> list[float]`, batched and pure."""
from env.rewards.ordering import increasing_pairs_reward

__all__ = ["increasing_pairs_reward"]
