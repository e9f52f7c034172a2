"""Tokenizers behind the Hugging Face tokenizer interface.

Tasks with a closed vocabulary (the synthetic numbers task) build a word-level
tokenizer here; every other task loads one from a hub name or a local directory.
"""
from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"


def word_level_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """A whitespace-split tokenizer over `words`, with `<pad>` = 0 and `<eos>` = 1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {PAD_TOKEN: 0, EOS_TOKEN: 1}
    for word in words:
        if word in vocab:
            raise ValueError(f"duplicate word {word!r} in tokenizer vocabulary")
        vocab[word] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS_TOKEN))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Word-level tokens decode joined by single spaces.
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        padding_side="left",
    )


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """Loads a tokenizer from a hub name or a local directory; pads on the left.

    Causal LMs without a pad token (GPT-2) pad with their EOS token.
    """
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def is_word_level(tokenizer) -> bool:
    """Whether `tokenizer` is a fast tokenizer over a WordLevel model (an unknown word is lost whole)."""
    return type(getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)).__name__ == "WordLevel"


def unknown_words(tokenizer, text: str, encoding=None) -> list[str]:
    """The pieces of `text` that `tokenizer` can only encode as its unknown token (`encoding`:
    `text` already encoded with `return_offsets_mapping=True`)."""
    unk_id, unk_token = tokenizer.unk_token_id, tokenizer.unk_token
    if unk_id is None:  # e.g. a word-level tokenizer whose unknown token is set on its backend only
        backend = getattr(tokenizer, "backend_tokenizer", None)
        unk_token = getattr(getattr(backend, "model", None), "unk_token", None)
        unk_id = backend.token_to_id(unk_token) if unk_token else None
    if unk_id is None:
        return []
    if encoding is None and not getattr(tokenizer, "is_fast", False):  # no offsets: word by word
        return [w for w in text.split()
                if w != unk_token and unk_id in tokenizer(w, add_special_tokens=False)["input_ids"]]
    enc = encoding if encoding is not None and "offset_mapping" in encoding else \
        tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [text[s:e] for t, (s, e) in zip(enc["input_ids"], enc["offset_mapping"])
            if t == unk_id and text[s:e] != unk_token]
