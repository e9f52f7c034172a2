"""Reward functions: `reward(prompts, generations, metas) -> list[float]`, batched and pure.

Rewards that compare with references read `meta["references"]` (a list of
strings) or `meta["reference"]`; MMI reads `meta["source"]` (default: the prompt).
Build one from a config mapping with `make_reward` (see env/rewards/base.py):

    reward: {name: bleu}
    reward: {sum: [{name: bleu, weight: 0.5}, {name: vader, weight: 0.5}]}
    reward: {name: "my_rewards:keyword_reward"}     your own function, `module:function`

Registered names and their modules (defaults in each class's docstring):

    bleu, chrf, ter                 bleu.py        sacrebleu, 0-1 scale (ter: -TER)
    rouge, rouge1, rouge2, rougeL   rouge.py       rouge-score F-measure, 0-1
    sentiment, vader                sentiment.py   classifier P(positive) / VADER, 0-1
    perplexity                      perplexity.py  -log PPL under a causal LM
    mmi                             mmi.py         log p(T|S) + lambda log p(S|T)
    cosine                          cosine.py      sentence-embedding cosine
    cider_d                         cider.py       CIDEr-D, pure Python
    bertscore                       bertscore.py   BERTScore F1
    increasing_pairs                ordering.py    the synthetic task's reward

Importing this package imports no model library; each reward imports its own on first use.
"""
from env.rewards.base import (REWARDS, CheckedReward, FieldError, RewardConfigError, RewardError, WeightedSum,
                              loads_models, make_reward, references_of, register, register_function)
from env.rewards.ordering import increasing_pairs_reward
from env.rewards import bertscore, bleu, cider, cosine, mmi, perplexity, rouge, sentiment  # noqa: F401 (register)

register_function("increasing_pairs", increasing_pairs_reward)

__all__ = [
    "REWARDS", "CheckedReward", "FieldError", "RewardConfigError", "RewardError", "WeightedSum",
    "increasing_pairs_reward", "loads_models", "make_reward", "references_of", "register", "register_function",
]
