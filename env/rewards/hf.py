"""Hugging Face models for model-based rewards: loaded once per process, scored in batches.

A model is a local directory written by `save_pretrained` or a hub name (which
needs the hub or its cache; tests and offline runs use local directories).
`tiny-gpt2` is a randomly initialised 2-layer GPT-2 sized to a given tokenizer
(seeded, so every process builds the same one): for smoke tests and the
quickstart, not a meaningful judge of text.
"""
from __future__ import annotations

import functools

TINY_CAUSAL_LMS = {"tiny-gpt2": dict(n_layer=2, n_head=4, n_embd=64)}


def _tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@functools.lru_cache(maxsize=None)
def causal_lm(name_or_path: str, device: str = "cpu", tokenizer: str | None = None, seed: int = 0):
    """(model, tokenizer) for a causal LM, in eval mode on `device`; cached per process."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    if name_or_path in TINY_CAUSAL_LMS:
        if tokenizer is None:
            raise ValueError(f"model {name_or_path!r} is built here and needs a tokenizer (a local dir or hub name)")
        tok = _tokenizer(tokenizer)
        start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        config = GPT2Config(vocab_size=len(tok), n_positions=1024, bos_token_id=start, eos_token_id=start,
                            pad_token_id=tok.pad_token_id, **TINY_CAUSAL_LMS[name_or_path])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = GPT2LMHeadModel(config)
    else:
        tok = _tokenizer(tokenizer or name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path)
    return model.eval().to(device), tok


@functools.lru_cache(maxsize=None)
def sequence_classifier(name_or_path: str, device: str = "cpu"):
    """(model, tokenizer) for a text classifier, in eval mode on `device`; cached per process."""
    from transformers import AutoModelForSequenceClassification

    tok = _tokenizer(name_or_path)
    tok.padding_side = "right"  # left padding would shift absolute positions (BERT-style classifiers)
    model = AutoModelForSequenceClassification.from_pretrained(name_or_path)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tok.pad_token_id
    return model.eval().to(device), tok


def max_positions(model) -> int | None:
    config = model.config
    for key in ("n_positions", "max_position_embeddings", "n_ctx", "max_sequence_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def start_token(tokenizer) -> int:
    """The token that stands for "no context" (BOS, else EOS), so the first token gets a probability."""
    for tid in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return tid
    raise ValueError("the tokenizer has neither a BOS nor an EOS token to start an empty context with")


def target_logprobs(model, tokenizer, contexts: list[list[int]], targets: list[list[int]],
                    batch_size: int = 16) -> list[list[float]]:
    """log p(target_t | context, target_<t) for every target token, batched.

    An empty context becomes the start token. A context too long for the model
    keeps its last tokens; a target too long for the model is an error (it
    cannot be scored whole). Rows are right-padded, so a causal model's real
    tokens see the same positions and attention as when scored alone.
    """
    import torch

    limit = max_positions(model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    rows = []
    for ctx, tgt in zip(contexts, targets):
        ctx = list(ctx) or [start_token(tokenizer)]
        if limit is not None and len(ctx) + len(tgt) > limit:
            if len(tgt) + 1 > limit:
                raise ValueError(f"{len(tgt)} tokens to score do not fit the model's {limit} positions")
            ctx = ctx[len(ctx) + len(tgt) - limit:]
        rows.append((ctx, list(tgt)))
    out: list[list[float]] = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        width = max(len(c) + len(t) for c, t in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, (c, t) in enumerate(chunk):
            seq = c + t
            ids[i, :len(seq)] = torch.tensor(seq)
            mask[i, :len(seq)] = 1
        with torch.inference_mode():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
        norm = torch.logsumexp(logits, dim=-1)  # log-softmax at the scored positions only
        for i, (c, t) in enumerate(chunk):
            if not t:
                out.append([])
                continue
            positions = torch.arange(len(c) - 1, len(c) + len(t) - 1, device=logits.device)
            tokens = torch.tensor(t, device=logits.device)
            out.append((logits[i, positions, tokens] - norm[i, positions]).tolist())
    return out
