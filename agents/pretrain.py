"""Supervised warm start: maximum likelihood with teacher forcing and scheduled sampling.

    python -m agents.pretrain CONFIG.yaml [--set key=value ...] [--resume]

Trains a causal LM on text (`data.text_field`) or on source -> target pairs
(`data.source_field` + `data.target_field`, loss on the target only), and writes
a `save_pretrained` directory (model + tokenizer) to `output_dir`. An RL config
then starts from it and keeps it as the frozen KL reference:
`model.name_or_path: <output_dir>` (the env takes the tokenizer from there too).

`backward: true` trains the backward model of MMI, p(source | target): the pairs
are reversed before anything else. Scheduled sampling (Bengio et al., 2015):
at step i each target input token is replaced, with probability
p_i = ss_max * i / (steps - 1), by a token sampled from the model's own
prediction at that position. For a transformer that prediction comes from a
teacher-forced pass without gradient (the two-pass form of Mihaylova and
Martins, 2019); the loss is then taken on the mixed inputs against the true
targets. ss_max 0 (the default) is plain teacher forcing.

An encoder-decoder model (`model.kind: seq2seq`, a built-in `tiny-t5` / `tiny-bart`, or a
directory whose config says `is_encoder_decoder`) learns source -> target pairs: the source
is the encoder's input, the loss is on the target and EOS; scheduled sampling mixes the
decoder's inputs the same way.

Every `training.checkpoint_every` steps (100) the model, optimizer and data order are saved to
`output_dir/pretrain_checkpoint.pt`; `--resume` goes on from there exactly (with the same config
but for `training.log_every` and `checkpoint_every`), and the file is removed
when the run ends.

With a built-in model (`tiny-gpt2`) and no `model.tokenizer`, the tokenizer is
a word-level one over the training text's words. Errors in the config or the
data stop with one line naming the field or file, exit code 2.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from agents.config import read_yaml
from agents.schema import check_section, check_sections_known
from agents.whole_files import remove_partial_files, write_whole
from env.validation import ConfigError, Field as F, directory_error, first_line
from env.tasks.data import DATA_OPTIONS, DataError, DataSpec, load_rows

SCHEMA = {
    "seed": F(int, 0, lo=0),
    "output_dir": F(str, None, optional=True),  # required; checked below
    "backward": F(bool, False),
    "data": {  # plus the data keys of env/tasks/data.py (dataset, splits, split_fractions, ...)
        "text_field": F(str, "text"),
        "source_field": F(str, None, optional=True),
        "target_field": F(str, None, optional=True),
        "separator": F(str, None, optional=True),  # text between source and target (MMI's `separator`)
        "eval_split": F(str, "validation", optional=True),  # held-out cross-entropy; null: none
    },
    "model": {
        "name_or_path": F(str, "tiny-gpt2"),
        "kind": F(str, "auto", choices=["auto", "causal", "seq2seq"]),
        "tokenizer": F(str, None, optional=True),
        "overrides": F(dict, {}),
    },
    "training": {
        "steps": F(int, 500, lo=1),
        "batch_size": F(int, 32, lo=1),
        "lr": F(float, 1e-3, lo=0.0, lo_open=True),
        "weight_decay": F(float, 0.0, lo=0.0),
        "grad_clip": F(float, 1.0, lo=0.0, lo_open=True, optional=True),
        "max_len": F(int, 128, lo=2),
        "ss_max": F(float, 0.0, lo=0.0, hi=1.0),
        "log_every": F(int, 50, lo=1),
        "eval_batches": F(int, 8, lo=1),
        "checkpoint_every": F(int, 100, lo=0),  # steps between checkpoints in output_dir (0: none): see --resume
        "device": F(str, "auto", choices=["auto", "cpu", "cuda"]),  # auto: CUDA when present
        # CPU threads for torch (null: torch's default). A tiny model on a busy machine runs far
        # faster on one thread than fighting for several.
        "num_threads": F(int, None, lo=1, optional=True),
    },
}


# -- config ---------------------------------------------------------------------------

def validate(raw) -> dict:
    check_sections_known(raw, SCHEMA)
    cfg = {}
    for key, spec in SCHEMA.items():
        value = raw.get(key)
        if isinstance(spec, F):
            cfg[key] = spec.default if value is None else spec.check(key, value)
            continue
        cfg[key] = check_section(key, spec, value, extra=DATA_OPTIONS if key == "data" else None)
    if not cfg["output_dir"]:
        raise ConfigError("output_dir: missing (the directory to write the model and tokenizer to)")
    if error := directory_error("output_dir", cfg["output_dir"]):  # refused before training, not after
        raise ConfigError(error)
    if cfg["training"]["device"] == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device: cuda, but torch sees no CUDA device here (auto takes CUDA when present)")
    d = cfg["data"]
    if (d["source_field"] is None) != (d["target_field"] is None):
        raise ConfigError("data.target_field: give both data.source_field and data.target_field, or neither")
    if cfg["backward"] and d["source_field"] is None:
        raise ConfigError("backward: needs pairs (data.source_field and data.target_field)")
    from agents.models import check_overrides, declared_kind

    try:
        check_overrides(cfg["model"])
        kind = declared_kind(cfg["model"])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if kind == "seq2seq" and d["source_field"] is None:
        raise ConfigError("data.source_field: a seq2seq model learns source -> target pairs; give "
                          "data.source_field and data.target_field")
    if kind == "seq2seq" and d["separator"]:
        raise ConfigError("data.separator: a seq2seq model reads the source in its encoder; no separator is used")
    try:
        DataSpec.parse(d, path="data")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return cfg


def load_config(path: str, overrides=()) -> dict:
    return validate(read_yaml(path, overrides))


# -- data -----------------------------------------------------------------------------

def load_pairs(cfg: dict, split: str) -> list[tuple[str, str]]:
    """(context, text) per example: context '' for plain text; (target, source) when backward."""
    d = cfg["data"]
    spec = DataSpec.parse(d, path="data")
    if d["source_field"] is None:
        fields = {d["text_field"]: "text_field"}
    else:
        fields = {d["source_field"]: "source_field", d["target_field"]: "target_field"}
    try:
        rows = load_rows(spec, split, fields=fields, text_fields=tuple(fields))
    except DataError as e:  # the data module names task.* keys; here they live under data.*
        hint = " (data.eval_split: null skips the held-out loss)" if split == d["eval_split"] else ""
        raise DataError(str(e).replace("task.", "data.") + hint) from None
    if d["source_field"] is None:
        return [("", row[d["text_field"]]) for row in rows]
    pairs = [(row[d["source_field"]], row[d["target_field"]]) for row in rows]
    return [(t, s) for s, t in pairs] if cfg["backward"] else pairs


def build_tokenizer(cfg: dict, pairs: list[tuple[str, str]]):
    """The model's tokenizer (a built-in model without one: a word-level one over the data's words)."""
    from agents.models import is_builtin
    from env.tokenization import load_tokenizer, word_level_tokenizer

    m = cfg["model"]
    if not m["tokenizer"] and is_builtin(m["name_or_path"]):
        from env.tokenization import EOS_TOKEN, PAD_TOKEN

        words = sorted({w for pair in pairs for t in pair for w in t.split()} - {EOS_TOKEN, PAD_TOKEN})
        return word_level_tokenizer(words)
    field, name = ("model.tokenizer", m["tokenizer"]) if m["tokenizer"] else ("model.name_or_path", m["name_or_path"])
    try:
        tok = load_tokenizer(name)
    except (OSError, ValueError) as e:
        raise ValueError(f"{field}: cannot load a tokenizer from {name!r}: {first_line(e)}") from None
    check_known_words(tok, pairs, field)
    return tok


def check_known_words(tok, pairs: list[tuple[str, str]], field: str) -> None:
    """Training examples with text the tokenizer only knows as its unknown token: refused for a
    word-level tokenizer (whole words lost; the project's own word-level tokenizers' unknown token
    is EOS, so the model would learn to end mid-text), a note for a subword one (T5's SentencePiece
    and BERT's WordPiece lack some symbols and characters, which their models learned as unknown)."""
    from env.tokenization import is_word_level, unknown_words

    bad = [(i, words) for i, pair in enumerate(pairs) if (words := [w for t in pair for w in unknown_words(tok, t)])]
    if not bad:
        return
    (first, words), = bad[:1]
    what = (f"its tokenizer does not know words of {len(bad):,} of the {len(pairs):,} training examples (the first: "
            f"{words[0]!r} in example {first + 1})")
    if is_word_level(tok):
        raise ValueError(f"{field}: {what}; they would train as its unknown token. Use a tokenizer that has them "
                         "(or, with a built-in model, none: one is built from the data)")
    print(f"note: {field}: {what}; they train as its unknown token", file=sys.stderr)


def encode_example(tok, context: str, text: str, separator: str | None, max_len: int):
    """(ids, loss_mask): context + separator + text + EOS, the loss on text and EOS only.

    Plain text has no start token: in the token env a prompt starts at position 0 too.
    Too long: the context loses its start, then the text its end.
    """
    ctx = tok(context, add_special_tokens=False)["input_ids"] if context else []
    if separator:
        ctx = ctx + tok(separator, add_special_tokens=False)["input_ids"]
    tgt = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    tgt = tgt[:max_len - (1 if ctx else 0)]
    ctx = ctx[max(0, len(ctx) + len(tgt) - max_len):]
    return ctx + tgt, [0] * len(ctx) + [1] * len(tgt)


def collate(examples, pad_id: int):
    """Right-padded (input_ids, attention_mask, loss_mask) tensors."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    loss = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (seq, mask) in enumerate(examples):
        ids[i, :len(seq)] = torch.tensor(seq)
        attn[i, :len(seq)] = 1
        loss[i, :len(seq)] = torch.tensor(mask)
    return ids, attn, loss


# -- the loss ---------------------------------------------------------------------------

def draw_tokens(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of `probs` (rows, vocabulary; on any device), drawn at one float64
    uniform per row from `generator` (a CPU generator, so a seed gives the same uniforms on any
    device) by inverting the row's cumulative sum where `probs` are (`samplers.sample_rows`, a few
    rows at a time). `torch.multinomial` row by row on the host took about 1 ms a row at 50,257
    tokens on a 2-core machine, and on a GPU needed every row's probabilities copied to the host."""
    from agents.samplers import sample_rows

    return sample_rows(probs, torch.rand(len(probs), 1, dtype=torch.float64, generator=generator).to(probs.device))


def scheduled_sampling_inputs(model, ids, attn, loss_mask, p: float, generator: torch.Generator):
    """The inputs with each target token (but the first) replaced, with probability p, by a token
    sampled from the model's teacher-forced prediction for that position."""
    if p <= 0.0:
        return ids
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        probs = torch.softmax(logits, -1).reshape(-1, logits.shape[-1])
        sampled = draw_tokens(probs, generator).view(ids.shape[0], -1)
    # Position t's input is the token at t; the model's guess for it comes from position t-1.
    # A target's first token follows the context (or nothing) and is never fed back in.
    feedable = (loss_mask[:, 1:] == 1) & (loss_mask[:, :-1] == 1)
    coin = (torch.rand(feedable.shape, generator=generator) < p).to(ids.device)
    mixed = ids.clone()
    mixed[:, 1:] = torch.where(feedable & coin, sampled, ids[:, 1:])
    return mixed


def lm_loss(model, inputs, attn, targets, loss_mask, reduction: str = "mean"):
    """Cross-entropy of predicting `targets[t+1]` from `inputs[..t]`, over the loss mask."""
    logits = model(input_ids=inputs, attention_mask=attn).logits[:, :-1].float()
    mask = loss_mask[:, 1:].bool()
    nll = torch.nn.functional.cross_entropy(logits[mask], targets[:, 1:][mask], reduction="sum")
    return nll / mask.sum() if reduction == "mean" else nll


@torch.no_grad()
def heldout_loss(model, batches) -> float:
    """Mean per-token cross-entropy (nats) over `batches` of (ids, attn, loss_mask)."""
    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device
    for ids, attn, mask in batches:
        ids, attn, mask = ids.to(device), attn.to(device), mask.to(device)
        total += lm_loss(model, ids, attn, ids, mask, reduction="sum").item()
        count += int(mask[:, 1:].sum())
    return total / max(count, 1)


# -- encoder-decoder models -------------------------------------------------------------

def encode_pair(tok, source: str, target: str, max_len: int):
    """(source ids, target ids + EOS), as the token env feeds them: the source without special
    tokens, losing its start when too long (env truncation_side left); the target its end."""
    src = tok(source, add_special_tokens=False)["input_ids"][-max_len:]
    tgt = (tok(target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])[:max_len]
    return src, tgt


def collate_pairs(examples, pad_id: int):
    """Right-padded (source, source mask, target, target mask) tensors."""
    out = []
    for part in (0, 1):
        width = max(len(ex[part]) for ex in examples)
        ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(examples), width), dtype=torch.long)
        for i, ex in enumerate(examples):
            ids[i, :len(ex[part])] = torch.tensor(ex[part])
            mask[i, :len(ex[part])] = 1
        out += [ids, mask]
    return tuple(out)


