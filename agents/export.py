"""Export a trained policy as a plain Hugging Face model directory.

    python -m agents.export --checkpoint PATH --out DIR [--force]

PATH is a checkpoint directory written by `agents.train` (or the RLModule
directory inside it). DIR receives the policy's LM and its tokenizer,
both written with `save_pretrained`, so that anything built on `transformers`
loads them without this project and without network access:

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(DIR)  # AutoModelForSeq2SeqLM for T5/BART policies
    tokenizer = AutoTokenizer.from_pretrained(DIR)

Only the language model is exported: the value head, the frozen reference
model and the NLPO masking copy stay behind. The policy's truncation sampler
becomes the directory's generation config (`do_sample=True` with `top_k`,
`top_p`, `typical_p`, `epsilon_cutoff` or `eta_cutoff`), which
`model.generate` applies with the same keep rules; mirostat, learned masking
(NLPO, where the mask comes from a delayed copy of the policy) and
`min_tokens_to_keep` other than 1 have no `transformers` equivalent and are
reported, not exported. The exported config turns the LM's KV cache back on
(`use_cache=True`) for `generate`; the weights and logits are the policy's. A padded vocabulary
(more outputs than tokens: T5, Pythia) keeps all its outputs, and the generation config's
`suppress_tokens` lists those past the tokenizer's, which the policy never drew.

A LoRA policy (`model.lora`) is exported merged by default (`--lora merge`: each adapter folded
into its base weight, a plain model as above). `--lora adapter` writes the PEFT adapter instead
(`adapter_config.json`, `adapter_model.safetensors`, the tokenizer); its base is the policy's
`model.name_or_path`, or, for a built-in (randomly initialised) base, the base model written to
`DIR/base_model`:

    from peft import PeftModel
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(DIR + "/base_model"), DIR)

DIR must not exist or be empty, unless `--force` (files already there are
overwritten, others are left alone). Errors are one line on stderr, exit 2; a wrong flag, PATH
or DIR is refused before torch or transformers are imported (`agents.generate`, imported here,
imports them in the functions that need them).
"""
from __future__ import annotations

import argparse
import os
import sys

from agents.generate import load_policy
from agents.saved_policy import find_module_dir

# sampler name -> (its parameter, the GenerationConfig field with the same keep rule)
GENERATION_FIELDS = {
    "top_k": ("k", "top_k"),
    "top_p": ("p", "top_p"),
    "typical": ("p", "typical_p"),
    "epsilon": ("epsilon", "epsilon_cutoff"),
    "eta": ("eta", "eta_cutoff"),
}


def generation_settings(sampler_spec: dict | None) -> tuple[dict, list[str]]:
    """The GenerationConfig fields reproducing a sampler config section, and notes on what they cannot."""
    spec = dict(sampler_spec or {})
    name = spec.get("name", "none")
    # top_k=0 / top_p=1.0 switch off transformers' defaults (top_k 50), so nothing truncates
    # that the policy did not.
    fields = {"do_sample": True, "top_k": 0, "top_p": 1.0}
    notes = []
    if name in GENERATION_FIELDS:
        param, field = GENERATION_FIELDS[name]
        fields[field] = spec[param]
    elif name != "none":
        notes.append(f"sampler {name!r} has no transformers equivalent: the export samples without truncation")
    if name in GENERATION_FIELDS and spec.get("masking", "current") == "learned":
        notes.append(f"sampler {name!r} masks with a delayed copy of the policy (masking: learned); "
                     "the export masks with the policy itself")
    if name != "none" and int(spec.get("min_tokens_to_keep", 1)) != 1:
        notes.append(f"sampler.min_tokens_to_keep={spec['min_tokens_to_keep']} is not exported (transformers keeps 1)")
    return fields, notes


def _check_out_dir(out_dir: str, force: bool) -> str:
    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    from env.validation import directory_error

    if not os.path.exists(out_dir) and (error := directory_error("--out", out_dir)):  # a file above it
        raise FileExistsError(error)
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise FileExistsError(f"--out: {out_dir} exists and is not a directory")
        if os.listdir(out_dir) and not force:
            raise FileExistsError(f"--out: {out_dir} exists and is not empty (use --force to write into it)")
    return out_dir


