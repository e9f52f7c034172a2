"""Builds policies and tokenizers from a model spec.

`model.name_or_path` is one of:
  * a config defined here (`tiny-gpt2`, `gpt2-small-shaped`, `gpt2-medium-shaped`, and the
    encoder-decoder `tiny-t5`, `tiny-bart`): randomly initialised, sized to the
    task's tokenizer, no download;
  * a local directory written by `save_pretrained`;
  * a hub name (loaded with `from_pretrained`; needs the hub or its cache).
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import warnings

import torch
import torch.nn.functional as F

from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, PreTrainedModel

from env.tasks import make_task
from env.text_env import env_setting
from env.tokenization import load_tokenizer

from agents.model_edits import disable_dropout, fuse_activations, mask_padded_vocabulary

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


# The config fields a built-in shape takes from the tokenizer and the env, never from overrides.
BUILT_FROM_THE_ENV = ("vocab_size", "n_positions", "max_position_embeddings", "bos_token_id", "eos_token_id",
                      "pad_token_id", "decoder_start_token_id", "forced_eos_token_id")


def check_overrides(model_config: dict) -> None:
    """`model.overrides` (fields of a built-in shape's transformers config): only for a built-in,
    each a field of its config class, the shape's sizes positive integers and GPT-2's width a
    multiple of its heads. A ValueError naming the field otherwise."""
    overrides, name = model_config.get("overrides") or {}, model_config.get("name_or_path")
    if not overrides or not isinstance(name, str):
        return
    if not is_builtin(name):
        raise ValueError(f"model.overrides: only the built-in shapes take them ({', '.join(BUILTIN_CONFIGS)}, "
                         f"{', '.join(SEQ2SEQ_CONFIGS)}); {name!r} is loaded as it was saved")
    from transformers import BartConfig, T5Config

    shape = {**BUILTIN_CONFIGS, **SEQ2SEQ_CONFIGS}[name]
    config = GPT2Config() if name in BUILTIN_CONFIGS else T5Config() if name == "tiny-t5" else BartConfig()
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise ValueError(f"model.overrides.{key}: not a field of {type(config).__name__}")
        if key in BUILT_FROM_THE_ENV:
            raise ValueError(f"model.overrides.{key}: set from the tokenizer and the env's lengths, not an override")
        if key in shape and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"model.overrides.{key}: expected an integer >= 1, got {value!r}")
        if isinstance(getattr(config, key), float) and isinstance(value, (str, int)) and not isinstance(value, bool):
            try:  # a float field written 1 or 1e-5 (which YAML 1.1 reads as a string)
                overrides[key] = value = float(value)
            except ValueError:
                pass
        problem = _override_problem(key, value, getattr(config, key))
        if problem:
            raise ValueError(f"model.overrides.{key}: {problem}")
    merged = {**shape, **overrides}
    if name in BUILTIN_CONFIGS and merged["n_embd"] % merged["n_head"]:
        raise ValueError(f"model.overrides: n_embd ({merged['n_embd']}) must be a multiple of n_head ({merged['n_head']})")
    from transformers import BartForConditionalGeneration, T5ForConditionalGeneration

    model_cls = {GPT2Config: GPT2LMHeadModel, T5Config: T5ForConditionalGeneration}.get(type(config),
                                                                                      BartForConditionalGeneration)
    try:  # whatever else transformers refuses, on the meta device (no memory, no time)
        with torch.device("meta"):
            model_cls(type(config)(**merged))
    except Exception as e:
        raise ValueError(f"model.overrides: the model does not build with them: {type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]}") from None


def _override_problem(key: str, value, default) -> str | None:
    """What is wrong with one override, judged by its config default's type and the field's range."""
    from transformers.activations import ACT2FN

    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if value is None:  # the config class says whether a field may be null (the build below)
        return None
    if isinstance(default, bool) and not isinstance(value, bool):
        return f"expected true or false, got {value!r}"
    if isinstance(default, float) and not (number and math.isfinite(value)):
        return f"expected a number, got {value!r}"
    if isinstance(default, str) and not isinstance(value, str):
        return f"expected a string, got {value!r}"
    if ("pdrop" in key or "dropout" in key) and number and not 0 <= value <= 1:
        return f"expected a probability in [0, 1], got {value!r}"
    if "epsilon" in key and number and value <= 0:
        return f"expected a number > 0, got {value!r}"
    if key == "activation_function" and value not in ACT2FN:
        return f"unknown activation {value!r} (one of {', '.join(sorted(ACT2FN))})"
    return None


def check_local_path(field: str, name) -> None:
    """Refuses a model or tokenizer name written as a local path that is not a directory, in one
    line naming the field (a hub name passes: loading it says what is wrong)."""
    from agents.saved_policy import not_a_model_dir
    from env.validation import local_path_problem

    if problem := local_path_problem(name) or not_a_model_dir(name):
        raise ValueError(f"{field}: {problem}")


def check_pretrained(field: str, name, *, tokenizer: bool = False) -> None:
    """A model (or tokenizer) name loads: a built-in, a local directory, or a hub name this machine
    can reach or has cached. One line naming the field otherwise ("no such directory" for a path)."""
    from env.validation import first_line

    if name is None or is_builtin(name):
        return
    check_local_path(field, name)
    if os.path.isdir(os.path.expanduser(name)):
        return
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
    task = make_task(env_config["task"], max_new_tokens=env_setting(env_config, "max_new_tokens"))
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
        # fp32 master weights whatever the directory holds (many are saved in bf16, which transformers keeps)
        model = _check_embeddings(AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32), name, tokenizer)
    model.config.use_cache = False
    disable_dropout(model)
    fuse_activations(model)
    return model


def _check_embeddings(model: PreTrainedModel, name: str, tokenizer) -> PreTrainedModel:
    """The model, if it has an embedding for every token of the tokenizer, its outputs past them masked."""
    if model.get_input_embeddings().num_embeddings < len(tokenizer):
        raise ValueError(
            f"model.name_or_path: {name!r} has {model.get_input_embeddings().num_embeddings} "
            f"embeddings but the tokenizer has {len(tokenizer)} tokens"
        )
    mask_padded_vocabulary(model, len(tokenizer))
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
        model = _check_embeddings(AutoModelForSeq2SeqLM.from_pretrained(name, dtype=torch.float32), name, tokenizer)
    model.config.use_cache = False
    disable_dropout(model)
    fuse_activations(model)
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


# -- parameter-efficient policies and precision ----------------------------------------------

def _lora_fields() -> dict:
    from env.validation import Field

    return {"r": Field(int, 8, lo=1), "alpha": Field(float, 16.0, lo=0.0, lo_open=True),
            "dropout": Field(float, 0.0, lo=0.0, hi=1.0),
            "target_modules": Field(list, None, optional=True), "modules_to_save": Field(list, None, optional=True)}


# The `model.lora` keys (agents.config checks a config's section against them). target_modules
# null: PEFT's default for the architecture (GPT-2: c_attn; T5: q, v; BART: q_proj, v_proj).
# modules_to_save: modules trained whole beside the adapters (e.g. a final layer norm), their
# originals kept for the reference.
LORA_FIELDS = _lora_fields()
LORA_DEFAULTS = {key: field.default for key, field in LORA_FIELDS.items()}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_lora(lm: PreTrainedModel, lora: dict, *, seed: int = 0) -> PreTrainedModel:
    """Injects LoRA adapters (PEFT) into `lm` in place: only the adapters are trainable after
    this; the base weights are frozen, and `adapters_disabled(lm)` gives the base model back.
    Adapters start as a no-op (B = 0), so at first the policy is exactly the base model."""
    from peft import LoraConfig

    lora = {**LORA_DEFAULTS, **(lora or {})}
    targets = lora["target_modules"]
    try:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():  # the same adapters in every process
            warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False")  # GPT-2's Conv1D: PEFT sets it
            # tied embeddings in modules_to_save train as two copies, exported as two (without_adapters)
            warnings.filterwarnings("ignore", message="Model has `tie_word_embeddings=True` and a tied layer")
            torch.manual_seed(seed)
            lm.add_adapter(LoraConfig(r=int(lora["r"]), lora_alpha=float(lora["alpha"]),
                                      lora_dropout=float(lora["dropout"]), bias="none",
                                      target_modules=list(targets) if targets else None,
                                      modules_to_save=list(lora["modules_to_save"] or []) or None))
    except ValueError as e:  # e.g. a target module the model does not have
        from env.validation import first_line

        raise ValueError(f"model.lora.target_modules: {first_line(e)}") from None
    mask_padded_vocabulary(lm)  # on the head as it is now, should the adapters wrap it
    names = {name.rpartition(".")[2] for name, _ in lm.named_modules()}
    for name in lora["modules_to_save"] or []:
        if name not in names:
            raise ValueError(f"model.lora.modules_to_save: the model has no module named {name!r}")
    return lm


def check_lora(model_config: dict, tokenizer) -> None:
    """`model.lora` put on the model's structure on the meta device (no weights are made or
    read): a target module or module to save that the model lacks fails here, in one line,
    instead of in the trial's Ray worker."""
    if not model_config.get("lora") or not isinstance(model_config.get("name_or_path"), str):
        return
    name = model_config["name_or_path"]
    with torch.device("meta"):
        if is_builtin(name):
            lm = (build_seq2seq_lm if name in SEQ2SEQ_CONFIGS else build_causal_lm)(model_config, tokenizer)
        else:
            from transformers import AutoConfig, AutoModelForSeq2SeqLM

            config = AutoConfig.from_pretrained(name)
            lm = (AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM).from_config(config)
    add_lora(lm, model_config["lora"])


