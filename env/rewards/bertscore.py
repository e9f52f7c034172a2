"""BERTScore (Zhang et al. 2020) through the `bert-score` package, against `meta["references"]`.

`model` is a local directory (or a hub name, which needs the hub cache): the
package's default models are never downloaded because a model must be given.
`num_layers` picks the hidden layer whose token embeddings are matched (default:
the model's last layer; bert-score's tuned per-model layers apply only to the hub
names it knows, so give it for those). The reward is the F1 (`measure`) of greedy
cosine matching, in [-1, 1] (in practice near [0, 1]), best over references.
No idf weighting by default; `idf_sentences` (a list of texts) turns it on with
idf from those texts. `rescale_with_baseline` needs `lang` and, for a local
model, a `baseline_path` file.
"""
from __future__ import annotations

import functools

from env.rewards.base import FieldError, check_choice, check_field, references_of, register, resolve_device


@functools.lru_cache(maxsize=None)
def bert_scorer(model: str, num_layers: int | None, device: str, batch_size: int, lang: str | None,
                rescale_with_baseline: bool, baseline_path: str | None, idf_sentences: tuple | None):
    from bert_score import BERTScorer
    from transformers import AutoConfig

    if num_layers is None:
        num_layers = AutoConfig.from_pretrained(model).num_hidden_layers
    scorer = BERTScorer(model_type=model, num_layers=num_layers, batch_size=batch_size, device=device,
                        lang=lang, rescale_with_baseline=rescale_with_baseline, baseline_path=baseline_path,
                        idf=idf_sentences is not None,
                        idf_sents=list(idf_sentences) if idf_sentences is not None else None)
    # A tokenizer saved without model_max_length reports a huge one, which bert-score passes to truncation.
    limit = getattr(scorer._model.config, "max_position_embeddings", None)
    if limit and (scorer._tokenizer.model_max_length or 0) > limit:
        scorer._tokenizer.model_max_length = limit
    return scorer


@register("bertscore")
class BertScore:
    """BERTScore F1 (default) with a given local model; best over references."""

    name = "bertscore"
    higher_is_better = True

    def __init__(self, model: str, num_layers: int | None = None, measure: str = "f1", batch_size: int = 64,
                 lang: str | None = None, rescale_with_baseline: bool = False, baseline_path: str | None = None,
                 idf_sentences: list | None = None, device: str = "auto"):
        check_choice("measure", measure, ("precision", "recall", "f1"))
        check_field("num_layers", num_layers, int, lo=1, optional=True)
        if rescale_with_baseline and lang is None:
            raise FieldError("lang", "rescale_with_baseline needs the language (e.g. en)")
        if idf_sentences is not None and not (isinstance(idf_sentences, list) and idf_sentences
                                              and all(isinstance(s, str) for s in idf_sentences)):
            raise FieldError("idf_sentences", "expected a non-empty list of strings")
        self.measure = measure
        self.args = (model, num_layers, device, batch_size, lang, rescale_with_baseline, baseline_path,
                     tuple(idf_sentences) if idf_sentences is not None else None)

    def load(self):
        model, num_layers, device, *rest = self.args
        return bert_scorer(model, num_layers, resolve_device(device), *rest)

    def __call__(self, prompts, generations, metas):
        scorer = self.load()
        refs = [references_of(m) for m in metas]
        p, r, f = scorer.score(list(generations), refs, verbose=False, batch_size=scorer.batch_size)
        return {"precision": p, "recall": r, "f1": f}[self.measure].tolist()