def seq2seq_loss(model, start_id: int, src, src_mask, tgt, tgt_mask, p: float = 0.0, generator=None,
                 reduction: str = "mean"):
    """Cross-entropy of the targets given the sources with teacher forcing; with p > 0, each decoder
    input after the start token is, with probability p, the model's own sampled guess for it."""
    dec_in = torch.cat([torch.full_like(tgt[:, :1], start_id), tgt[:, :-1]], 1)
    if p > 0.0:
        with torch.no_grad():
            logits = model(input_ids=src, attention_mask=src_mask, decoder_input_ids=dec_in,
                           decoder_attention_mask=tgt_mask).logits[:, :-1].float()
            probs = torch.softmax(logits, -1).reshape(-1, logits.shape[-1])
            sampled = draw_tokens(probs, generator).view(tgt.shape[0], -1)
        coin = (torch.rand(sampled.shape, generator=generator) < p).to(tgt.device) & (tgt_mask[:, 1:] == 1)
        dec_in = dec_in.clone()
        dec_in[:, 1:] = torch.where(coin, sampled, dec_in[:, 1:])
    logits = model(input_ids=src, attention_mask=src_mask, decoder_input_ids=dec_in,
                   decoder_attention_mask=tgt_mask).logits.float()
    mask = tgt_mask.bool()
    nll = torch.nn.functional.cross_entropy(logits[mask], tgt[mask], reduction="sum")
    return nll / mask.sum() if reduction == "mean" else nll


