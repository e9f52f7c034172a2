"""A reward of your own: does the generation use the prompt's keyword?

A reward is one batched function, `reward(prompts, generations, metas) -> list[float]`:
`prompts` and `generations` are the texts, `metas` the extra fields of each data row
(here the `keyword` column of prompts.jsonl, which the task copies with `meta_fields`).
Configs name it by its import path:

    task:
      reward: {name: "examples.custom_reward.keyword_reward:keyword_reward"}

Keyword-only parameters (`bonus` below) become config fields: `{name: ..., bonus: 2.0}`.
"""


def keyword_reward(prompts, generations, metas, *, bonus: float = 1.0):
    """`bonus` when the generation's words include the row's keyword, else 0."""
    return [bonus if meta["keyword"] in text.split() else 0.0 for text, meta in zip(generations, metas)]
