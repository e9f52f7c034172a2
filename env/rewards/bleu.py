"""Sentence BLEU, chrF and TER through sacrebleu, against `meta["references"]`.

Scale: every score is on 0-1 (sacrebleu's 0-100 score divided by 100) so it
weighs like the other rewards in a sum; `percent: true` gives sacrebleu's own
0-100. TER is an error rate (lower is better), so the `ter` reward is -TER by
default (`negate: false` gives TER itself, e.g. as an evaluation metric).
`corpus_score(...)` gives the corpus-level statistic on the same scale, which is
what papers report as "BLEU" (not the mean of sentence scores).
"""
from __future__ import annotations

from env.rewards.base import FieldError, check_choice, check_field, references_of, register

BLEU_TOKENIZERS = ("none", "13a", "intl", "char", "zh", "ja-mecab", "ko-mecab", "spm", "flores101", "flores200")
BLEU_SMOOTHING = ("exp", "floor", "add-k", "none")


class _Sacrebleu:
    higher_is_better = True

    loads_model = False  # `load` builds sacrebleu's metric object: scoring loads no model

    def __init__(self, percent: bool):
        self.scale = 1.0 if percent else 0.01
        self.sign = 1.0
        self._metric = None

    def _make(self):
        raise NotImplementedError

    def load(self):
        if self._metric is None:
            self._metric = self._make()
        return self._metric

    def __call__(self, prompts, generations, metas):
        metric = self.load()
        return [self.sign * self.scale * metric.sentence_score(g, references_of(m)).score
                for g, m in zip(generations, metas)]

    def corpus_score(self, prompts, generations, metas) -> float:
        """The corpus statistic over all pairs (references padded with None where counts differ)."""
        refs = [references_of(m) for m in metas]
        width = max(len(r) for r in refs)
        streams = [[r[k] if k < len(r) else None for r in refs] for k in range(width)]
        return self.sign * self.scale * self.load().corpus_score(list(generations), streams).score


@register("bleu")
class SentenceBLEU(_Sacrebleu):
    """Sentence BLEU (sacrebleu `sentence_bleu`), 0-1 by default.

    Defaults are sacrebleu's for sentence BLEU: tokenize '13a', smooth_method
    'exp' (smooth_value None: the method's default; 0.1 for 'floor', 1 for
    'add-k'), effective n-gram order, case-sensitive, max n-gram order 4.
    """

    name = "bleu"

    def __init__(self, tokenize: str = "13a", smooth_method: str = "exp", smooth_value: float | None = None,
                 lowercase: bool = False, use_effective_order: bool = True, percent: bool = False):
        super().__init__(percent)
        check_choice("tokenize", tokenize, BLEU_TOKENIZERS)
        check_choice("smooth_method", smooth_method, BLEU_SMOOTHING)
        if smooth_value is not None and smooth_method not in ("floor", "add-k"):
            raise FieldError("smooth_value", f"only the 'floor' and 'add-k' methods take a value "
                                             f"(smooth_method is {smooth_method!r})")
        self.kwargs = dict(tokenize=tokenize, smooth_method=smooth_method, smooth_value=smooth_value,
                           lowercase=lowercase, effective_order=use_effective_order)

    def _make(self):
        from sacrebleu.metrics import BLEU
        return BLEU(**self.kwargs)


@register("chrf")
class SentenceChrF(_Sacrebleu):
    """Sentence chrF (sacrebleu `sentence_chrf`), 0-1 by default; `word_order: 2` is chrF++.

    Defaults are sacrebleu's: char_order 6, word_order 0, beta 2, whitespace
    removed before character n-grams, no epsilon smoothing, case-sensitive.
    """

    name = "chrf"

    def __init__(self, char_order: int = 6, word_order: int = 0, beta: int = 2, remove_whitespace: bool = True,
                 eps_smoothing: bool = False, lowercase: bool = False, percent: bool = False):
        super().__init__(percent)
        check_field("char_order", char_order, int, lo=1)
        check_field("beta", beta, int, lo=1)
        check_field("word_order", word_order, int, lo=0)
        self.kwargs = dict(char_order=char_order, word_order=word_order, beta=beta,
                           whitespace=not remove_whitespace, eps_smoothing=eps_smoothing, lowercase=lowercase)

    def _make(self):
        from sacrebleu.metrics import CHRF
        return CHRF(**self.kwargs)


@register("ter")
class SentenceTER(_Sacrebleu):
    """Sentence TER (sacrebleu `sentence_ter`): -TER/100 by default (higher is better).

    `negate: false` returns TER itself (lower is better); TER can exceed 1
    (100 with `percent`) when the hypothesis is longer than the reference.
    Defaults are sacrebleu's: case-insensitive, no normalisation, punctuation
    kept, no Asian-script support.
    """

    name = "ter"

    def __init__(self, normalized: bool = False, no_punct: bool = False, asian_support: bool = False,
                 case_sensitive: bool = False, negate: bool = True, percent: bool = False):
        super().__init__(percent)
        self.sign = -1.0 if negate else 1.0
        self.higher_is_better = negate
        self.kwargs = dict(normalized=normalized, no_punct=no_punct, asian_support=asian_support,
                           case_sensitive=case_sensitive)

    def _make(self):
        from sacrebleu.metrics import TER
        return TER(**self.kwargs)
