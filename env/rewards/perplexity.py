"""Fluency under a reference causal LM: the log-probability of the generation's tokens.

The generation is tokenized on its own (no special tokens) and scored after the
prompt's tokens (`conditional: true`, the default: the generation continues the
prompt) or after the start token alone (`conditional: false`). With
N generated tokens and mean log-prob m = (1/N) sum_t log p(y_t | ...):

    form          reward
    neg_log_ppl   m = -log PPL          (default; 0 is best, unbounded below)
    inv_ppl       exp(m) = 1 / PPL      (in (0, 1])
    neg_ppl       -exp(-m) = -PPL
    sum_logprob   N * m = log p(generation)

An empty generation has no tokens to score: it gets `empty_reward` when that is
set, and is otherwise an error naming the text (a silent 0 would be the best
possible score and teach the policy to stop at once).
"""
from __future__ import annotations

import math

from env.rewards.base import check_choice, check_field, register, resolve_device
from env.rewards.hf import causal_lm, encode, target_logprobs

FORMS = ("neg_log_ppl", "inv_ppl", "neg_ppl", "sum_logprob")


def reward_form(logprobs: list[float], form: str) -> float:
    total = sum(logprobs)
    if form == "sum_logprob":
        return total
    mean = total / len(logprobs)
    return {"neg_log_ppl": mean, "inv_ppl": math.exp(mean), "neg_ppl": -math.exp(-mean)}[form]


@register("perplexity")
class Perplexity:
    """Reward from the perplexity of the generation under `model` (default form: -log PPL).

    Fields: model (local dir, hub name, or 'tiny-gpt2' with `tokenizer`),
    tokenizer (default: the model's own), conditional (true), form
    ('neg_log_ppl'), empty_reward (null: an empty generation is an error),
    batch_size (16), device ('auto': the GPU of the process when it has one, else the CPU; or 'cpu', 'cuda:N'), seed (0;
    tiny-gpt2's weights only).
    """

    name = "perplexity"
    higher_is_better = True

    def __init__(self, model: str, tokenizer: str | None = None, conditional: bool = True,
                 form: str = "neg_log_ppl", empty_reward: float | None = None, batch_size: int = 16,
                 device: str = "auto", seed: int = 0):
        check_choice("form", form, FORMS)
        check_field("batch_size", batch_size, int, lo=1)
        self.model_name, self.tokenizer_name, self.seed = model, tokenizer, seed
        self.conditional, self.form, self.empty_reward = conditional, form, empty_reward
        self.batch_size, self.device = batch_size, device

    def load(self):
        return causal_lm(self.model_name, resolve_device(self.device), self.tokenizer_name, self.seed)

    def __call__(self, prompts, generations, metas):
        model, tok = self.load()
        targets = [encode(tok, g) for g in generations]
        for text, ids in zip(generations, targets):
            if not ids and self.empty_reward is None:
                raise ValueError(f"generation {text!r} has no tokens to score; set empty_reward to give it a value")
        contexts = [encode(tok, p) if self.conditional else [] for p in prompts]
        scored = target_logprobs(model, tok, contexts, targets, self.batch_size)
        return [reward_form(lp, self.form) if lp else self.empty_reward for lp in scored]