def export_policy(checkpoint: str, out_dir: str, *, force: bool = False, lora: str = "merge") -> dict:
    """Writes the policy's LM and tokenizer in `checkpoint` to `out_dir` with `save_pretrained`.

    Raises FileNotFoundError when `checkpoint` holds no policy and FileExistsError when
    `out_dir` is a file or a non-empty directory (unless `force`). Returns
    `{"out_dir", "generation_config", "notes"}`, the notes listing sampler settings
    that could not be exported.
    """
    find_module_dir(checkpoint)  # fail on a wrong path before anything else
    out_dir = _check_out_dir(out_dir, force)
    module = load_policy(checkpoint)
    if hasattr(module, "q_head"):
        raise ValueError(f"--checkpoint: {checkpoint} holds a DQN policy; it acts by argmax of its Q-head, "
                         "which a plain causal LM cannot carry (serve it with agents.serve instead)")
    from agents.models import has_lora, is_builtin, without_adapters

    lm, tokenizer = module.lm, module.tokenizer
    adapter = has_lora(lm) and lora == "adapter"
    if lora == "adapter" and not has_lora(lm):
        raise ValueError(f"--lora adapter: the policy in {checkpoint} has no LoRA adapters (model.lora); "
                         "export it without --lora")
    if has_lora(lm) and not adapter:
        lm = without_adapters(lm, merge=True)
    fields, notes = generation_settings(module.model_config.get("sampler"))
    from agents.model_edits import padded_tokens

    padding = padded_tokens(module.lm)
    if padding:  # a padded vocabulary: generate() never draws the outputs the tokenizer lacks, as the policy
        fields["suppress_tokens"] = padding
    lm.config.use_cache = True  # training turned it off; generate() wants it
    for key, value in fields.items():
        setattr(lm.generation_config, key, value)
    for key in ("eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, key)
        if value is not None:
            setattr(lm.generation_config, key, value)
    os.makedirs(out_dir, exist_ok=True)
    base = None
    if adapter:
        base = module.model_config["model"]["name_or_path"]
        if is_builtin(base):  # randomly initialised: nothing to load it from but this copy
            plain = without_adapters(lm, merge=False)
            plain.config.use_cache = True
            plain.save_pretrained(os.path.join(out_dir, BASE_SUBDIR))
            tokenizer.save_pretrained(os.path.join(out_dir, BASE_SUBDIR))
            base = BASE_SUBDIR
        lm.save_pretrained(out_dir)  # the adapters (and modules_to_save) only
        _set_adapter_base(out_dir, base)
    else:
        lm.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    from agents.models import is_encoder_decoder

    auto_class = "AutoModelForSeq2SeqLM" if is_encoder_decoder(lm) else "AutoModelForCausalLM"
    return {"out_dir": out_dir, "generation_config": fields, "notes": notes, "auto_class": auto_class,
            "adapter_base": base}


BASE_SUBDIR = "base_model"  # where an adapter export keeps a built-in base model


def _set_adapter_base(out_dir: str, base: str) -> None:
    """Names the adapter's base model in its adapter_config.json."""
    import json

    path = os.path.join(out_dir, "adapter_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["base_model_name_or_path"] = base
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def main(argv=None, prog: str = "python -m agents.export") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory from agents.train")
    parser.add_argument("--out", required=True, help="directory to write the model and tokenizer to")
    parser.add_argument("--force", action="store_true", help="write into an existing non-empty directory")
    parser.add_argument("--lora", choices=("merge", "adapter"), default="merge",
                        help="a LoRA policy: merge the adapters into a plain model (default), or write the "
                             "PEFT adapter directory")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        find_module_dir(args.checkpoint)  # wrong paths are refused before torch and transformers are imported
        _check_out_dir(args.out, args.force)
        from agents.core import no_transformers_bars

        no_transformers_bars()  # no "Writing model shards" bar above the summary
        result = export_policy(args.checkpoint, args.out, force=args.force, lora=args.lora)
    except (FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in result["notes"]:
        print(f"note: {note}", file=sys.stderr)
    out = result["out_dir"]
    if result["adapter_base"] is not None:
        base = result["adapter_base"]
        base_path = os.path.join(out, base) if os.path.isdir(os.path.join(out, base)) else base
        print(f"exported the policy's LoRA adapter and tokenizer to {out} (base: {base_path})")
        print(f"  load with PeftModel.from_pretrained({result['auto_class']}.from_pretrained({base_path!r}), "
              f"{out!r})")
        return 0
    print(f"exported the policy's model and tokenizer to {out}")
    print(f"  load with {result['auto_class']}.from_pretrained({out!r}) "
          f"and AutoTokenizer.from_pretrained({out!r})")
    return 0


if __name__ == "__main__":
    from agents import exit_with

    exit_with(main())
