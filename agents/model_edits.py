"""Edits made to a loaded model, weights and their names untouched (a saved or exported model loads
as before): dropout off, GPT-2's GELU as one op, and a padded vocabulary's outputs past the tokenizer's
tokens masked."""
from __future__ import annotations

import torch


class TanhGELU(torch.nn.Module):
    """The tanh approximation of GELU (GPT-2's `gelu_new`) as PyTorch's one fused op."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x, approximate="tanh")


def fuse_activations(model: torch.nn.Module) -> None:
    """Replaces transformers' `NewGELUActivation` (GPT-2's and T5 v1.1's `gelu_new`: five
    elementwise ops and their backward) with `TanhGELU`, the same function in one op (equal up to
    float rounding). At a tiny model's size it was about 7% of a PPO iteration. The config is left
    as it is, so a saved model loads as before."""
    from transformers.activations import NewGELUActivation

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is NewGELUActivation:
                setattr(parent, name, TanhGELU())


def disable_dropout(model: torch.nn.Module) -> None:
    """Sets every dropout probability to 0.

    With dropout on, the log-prob of an action at rollout time and in the
    learner differ by noise, so PPO's ratio and the KL estimate are wrong.
    Covers `nn.Dropout` modules and the config fields that functional dropout
    reads (`attention_dropout`, `attn_pdrop`, ...).
    """
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    for key, value in list(vars(model.config).items()):
        if isinstance(value, float) and ("dropout" in key or key.endswith("pdrop")):
            setattr(model.config, key, 0.0)
    for module in model.modules():
        for attr in ("attention_dropout", "dropout"):
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, 0.0)


class _PaddingMasked:
    """A forward hook on an output head: the logits of the outputs from `n` on set to the dtype's
    lowest value in place (a probability of exactly 0), at the head's full width."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, head, args, logits):
        logits[..., self.n:] = torch.finfo(logits.dtype).min


def mask_padded_vocabulary(model: torch.nn.Module, n: int | None = None) -> None:
    """A padded vocabulary (more outputs than tokens: T5's 32,128 for 32,100, Pythia's) gets the
    logits of its outputs past the tokenizer's `n` tokens masked wherever its output head runs (the
    project's passes and the model's own forward, where BART then adds its full-width bias), so
    nothing draws a token the tokenizer lacks. A forward hook: the weights, their names and an
    export stay whole. n None: again on the head as it is now (after LoRA wraps it)."""
    stored, old = getattr(model, "_padding_mask", (None, None))
    n = n if n is not None else stored
    if old is not None:
        old.remove()
        model._padding_mask = (None, None)
    head = model.get_output_embeddings()
    if n is not None and head is not None and head.weight.shape[0] > n:
        model._padding_mask = (n, head.register_forward_hook(_PaddingMasked(n)))


def padded_tokens(model: torch.nn.Module) -> list[int]:
    """The output ids `mask_padded_vocabulary` masks in `model` (none for a model it left alone)."""
    n, _ = getattr(model, "_padding_mask", (None, None))
    return [] if n is None else list(range(n, model.get_output_embeddings().weight.shape[0]))
