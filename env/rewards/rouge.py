"""ROUGE-1/2/L through Google's `rouge-score` package, against `meta["references"]`.

The score is on 0-1. With several references the best one counts (by the chosen
measure; `rouge_scorer.score_multi` picks by F-measure, so this is the same
whenever `measure` is fmeasure). rouge-score's tokenizer lowercases and keeps
only [a-z0-9] tokens; `use_stemmer` applies the Porter stemmer (default off, as
in rouge-score).
"""
from __future__ import annotations

from env.rewards.base import check_choice, references_of, register

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")
MEASURES = ("fmeasure", "precision", "recall")


@register("rouge")
class Rouge:
    """ROUGE `rouge_type` (default rougeL) `measure` (default fmeasure), 0-1, stemming off by default."""

    name = "rouge"
    higher_is_better = True
    loads_model = False  # `load` builds rouge_score's scorer

    def __init__(self, rouge_type: str = "rougeL", use_stemmer: bool = False, measure: str = "fmeasure",
                 split_summaries: bool = False):
        check_choice("rouge_type", rouge_type, ROUGE_TYPES)
        check_choice("measure", measure, MEASURES)
        self.rouge_type, self.use_stemmer, self.measure = rouge_type, use_stemmer, measure
        self.split_summaries = split_summaries
        self._scorer = None

    def load(self):
        if self._scorer is None:
            from rouge_score import rouge_scorer
            self._scorer = rouge_scorer.RougeScorer([self.rouge_type], use_stemmer=self.use_stemmer,
                                                    split_summaries=self.split_summaries)
        return self._scorer

    def __call__(self, prompts, generations, metas):
        scorer = self.load()
        out = []
        for text, meta in zip(generations, metas):
            scores = [getattr(scorer.score(ref, text)[self.rouge_type], self.measure) for ref in references_of(meta)]
            out.append(max(scores))
        return out


def _fixed(rouge_type):
    def factory(use_stemmer: bool = False, measure: str = "fmeasure", split_summaries: bool = False):
        return Rouge(rouge_type, use_stemmer, measure, split_summaries)
    factory.__doc__ = f"ROUGE with rouge_type {rouge_type}."
    return factory


for _t in ("rouge1", "rouge2", "rougeL"):
    register(_t, _fixed(_t))
