"""Builds policies and tokenizers from a model spec.

`model.name_or_path` is one of:
  * a config defined here (`tiny-gpt2`, `gpt2-small-shaped`): randomly
    initialised, sized to the task's tokenizer, no download;
  * a local directory written by `save_pretrained`;
  * a hub name (loaded with `from_pretrained`; needs the hub or its cache).
"""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, PreTrainedModel

from env.tasks import make_task
from env.tokenization import load_tokenizer

# In-project configurations: GPT-2 shapes, vocabulary taken from the tokenizer.
BUILTIN_CONFIGS = {
    "tiny-gpt2": dict(n_layer=2, n_head=4, n_embd=64),
    "gpt2-small-shaped": dict(n_layer=12, n_head=12, n_embd=768),
}


def is_builtin(name_or_path: str) -> bool:
    return name_or_path in BUILTIN_CONFIGS


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
        model = AutoModelForCausalLM.from_pretrained(name)
        if model.get_input_embeddings().num_embeddings < len(tokenizer):
            raise ValueError(
                f"model.name_or_path: {name!r} has {model.get_input_embeddings().num_embeddings} "
                f"embeddings but the tokenizer has {len(tokenizer)} tokens"
            )
    model.config.use_cache = False
    disable_dropout(model)
    return model


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
