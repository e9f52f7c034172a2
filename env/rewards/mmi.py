"""Maximum mutual information (Li et al. 2016, MMI-bidi): log p(T|S) + lambda * log p(S|T).

T is the generation, S the source: `meta["source"]` when the example has one,
else the prompt. `forward_model` scores T after S, `backward_model` scores S
after T (each a causal LM: local dir or hub name, with its own tokenizer unless
`forward_tokenizer` / `backward_tokenizer` say otherwise). `separator` (text,
default none) is tokenized and put between the context and the scored text.
With `length_normalize: true` each term is the mean log-prob per token instead
of the sum. Defaults: lambda 0.5, length_normalize false.

An empty generation gets `empty_reward` when set, else it is an error naming the
text (its log p(T|S) would be the best possible, 0).
"""
from __future__ import annotations

from env.rewards.base import check_field, register, resolve_device
from env.rewards.hf import causal_lm, encode, target_logprobs


@register("mmi")
class MMI:
    """log p(T|S) + lambda * log p(S|T) under a forward and a backward causal LM."""

    name = "mmi"
    higher_is_better = True
    FIELD_ALIASES = {"lambda": "lambda_"}

    def __init__(self, forward_model: str, backward_model: str, lambda_: float = 0.5,
                 length_normalize: bool = False, forward_tokenizer: str | None = None,
                 backward_tokenizer: str | None = None, separator: str | None = None,
                 empty_reward: float | None = None, batch_size: int = 16, device: str = "auto"):
        check_field("lambda_", lambda_, float, lo=0)
        check_field("batch_size", batch_size, int, lo=1)
        self.forward = (forward_model, forward_tokenizer)
        self.backward = (backward_model, backward_tokenizer)
        self.lambda_, self.length_normalize = lambda_, length_normalize
        self.separator, self.empty_reward = separator, empty_reward
        self.batch_size, self.device = batch_size, device

    def load(self):
        device = resolve_device(self.device)
        return causal_lm(self.forward[0], device, self.forward[1]), causal_lm(self.backward[0], device, self.backward[1])

    def _term(self, model, tok, contexts, targets) -> list[float]:
        sep = encode(tok, self.separator) if self.separator else []
        scored = target_logprobs(model, tok, [c + sep for c in contexts], targets, self.batch_size)
        if self.length_normalize:
            return [sum(lp) / len(lp) if lp else 0.0 for lp in scored]
        return [sum(lp) for lp in scored]

    def __call__(self, prompts, generations, metas):
        (fwd, ftok), (bwd, btok) = self.load()
        sources = [(m or {}).get("source", p) for p, m in zip(prompts, metas)]
        gen_f = [encode(ftok, g) for g in generations]
        for text, ids in zip(generations, gen_f):
            if not ids and self.empty_reward is None:
                raise ValueError(f"generation {text!r} has no tokens to score; set empty_reward to give it a value")
        forward = self._term(fwd, ftok, [encode(ftok, s) for s in sources], gen_f)
        backward = self._term(bwd, btok, [encode(btok, g) for g in generations], [encode(btok, s) for s in sources])
        return [self.empty_reward if not ids else f + self.lambda_ * b
                for ids, f, b in zip(gen_f, forward, backward)]
