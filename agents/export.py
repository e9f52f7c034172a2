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
(`use_cache=True`) for `generate`; the weights and logits are the policy's.

DIR must not exist or be empty, unless `--force` (files already there are
overwritten, others are left alone). Errors are one line on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import os
import sys

from agents.generate import find_module_dir, load_policy

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
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise FileExistsError(f"--out: {out_dir} exists and is not a directory")
        if os.listdir(out_dir) and not force:
            raise FileExistsError(f"--out: {out_dir} exists and is not empty (use --force to write into it)")
    return out_dir


def export_policy(checkpoint: str, out_dir: str, *, force: bool = False) -> dict:
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
    lm, tokenizer = module.lm, module.tokenizer
    fields, notes = generation_settings(module.model_config.get("sampler"))
    lm.config.use_cache = True  # training turned it off; generate() wants it
    for key, value in fields.items():
        setattr(lm.generation_config, key, value)
    for key in ("eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, key)
        if value is not None:
            setattr(lm.generation_config, key, value)
    os.makedirs(out_dir, exist_ok=True)
    lm.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    from agents.models import is_encoder_decoder

    auto_class = "AutoModelForSeq2SeqLM" if is_encoder_decoder(lm) else "AutoModelForCausalLM"
    return {"out_dir": out_dir, "generation_config": fields, "notes": notes, "auto_class": auto_class}


def main(argv=None, prog: str = "python -m agents.export") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory from agents.train")
    parser.add_argument("--out", required=True, help="directory to write the model and tokenizer to")
    parser.add_argument("--force", action="store_true", help="write into an existing non-empty directory")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        result = export_policy(args.checkpoint, args.out, force=args.force)
    except (FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in result["notes"]:
        print(f"note: {note}", file=sys.stderr)
    print(f"exported the policy's model and tokenizer to {result['out_dir']}")
    print(f"  load with {result['auto_class']}.from_pretrained({result['out_dir']!r}) "
          f"and AutoTokenizer.from_pretrained({result['out_dir']!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
