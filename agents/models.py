"""Builds policies and tokenizers from a model spec.

`model.name_or_path` is one of:
  * a config defined here (`tiny-gpt2`, `gpt2-small-shaped`, `gpt2-medium-shaped`, and the
    encoder-decoder `tiny-t5`, `tiny-bart`): randomly initialised, sized to the
    task's tokenizer, no download;
  * a local directory written by `save_pretrained`;
  * a hub name (loaded with `from_pretrained`; needs the hub or its cache).
"""
from __future__ import annotations

import torch
import json
import os

from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, PreTrainedModel

from env.tasks import make_task
from env.tokenization import load_tokenizer

# In-project configurations: GPT-2 shapes, vocabulary taken from the tokenizer.
BUILTIN_CONFIGS = {
    "tiny-gpt2": dict(n_layer=2, n_head=4, n_embd=64),
    "gpt2-small-shaped": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium-shaped": dict(n_layer=24, n_head=16, n_embd=1024),
}


# Encoder-decoder shapes (T5: relative positions; BART: learned absolute positions).
SEQ2SEQ_CONFIGS = {
    "tiny-t5": dict(num_layers=2, num_decoder_layers=2, num_heads=4, d_model=64, d_kv=16, d_ff=128,
                    relative_attention_num_buckets=8, relative_attention_max_distance=32),
    "tiny-bart": dict(encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                      d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128),
}


def is_builtin(name_or_path: str) -> bool:
    return name_or_path in BUILTIN_CONFIGS or name_or_path in SEQ2SEQ_CONFIGS


def check_local_path(field: str, name) -> None:
    """Refuses a model or tokenizer name written as a local path that is not a directory, in one
    line naming the field (a hub name passes: loading it says what is wrong)."""
    from env.validation import missing_local_path

    if isinstance(name, str) and os.path.isfile(os.path.expanduser(name)):
        raise ValueError(f"{field}: {name!r} is a file; expected a save_pretrained directory or a hub name")
    if missing_local_path(name):
        raise ValueError(f"{field}: no such directory {name!r}")


def check_pretrained(field: str, name, *, tokenizer: bool = False) -> None:
    """A model (or tokenizer) name loads: a built-in, a local directory, or a hub name this machine
    can reach or has cached. One line naming the field otherwise ("no such directory" for a path)."""
    from env.validation import first_line

    if name is None or is_builtin(name) or os.path.isdir(os.path.expanduser(name)):
        return
    check_local_path(field, name)
    from transformers import AutoConfig, AutoTokenizer

    try:
        (AutoTokenizer if tokenizer else AutoConfig).from_pretrained(name)
    except (OSError, ValueError) as e:
        raise ValueError(f"{field}: cannot load {name!r}: not a local directory; {first_line(e)}") from None


def declared_kind(model_config: dict, actual: str | None = None) -> str | None:
    """The model's kind when it is known without loading anything: `model.kind` when set, a
    built-in's kind, or a local directory's `config.json` (or `actual`, when the caller looked it
    up); None for a hub name under `auto`. A `model.kind` that contradicts it is a ValueError."""
    kind = model_config.get("kind", "auto")
    name = model_config["name_or_path"]
    if actual is None:
        if name in BUILTIN_CONFIGS or name in SEQ2SEQ_CONFIGS:
            actual = "seq2seq" if name in SEQ2SEQ_CONFIGS else "causal"
        elif os.path.isfile(os.path.join(name, "config.json")):
            with open(os.path.join(name, "config.json"), encoding="utf-8") as f:
                actual = "seq2seq" if json.load(f).get("is_encoder_decoder") else "causal"
        else:
            return None if kind == "auto" else kind
    if kind not in ("auto", actual):
        raise ValueError(f"model.kind: {kind} does not match model.name_or_path {name!r}, which is a "
                         f"{'causal LM' if actual == 'causal' else 'encoder-decoder (seq2seq) model'}")
    return actual