@torch.no_grad()
def heldout_seq2seq_loss(model, start_id: int, batches) -> float:
    """Mean per-token cross-entropy (nats) of the targets over `batches` of collate_pairs tensors."""
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for batch in batches:
        src, src_mask, tgt, tgt_mask = (x.to(device) for x in batch)
        total += seq2seq_loss(model, start_id, src, src_mask, tgt, tgt_mask, reduction="sum").item()
        count += int(tgt_mask.sum())
    return total / max(count, 1)


def ss_probability(step: int, steps: int, ss_max: float) -> float:
    """Linear from 0 at the first step to ss_max at the last."""
    return ss_max * step / max(steps - 1, 1)


# -- training ---------------------------------------------------------------------------

CHECKPOINT = "pretrain_checkpoint.pt"  # in output_dir while a warm start runs; removed when it ends


# what a --resume may set anew: none of it changes the weights the run ends with (CPU threads do,
# in the last bits: a sum's order) or what its held-out figures are measured on (eval_batches)
RESUME_MAY_CHANGE = ("training.log_every", "training.checkpoint_every")


def pretrain(cfg: dict, log=print, resume: bool = False) -> dict:
    """Trains and saves; returns {"output_dir", "eval_before", "eval_after", "train_loss"}. Saves a
    checkpoint every `training.checkpoint_every` steps; `resume` goes on from it exactly."""
    from agents.models import build_causal_lm, build_seq2seq_lm, decoder_start_id, model_kind
    from agents.resume import warm_start_state

    from env.rewards.base import resolve_device

    t = cfg["training"]
    saved = warm_start_state(cfg, resume, CHECKPOINT, may_change=RESUME_MAY_CHANGE)
    if t["num_threads"]:
        torch.set_num_threads(t["num_threads"])
    device = resolve_device(t["device"])
    torch.manual_seed(cfg["seed"])
    train = load_pairs(cfg, "train")
    held = load_pairs(cfg, cfg["data"]["eval_split"]) if cfg["data"]["eval_split"] else []
    tok = build_tokenizer(cfg, train)
    seq2seq = model_kind(cfg["model"]) == "seq2seq"
    try:
        if seq2seq:
            model = build_seq2seq_lm(cfg["model"], tok, seed=cfg["seed"])
            start_id = decoder_start_id(model)
        else:
            # Room for RL prompts + generations longer than the training texts (a built-in model only).
            model = build_causal_lm(cfg["model"], tok, seed=cfg["seed"], max_positions=max(t["max_len"], 1024))
    except OSError as e:
        raise ValueError(f"model.name_or_path: cannot load {cfg['model']['name_or_path']!r}: {first_line(e)}") from None
    model.to(device)
    sep = cfg["data"]["separator"]
    if seq2seq:
        encode, batch_of = (lambda c, x: encode_pair(tok, c, x, t["max_len"])), collate_pairs

        def evaluate(batches):
            return heldout_seq2seq_loss(model, start_id, batches)
    else:
        encode, batch_of = (lambda c, x: encode_example(tok, c, x, sep, t["max_len"])), collate

        def evaluate(batches):
            return heldout_loss(model, batches)
    train_ex = [encode(c, x) for c, x in train]
    held_ex = [encode(c, x) for c, x in held]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    bs = t["batch_size"]
    held_batches = [batch_of(held_ex[i:i + bs], pad) for i in range(0, len(held_ex), bs)][:t["eval_batches"]]
    eval_before = saved["eval_before"] if saved else evaluate(held_batches) if held_batches else None
    if eval_before is not None and not saved:
        n = min(len(held_ex), bs * t["eval_batches"])  # the examples evaluated (training.eval_batches of them)
        of = f" of the split's {len(held_ex)}" if n < len(held_ex) else ""
        log(f"held-out cross-entropy before: {eval_before:.4f} nats/token ({n} examples{of})")

    optimizer = torch.optim.AdamW(model.parameters(), lr=t["lr"], weight_decay=t["weight_decay"])
    gen = torch.Generator().manual_seed(cfg["seed"])
    order, cursor = torch.randperm(len(train_ex), generator=gen).tolist(), 0
    tokens, seen, start, losses = 0, 0, time.perf_counter(), []
    out = os.path.abspath(os.path.expanduser(cfg["output_dir"]))
    remove_partial_files(out)  # a checkpoint a killed run was writing
    if saved:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        gen.set_state(saved["gen"])
        order, cursor, losses = saved["order"], saved["cursor"], saved["losses"]
        log(f"resumed at step {saved['step']}/{t['steps']} from {os.path.join(out, CHECKPOINT)}")
    for step in range(saved["step"] if saved else 0, t["steps"]):
        if cursor + bs > len(order):  # a new epoch: reshuffle
            order, cursor = torch.randperm(len(train_ex), generator=gen).tolist(), 0
        batch = [train_ex[i] for i in order[cursor:cursor + bs]]
        cursor += bs
        p = ss_probability(step, t["steps"], t["ss_max"])
        model.train()
        if seq2seq:
            src, src_mask, tgt, tgt_mask = (x.to(device) for x in collate_pairs(batch, pad))
            loss = seq2seq_loss(model, start_id, src, src_mask, tgt, tgt_mask, p, gen)
            n_tokens = int(src_mask.sum() + tgt_mask.sum())
        else:
            ids, attn, mask = (x.to(device) for x in collate(batch, pad))
            inputs = scheduled_sampling_inputs(model, ids, attn, mask, p, gen)
            loss = lm_loss(model, inputs, attn, ids, mask)
            n_tokens = int(attn.sum())
        optimizer.zero_grad()
        loss.backward()
        if t["grad_clip"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t["grad_clip"])
        optimizer.step()
        losses.append(loss.item())
        tokens += n_tokens
        seen += 1
        if (step + 1) % t["log_every"] == 0 or step + 1 == t["steps"]:
            elapsed = time.perf_counter() - start
            line = (f"step {step + 1:5d}/{t['steps']}  loss {sum(losses[-seen:]) / seen:.4f}  ss_p {p:.3f}  "
                    f"{tokens / max(elapsed, 1e-9):,.0f} tokens/s")  # since the last line
            if held_batches and step + 1 == t["steps"]:
                line += f"  held-out {evaluate(held_batches):.4f}"
            log(line)
            seen, tokens, start = 0, 0, time.perf_counter()
        if t["checkpoint_every"] and (step + 1) % t["checkpoint_every"] == 0 and step + 1 < t["steps"]:
            os.makedirs(out, exist_ok=True)  # whole, then renamed into place: a kill leaves the last one
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "gen": gen.get_state(),
                     "step": step + 1, "order": order, "cursor": cursor, "losses": losses, "cfg": cfg,
                     "eval_before": eval_before}
            write_whole(os.path.join(out, CHECKPOINT), lambda f: torch.save(state, f))
    eval_after = evaluate(held_batches) if held_batches else None
    if eval_after is not None:
        log(f"held-out cross-entropy after: {eval_after:.4f} nats/token (before: {eval_before:.4f})")

    os.makedirs(out, exist_ok=True)
    model.to("cpu")
    model.config.use_cache = True  # off for training in agents.models; generate() wants it
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = pad
    from agents.core import no_transformers_bars

    no_transformers_bars()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    if os.path.exists(os.path.join(out, CHECKPOINT)):
        os.remove(os.path.join(out, CHECKPOINT))
    return {"output_dir": out, "eval_before": eval_before, "eval_after": eval_after,
            "train_loss": sum(losses[-t["log_every"]:]) / len(losses[-t["log_every"]:])}


def main(argv=None, prog: str = "python -m agents.pretrain") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="YAML file, e.g. tune_configs/pretrain_reviews.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set training.steps=100 (repeatable)")
    parser.add_argument("--resume", action="store_true", help="go on from the checkpoint an interrupted run left "
                        "in output_dir (training.checkpoint_every)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        cfg = load_config(args.config, args.overrides)
        from agents.models import check_local_path

        check_local_path("model.name_or_path", cfg["model"]["name_or_path"])
        check_local_path("model.tokenizer", cfg["model"]["tokenizer"])
        result = pretrain(cfg, log=lambda line: print(line, flush=True), resume=args.resume)
    except (ConfigError, DataError, ValueError, OSError) as e:
        print(f"error: {first_line(e)}", file=sys.stderr)
        return 2
    print(f"saved model and tokenizer to {result['output_dir']}")
    return 0


if __name__ == "__main__":
    from agents import exit_with

    exit_with(main())
