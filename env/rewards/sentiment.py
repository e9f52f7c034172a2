"""Sentiment rewards in [0, 1]: a text classifier's P(positive), or VADER offline.

`sentiment` with `model` set runs that Hugging Face sequence classifier (local
dir or hub name) in batches and returns the softmax probability of the positive
label. The positive label is `positive_label` (a label name from the model's
id2label, or an index) or, by default, detected from id2label: a label named
"positive"/"pos" (any case), else the one label whose name contains "positive",
else index 1 of a two-label model named LABEL_0/LABEL_1. Without `model` it is
VADER, the `vader` reward.

`vader` is the vaderSentiment lexicon scorer: (compound + 1) / 2, mapping the
compound score's [-1, 1] onto [0, 1] (0.5 is neutral).

Both score the generation alone, or prompt + generation with `include_prompt: true`.
"""
from __future__ import annotations

from env.rewards.base import FieldError, check_field, register, resolve_device
from env.rewards.hf import sequence_classifier


def _texts(prompts, generations, include_prompt: bool) -> list[str]:
    if not include_prompt:
        return list(generations)
    return [p + g if (not p or not g or p[-1].isspace() or g[0].isspace()) else f"{p} {g}"
            for p, g in zip(prompts, generations)]


def positive_index(id2label: dict, positive_label=None) -> int:
    """The index of the positive label (see the module docstring for the detection rule)."""
    labels = {int(i): str(name) for i, name in id2label.items()}
    if positive_label is not None:
        if isinstance(positive_label, int) or (isinstance(positive_label, str) and positive_label.isdigit()):
            index = int(positive_label)
            if index not in labels:
                raise ValueError(f"positive_label: index {index} is not a label of the model ({labels})")
            return index
        for i, name in labels.items():
            if name.lower() == str(positive_label).lower():
                return i
        raise ValueError(f"positive_label: {positive_label!r} is not a label of the model ({labels})")
    lowered = {i: name.lower() for i, name in labels.items()}
    exact = [i for i, name in lowered.items() if name in ("positive", "pos")]
    if len(exact) == 1:
        return exact[0]
    contains = [i for i, name in lowered.items() if "positive" in name]
    if len(contains) == 1:
        return contains[0]
    if len(labels) == 2 and set(lowered.values()) == {"label_0", "label_1"}:
        return next(i for i, name in lowered.items() if name == "label_1")
    raise ValueError(f"cannot tell which label is positive among {labels}; set positive_label")


@register("vader")
class Vader:
    """VADER compound score mapped to [0, 1]: (compound + 1) / 2. Offline (the lexicon ships with the package)."""

    name = "vader"
    higher_is_better = True
    loads_model = False  # `load` reads VADER's lexicon

    def __init__(self, include_prompt: bool = False):
        self.include_prompt = include_prompt
        self._analyzer = None

    def load(self):
        if self._analyzer is None:
            from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
            self._analyzer = SentimentIntensityAnalyzer()
        return self._analyzer

    def __call__(self, prompts, generations, metas):
        analyzer = self.load()
        return [(analyzer.polarity_scores(t)["compound"] + 1.0) / 2.0
                for t in _texts(prompts, generations, self.include_prompt)]


@register("sentiment")
class Sentiment:
    """P(positive) from a text classifier `model`; VADER when no model is given.

    Fields: model (null: VADER), positive_label (null: detected), include_prompt
    (false), batch_size (32), max_length (512 tokens, truncating the text's end),
    device ('auto': the GPU of the process when it has one, else the CPU; or 'cpu', 'cuda:N').
    """

    name = "sentiment"
    higher_is_better = True

    @property
    def loads_model(self) -> bool:  # VADER without a classifier model
        return self.model_name is not None

    def __init__(self, model: str | None = None, positive_label: str | int | None = None,
                 include_prompt: bool = False, batch_size: int = 32, max_length: int = 512, device: str = "auto"):
        if model is None and positive_label is not None:
            raise FieldError("positive_label", "only applies with a classifier model (set model)")
        check_field("batch_size", batch_size, int, lo=1)
        check_field("max_length", max_length, int, lo=1)
        self.model_name, self.positive_label, self.include_prompt = model, positive_label, include_prompt
        self.batch_size, self.max_length, self.device = batch_size, max_length, device
        self._vader = Vader(include_prompt) if model is None else None
        self._positive = None

    def load(self):
        if self._vader is not None:
            return self._vader.load()
        model, tok = sequence_classifier(self.model_name, resolve_device(self.device))
        if self._positive is None:
            self._positive = positive_index(model.config.id2label, self.positive_label)
        return model, tok

    def __call__(self, prompts, generations, metas):
        if self._vader is not None:
            return self._vader(prompts, generations, metas)
        import torch

        model, tok = self.load()
        texts = _texts(prompts, generations, self.include_prompt)
        device = next(model.parameters()).device
        out = []
        for start in range(0, len(texts), self.batch_size):
            batch = tok(texts[start:start + self.batch_size], padding=True, truncation=True,
                        max_length=self.max_length, return_tensors="pt").to(device)
            with torch.inference_mode():
                logits = model(**batch).logits.float()
            out.extend(torch.softmax(logits, dim=-1)[:, self._positive].tolist())
        return out