def has_lora(lm) -> bool:
    return bool(getattr(lm, "peft_config", None))


def is_adapter_key(key: str) -> bool:
    """A state-dict key of what a LoRA policy trains: an adapter's weights, or a trained copy of a
    `modules_to_save` module."""
    return ".lora_" in key or ".modules_to_save." in key


class adapters_disabled:
    """Context: `lm` computes as its base model (its LoRA adapters and the trained copies of its
    `modules_to_save` switched off). Both are toggled here: transformers' `enable_adapters`
    leaves `modules_to_save` copies off once `disable_adapters` turned them off."""

    def __init__(self, lm):
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils import ModulesToSaveWrapper

        self.layers = [m for m in lm.modules() if isinstance(m, (BaseTunerLayer, ModulesToSaveWrapper))]

    def __enter__(self):
        for layer in self.layers:
            layer.enable_adapters(False)

    def __exit__(self, *exc):
        for layer in self.layers:
            layer.enable_adapters(True)


def cast_frozen(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Stores every frozen (requires_grad False) weight matrix of `module` in `dtype`; trainable
    parameters stay float32 (LoRA's base matrices in bf16, its adapters full precision), and so
    do the frozen vectors (norms, biases: a norm must take float32 activations, e.g. from a
    trained float32 copy of the embeddings, and they are a negligible share of the memory)."""
    for p in module.parameters():
        if not p.requires_grad and p.is_floating_point() and p.dim() >= 2:
            p.data = p.data.to(dtype)


def without_adapters(lm: PreTrainedModel, *, merge: bool) -> PreTrainedModel:
    """A plain `transformers` model (float32, no adapters) with `lm`'s weights: with `merge`,
    each adapter folded into its base weight (W + BA * alpha/r), computing what the adapted
    `lm` does; without, the base model. `lm` is left as it was."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in lm.modules() if isinstance(m, BaseTunerLayer)]
    dtypes = {name: p.dtype for name, p in lm.named_parameters()}
    lm.float()
    try:
        if merge:
            for layer in layers:
                layer.merge()
        # a modules_to_save module: its trained copy (merged) or its original (the base)
        keep, drop = (".modules_to_save.default.", ".original_module.") if merge else \
            (".original_module.", ".modules_to_save.default.")
        state = {k.replace(".base_layer.", ".").replace(keep, "."): v.clone() for k, v in lm.state_dict().items()
                 if ".lora_" not in k and drop not in k}
    finally:
        if merge:
            for layer in layers:
                layer.unmerge()
        for name, p in lm.named_parameters():
            p.data = p.data.to(dtypes[name])
    config = copy.deepcopy(lm.config)
    for untie in (False, True):  # trained copies of tied embeddings (modules_to_save) stay two matrices
        if untie:
            config.tie_word_embeddings = False
        with torch.device("meta"):
            plain = type(lm)(config)
        missing, unexpected = plain.load_state_dict(state, strict=False, assign=True)
        plain.tie_weights()
        loaded = plain.state_dict()
        if all(torch.equal(loaded[k], v) for k, v in state.items() if k in loaded):
            break
    if unexpected or any(p.is_meta for p in plain.parameters()):
        raise RuntimeError(f"the model without adapters does not match its weights: missing {missing}, "
                           f"unexpected {unexpected}")
    plain.generation_config = copy.deepcopy(lm.generation_config)
    return plain.eval()


def load_pretrained_lm(path: str) -> PreTrainedModel:
    """A model directory from `agents.export` (or any save_pretrained directory): a plain model,
    or a PEFT LoRA adapter directory whose base is its `base_model_name_or_path` (relative to the
    adapter's directory when it is a folder there), merged into a plain model; in float32 whatever
    dtype it was saved in (`agents.evaluate` scores perplexity with it in fp32)."""
    from transformers import AutoModelForSeq2SeqLM

    adapter_config = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(adapter_config):
        seq2seq = declared_kind({"name_or_path": path, "kind": "auto"}) == "seq2seq"
        return (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_pretrained(path, dtype=torch.float32)
    from peft import PeftModel

    with open(adapter_config, encoding="utf-8") as f:
        base = json.load(f).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{path}: adapter_config.json names no base_model_name_or_path")
    if os.path.isdir(os.path.join(path, base)):
        base = os.path.join(path, base)
    lm = load_pretrained_lm(base)
    return PeftModel.from_pretrained(lm, path).merge_and_unload()


def gpu_has_bf16(device: torch.device | None = None) -> bool:
    """Whether `device` (default: this process's current GPU) is a GPU with bf16 in hardware
    (Ampere and later; a GPU that would only emulate it counts as without)."""
    if not torch.cuda.is_available():
        return False
    with torch.cuda.device(device):  # None, or no index: the current GPU
        return torch.cuda.is_bf16_supported(including_emulation=False)


def auto_rollout_dtype(device: torch.device) -> torch.dtype:
    """`env_runners.precision: auto` for a rollout module on `device`: bf16 on a GPU that has
    bf16 in hardware, else float32."""
    return torch.bfloat16 if device.type == "cuda" and gpu_has_bf16(device) else torch.float32


def auto_precision(device_type: str) -> str:
    """`training.precision: auto`: bf16 autocast on a GPU that has bf16 (with TF32 matmuls for
    what stays float32), else fp32 (the CPU's passes are unchanged)."""
    if device_type == "cuda" and gpu_has_bf16():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        return "bf16"
    return "fp32"


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on `device`'s current stream (the static update)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


_static_depth = 0  # > 0 inside `static_pass`


@contextlib.contextmanager
def static_pass():
    """Passes inside it take the static update's ops (`embed`), eager or captured alike."""
    global _static_depth
    _static_depth += 1
    try:
        yield
    finally:
        _static_depth -= 1


def embed(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.embedding(ids, weight)`, except in the static update (`static_pass`): on CUDA the
    embedding's backward, above 3,072 indices, sorts them and reads the number of distinct ones
    back to the host, which a CUDA graph cannot hold; `index_select`'s backward (`index_add_`)
    reads nothing back."""
    if _static_depth:
        return weight.index_select(0, ids.reshape(-1)).view(*ids.shape, weight.shape[-1])
    return F.embedding(ids, weight)