def model_kind(model_config: dict) -> str:
    """'causal' or 'seq2seq'; a hub name is looked up (its config only) and must agree with an
    explicit `model.kind`."""
    name, kind = model_config["name_or_path"], model_config.get("kind", "auto")
    if name in BUILTIN_CONFIGS or name in SEQ2SEQ_CONFIGS or os.path.isfile(os.path.join(name, "config.json")):
        return declared_kind(model_config)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError):  # not reachable here: trust model.kind; the load fails later with its own message
        return "causal" if kind == "auto" else kind
    return declared_kind(model_config, actual="seq2seq" if getattr(config, "is_encoder_decoder", False) else "causal")


def build_tokenizer(env_config: dict):
    """The tokenizer the env uses: the task's own, else the configured one."""
    task = make_task(env_config["task"], max_new_tokens=env_config.get("max_new_tokens", 20))
    tokenizer = task.tokenizer()
    if tokenizer is None:
        tokenizer = load_tokenizer(env_config["tokenizer"])
    return tokenizer


def build_causal_lm(model_config: dict, tokenizer, *, seed: int = 0, max_positions: int = 1024) -> PreTrainedModel:
    """A causal LM for `model_config` (the YAML `model` section) and `tokenizer`."""
    name = model_config["name_or_path"]
    if is_builtin(name):
        shape = {**BUILTIN_CONFIGS[name], **model_config.get("overrides", {})}
        config = GPT2Config(
            vocab_size=len(tokenizer),
            n_positions=max(max_positions, 8),
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **shape,
        )
        # A fixed seed gives every process that builds this module the same weights.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = GPT2LMHeadModel(config)
    else:
        model = _check_embeddings(AutoModelForCausalLM.from_pretrained(name), name, tokenizer)
    model.config.use_cache = False
    disable_dropout(model)
    return model


def _check_embeddings(model: PreTrainedModel, name: str, tokenizer) -> PreTrainedModel:
    """The model, if it has an embedding for every token of the tokenizer."""
    if model.get_input_embeddings().num_embeddings < len(tokenizer):
        raise ValueError(
            f"model.name_or_path: {name!r} has {model.get_input_embeddings().num_embeddings} "
            f"embeddings but the tokenizer has {len(tokenizer)} tokens"
        )
    return model


def build_seq2seq_lm(model_config: dict, tokenizer, *, seed: int = 0) -> PreTrainedModel:
    """An encoder-decoder LM (`AutoModelForSeq2SeqLM`) for `model_config` and `tokenizer`."""
    from transformers import AutoModelForSeq2SeqLM, BartConfig, BartForConditionalGeneration, T5Config, \
        T5ForConditionalGeneration

    name = model_config["name_or_path"]
    if name in SEQ2SEQ_CONFIGS:
        shape = {**SEQ2SEQ_CONFIGS[name], **model_config.get("overrides", {})}
        pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
        if name == "tiny-t5":  # T5 starts the decoder with the pad token
            config = T5Config(vocab_size=len(tokenizer), pad_token_id=pad, eos_token_id=eos,
                              decoder_start_token_id=pad, **shape)
            cls = T5ForConditionalGeneration
        else:  # BART starts it with EOS
            config = BartConfig(vocab_size=len(tokenizer), pad_token_id=pad, eos_token_id=eos, bos_token_id=eos,
                                decoder_start_token_id=eos, forced_eos_token_id=None, max_position_embeddings=256,
                                **shape)
            cls = BartForConditionalGeneration
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = cls(config)
    else:
        if declared_kind({**model_config, "kind": "auto"}) == "causal":
            raise ValueError(f"model.kind: seq2seq, but model.name_or_path {name!r} is a causal LM")
        model = _check_embeddings(AutoModelForSeq2SeqLM.from_pretrained(name), name, tokenizer)
    model.config.use_cache = False
    disable_dropout(model)
    return model


def is_encoder_decoder(model: PreTrainedModel) -> bool:
    return bool(getattr(model.config, "is_encoder_decoder", False))


def decoder_start_id(model: PreTrainedModel) -> int:
    """The token every decoder sequence starts with (T5: pad, BART: EOS)."""
    for source in (model.config, getattr(model, "generation_config", None)):
        value = getattr(source, "decoder_start_token_id", None)
        if value is not None:
            return int(value)
    if model.config.pad_token_id is None:
        raise ValueError("model.name_or_path: the model's config names no decoder_start_token_id or pad token")
    return int(model.config.pad_token_id)


def disable_dropout(model: PreTrainedModel) -> None:
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
