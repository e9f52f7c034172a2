"""Evaluate policies side by side on a task's test split, and plot training curves.

    python -m agents.evaluate MODEL [MODEL ...] [--config RL.yaml] [--split test] [--greedy]
                              [--num-samples N] [--max-examples N] [--reference PATH] [--device cuda]
                              [--precision bf16] [--out DIR]
    python -m agents.evaluate --curves RUN [RUN ...] [--metric NAME ...] [--out DIR]

A MODEL is a checkpoint written by `agents.train` (or the RLModule directory in it) or a Hugging
Face model directory (`agents.pretrain`, `agents.export`), causal or encoder-decoder (the prompt is
then the encoder's input, as in training). Every model writes continuations for the same prompts,
through the same token env, decoded greedily or sampled (a checkpoint samples with its own
truncation sampler). The task, the prompt and generation lengths come from `--config` (an RL YAML),
else from the first checkpoint. The table has one row per model: every metric of the task (its
reward, and each term of a summed reward), the perplexity of the generations (after their prompts;
for an encoder-decoder reference, given them as source) under a reference LM (`--reference`, default
the first model; always with fp32 weights, whatever `--precision` the models decode in), distinct-1
and distinct-2 (unique n-grams / all n-grams of the model's generations, words split on whitespace),
and the mean length in words. A second table breaks the task metrics down by prompt difficulty: for
sentiment tasks the prompt's own VADER compound score in terciles (as in RLGF), for other tasks the
prompt's length in words. Both tables are printed and written to DIR as `evaluation.csv` and
`evaluation.md`; the generations go to `generations.jsonl`.

`--curves` plots, for each `--metric` (default `episode_return_mean`), one PNG of the
metric against the training iteration with one line per trial found under the RUN
directories (a trial directory, or an experiment directory holding several), read
from each trial's `result.json` (else `progress.csv`).

Bad input (a missing model or run, an unknown metric, a config error) stops with one
line naming it, exit code 2; a wrong flag, MODEL or RUN path before torch, transformers or RLlib
are imported (they are imported where they are needed).
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys

import numpy as np

from agents.curves import EvalError, find_trials, plot_curves
from agents.eval_report import markdown_summary, write_results
from agents.saved_policy import RunDirectoryError, find_module_dir
from env.validation import first_line

SENTIMENT_REWARDS = ("sentiment", "vader")


# -- models -------------------------------------------------------------------------------

class HFPolicy:
    """A plain causal LM behind the RLModule call `generate` uses: next-token logits per observation."""

    def __init__(self, lm):
        self.lm = lm.eval()

    def parameters(self):  # where `generate` puts the observations
        return self.lm.parameters()

    def forward_inference(self, batch):
        from ray.rllib.core.columns import Columns

        from agents.modules.actor_critic import hidden_at_last_token

        hidden = hidden_at_last_token(self.lm.base_model, batch[Columns.OBS])
        return {Columns.ACTION_DIST_INPUTS: self.lm.get_output_embeddings()(hidden)}


class HFSeq2SeqPolicy(HFPolicy):
    """A plain encoder-decoder LM behind the same call: the decoder's next-token logits for the
    source (encoder side) and the tokens generated so far, computed as the seq2seq RLModule does."""

    def __init__(self, lm):
        from agents.models import decoder_start_id
        from agents.modules.seq2seq import check_windowed_logits

        self.lm = lm.eval()
        self.start_id = decoder_start_id(lm)
        check_windowed_logits(lm, self.start_id)

    def forward_inference(self, batch):
        from ray.rllib.core.columns import Columns

        from agents.modules.seq2seq import decoder_hidden, lm_logits

        return {Columns.ACTION_DIST_INPUTS: lm_logits(self.lm, decoder_hidden(self.lm, batch[Columns.OBS], self.start_id))}


class Model:
    """One model to evaluate: its policy, LM, tokenizer and (for checkpoints) its env config."""

    def __init__(self, path: str, name: str | None = None):
        from agents.models import is_encoder_decoder

        self.path = os.path.abspath(os.path.expanduser(path))
        self.kind = model_kind(path)
        self.name = name or _short_name(self.path)
        if self.kind == "checkpoint":
            from agents.generate import load_policy

            try:
                self.policy = load_policy(self.path)
            except ValueError as e:  # files cut short or corrupted; MODEL is positional, not --checkpoint
                raise EvalError(str(e).removeprefix("--checkpoint: ")) from None
            self.lm, self.tokenizer = self.policy.lm, self.policy.tokenizer
            self.env_config = dict(self.policy.model_config["env"])
            self.tokenizer_spec = self.env_config.get("tokenizer")
        else:
            from agents.model_edits import disable_dropout, mask_padded_vocabulary
            from agents.models import load_pretrained_lm
            from env.tokenization import load_tokenizer

            try:
                self.lm = load_pretrained_lm(self.path)  # a plain model, or a LoRA adapter merged into its base
                seq2seq = is_encoder_decoder(self.lm)
                self.tokenizer = load_tokenizer(self.path)
                disable_dropout(self.lm)
                mask_padded_vocabulary(self.lm, len(self.tokenizer))  # draws only the tokenizer's tokens
                self.policy = HFSeq2SeqPolicy(self.lm) if seq2seq else HFPolicy(self.lm)
            except (OSError, ValueError) as e:
                raise EvalError(f"{path}: cannot load the model or its tokenizer: {first_line(e)}") from None
            self.env_config, self.tokenizer_spec = None, self.path
        self.seq2seq = is_encoder_decoder(self.lm)

    def to(self, device: str) -> "Model":
        """The model's policy and LM (one set of weights) on `device`."""
        (self.policy if self.kind == "checkpoint" else self.lm).to(device)
        return self

    def decoding(self, precision: str):
        """The policy that writes the generations: the model's own in fp32; in bf16 a copy with its
        weights (and a checkpoint's KV cache) in bf16, so the model's LM, which scores perplexity
        when it is the reference, keeps its fp32 weights."""
        if precision == "fp32":
            return self.policy
        import torch

        from agents.generate import decode_in

        policy = copy.deepcopy(self.policy)
        if self.kind == "checkpoint":
            return decode_in(policy, precision)
        policy.lm.to(torch.bfloat16)
        return policy


def model_kind(path: str) -> str:
    """What a MODEL path is: "checkpoint" (from agents.train) or "hf" (a Hugging Face model or LoRA
    adapter directory); else an EvalError naming it. The standard library only: the command line
    checks every path with it before it imports torch."""
    where = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(where):
        raise EvalError(f"{path}: no such checkpoint or model directory")
    try:
        find_module_dir(where)
        return "checkpoint"
    except FileNotFoundError as e:
        not_a_checkpoint = e
    if not any(os.path.isfile(os.path.join(where, f)) for f in ("config.json", "adapter_config.json")):
        if isinstance(not_a_checkpoint, RunDirectoryError):  # MODEL is positional, not --checkpoint
            raise EvalError(str(not_a_checkpoint).removeprefix("--checkpoint: "))
        raise EvalError(f"{path}: neither a checkpoint from agents.train nor a model directory "
                        "(no config.json or adapter_config.json)")
    return "hf"


def _short_name(path: str) -> str:
    parts = path.rstrip(os.sep).split(os.sep)
    if parts[-1].startswith("checkpoint_") and len(parts) > 1:
        return f"{parts[-2].split('_')[0]}/{parts[-1]}"  # e.g. LMPPO/checkpoint_000002
    return parts[-1]


# -- generation -----------------------------------------------------------------------------

def rollout(policy, env_config: dict, examples: list[dict], *, greedy: bool, seed: int = 0,
            batch_size: int = 64) -> list[str]:
    """One generation per example through agents.generate's decode loop (the same prompt cut,
    EOS and decoding as in training; row i samples from a generator seeded with seed + i)."""
    from agents.generate import generate

    results = generate(policy, env_config, [ex["prompt"] for ex in examples], metas=[ex["meta"] for ex in examples],
                       greedy=greedy, seed=seed, score=False, batch_size=batch_size)
    return [r["generation"] for r in results]


# -- metrics --------------------------------------------------------------------------------

def distinct_n(generations: list[str], n: int) -> float:
    """Unique n-grams over all n-grams of the generations (words split on whitespace); 0 if none."""
    grams = [tuple(words[i:i + n]) for g in generations for words in [g.split()] for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def perplexity(lm, tokenizer, prompts: list[str], generations: list[str], batch_size: int = 32) -> float:
    """exp(mean negative log-likelihood per token) of the generations after their prompts under `lm`,
    over all generated tokens together; empty generations add no tokens (nan if all are empty)."""
    from agents.models import decoder_start_id, is_encoder_decoder
    from env.rewards.hf import encode, target_logprobs

    lm.eval()
    targets = [encode(tokenizer, g) for g in generations]
    contexts = [encode(tokenizer, p) for p in prompts]
    if is_encoder_decoder(lm):  # the prompt is the source; the warm start's held-out loss scores it
        from agents.pretrain import collate_pairs, heldout_seq2seq_loss

        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        pairs = [(c or [pad], t) for c, t in zip(contexts, targets) if t]
        if not pairs:
            return float("nan")
        batches = [collate_pairs(pairs[i:i + batch_size], pad) for i in range(0, len(pairs), batch_size)]
        return math.exp(heldout_seq2seq_loss(lm, decoder_start_id(lm), batches))
    scored = target_logprobs(lm, tokenizer, contexts, targets, batch_size)
    n = sum(len(lp) for lp in scored)
    return math.exp(-sum(sum(lp) for lp in scored) / n) if n else float("nan")


def task_metrics(task, split: str) -> list[tuple[str, object]]:
    """(name, reward) for every metric of the task: its reward, and each term of a summed one."""
    from env.rewards import make_reward
    from env.tasks.text_tasks import _needs_corpus, _with_corpus

    spec = getattr(task, "reward_spec", None)
    if not isinstance(spec, dict) or "sum" not in spec:
        name = spec["name"] if isinstance(spec, dict) else getattr(task, "metrics", ("reward",))[0]
        return [(name, lambda p, g, m: task.reward(p, g, m))]
    metrics = [("reward", lambda p, g, m: task.reward(p, g, m))]
    corpus = None
    for i, term in enumerate(spec["sum"]):
        term = {k: v for k, v in term.items() if k != "weight"}
        if _needs_corpus(term):
            from env.rewards import references_of

            corpus = corpus or [references_of(ex["meta"]) for ex in task.examples(split)]
            term = _with_corpus(term, corpus)
        name = term["name"]
        if any(n == name for n, _ in metrics):
            name = f"{name}_{i}"
        metrics.append((name, make_reward(term, path=f"task.reward.sum[{i}]")))
    return metrics


def is_sentiment_task(task) -> bool:
    spec = getattr(task, "reward_spec", None)
    names = [t.get("name") for t in spec["sum"]] if isinstance(spec, dict) and "sum" in spec else \
        [spec.get("name") if isinstance(spec, dict) else spec]
    return task.name == "imdb" or any(n in SENTIMENT_REWARDS for n in names)


def difficulty(task, prompts: list[str]) -> tuple[str, list[float]]:
    """(what, score per prompt): the prompt's VADER compound for sentiment tasks, else its length."""
    if is_sentiment_task(task):
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        analyzer = SentimentIntensityAnalyzer()
        return "prompt VADER compound", [analyzer.polarity_scores(p)["compound"] for p in prompts]
    return "prompt length (words)", [float(len(p.split())) for p in prompts]


def terciles(scores: list[float]) -> tuple[list[int], list[str]]:
    """Bucket 0/1/2 per score, cut at the 1/3 and 2/3 quantiles (ties stay together), and labels."""
    lo, hi = np.quantile(scores, [1 / 3, 2 / 3]) if scores else (0.0, 0.0)
    buckets = [0 if s <= lo else 1 if s <= hi else 2 for s in scores]
    labels = [f"low (<= {lo:.3g})", f"mid ({lo:.3g}, {hi:.3g}]", f"high (> {hi:.3g})"]
    return buckets, labels


def check_prompt_words(model: Model, examples: list[dict], split: str) -> None:
    """Prompt words `model`'s word-level tokenizer lacks, which it reads as its unknown token (EOS
    for the project's own): most of them (a checkpoint of another task or vocabulary) is refused in
    one line; a few (words a vocabulary built from the training split never saw) get a note."""
    from env.tokenization import is_word_level, unknown_words

    if not is_word_level(model.tokenizer):
        return
    bad = [(i, words) for i, ex in enumerate(examples) if (words := unknown_words(model.tokenizer, ex["prompt"]))]
    if not bad:
        return
    unknown, total = sum(len(words) for _, words in bad), sum(len(ex["prompt"].split()) for ex in examples)
    what = (f"{model.name}: its tokenizer does not know {unknown:,} of the {total:,} words of split {split!r}'s "
            f"prompts (the first: {bad[0][1][0]!r} in prompt {bad[0][0] + 1}); it reads each as its unknown token")
    if 2 * unknown > total:
        raise EvalError(f"{what}. Is it a model of another task? Give --config with its own")
    print(f"note: {what}", file=sys.stderr)


# -- the evaluation -----------------------------------------------------------------------------

GREEDY_SAMPLES = (  # greedy copies of one generation would count in n and divide distinct-n
    "--num-samples: greedy decoding gives one generation per prompt (the same each time), so {} would only "
    "repeat it; give --num-samples 1 or sample (drop --greedy)")


def evaluate(models: list[Model], env_config: dict, *, split: str = "test", greedy: bool = False,
             num_samples: int = 1, max_examples: int | None = None, reference: Model | None = None,
             seed: int = 0, precision: str = "fp32", log=print) -> dict:
    """Runs every model over the split, decoding with its weights in `precision` (perplexity in
    fp32 whatever it is); returns {"columns", "rows", "breakdown_columns",
    "breakdown", "generations", "difficulty"}. A `precision` other than fp32 or bf16 (or bf16 on
    a GPU without it) is refused with one line."""
    from agents.generate import check_precision
    from agents.train import positions_error
    from env.tasks import make_task
    from env.text_env import TokenGenerationEnv

    if not models:
        raise EvalError("models: none given")
    if greedy and num_samples > 1:
        raise EvalError(GREEDY_SAMPLES.format(num_samples))
    for device in dict.fromkeys(str(next(m.lm.parameters()).device) for m in models):  # each GPU the models are on
        if error := check_precision(precision, device):
            raise EvalError(error.removeprefix("--"))

    task = make_task(env_config["task"], max_new_tokens=env_config["max_new_tokens"])
    examples = task.examples(split)[:max_examples]
    if not examples:
        raise EvalError(f"task {task.name!r}: split {split!r} has no examples")
    examples = [ex for ex in examples for _ in range(num_samples)]
    metrics = task_metrics(task, split)
    reference = reference or models[0]
    rows, breakdown, all_gens = [], [], []
    prompts = buckets = labels = what = None
    cfgs = [{**env_config, "split": split, "tokenizer": m.tokenizer_spec, "encoder_decoder": m.seq2seq} for m in models]
    for model, cfg in zip(models, cfgs):  # each model's lengths and words, before any model generates
        check_prompt_words(model, examples[::num_samples], split)
        if not model.seq2seq and (error := positions_error(model.lm.config, TokenGenerationEnv(cfg).seq_len, model.name)):
            raise EvalError(error)
    for model, cfg in zip(models, cfgs):
        gens = rollout(model.decoding(precision), cfg, examples, greedy=greedy, seed=seed)
        if prompts is None:  # the prompts as the env cut them (identical for every model)
            env = TokenGenerationEnv(cfg)
            prompts = [env.reset(options={"prompt": ex["prompt"]})[1]["prompt"] for ex in examples]
            what, scores = difficulty(task, prompts)
            buckets, labels = terciles(scores)
        metas = [ex["meta"] for ex in examples]
        values = {name: [float(v) for v in fn(prompts, gens, metas)] for name, fn in metrics}
        row = {"model": model.name, "n": len(gens)}
        row.update({name: float(np.mean(v)) for name, v in values.items()})
        row["perplexity"] = perplexity(reference.lm, reference.tokenizer, prompts, gens)
        row["distinct_1"], row["distinct_2"] = distinct_n(gens, 1), distinct_n(gens, 2)
        row["mean_words"] = float(np.mean([len(g.split()) for g in gens]))
        rows.append(row)
        for b, label in enumerate(labels):
            idx = [i for i, x in enumerate(buckets) if x == b]
            if not idx:  # e.g. every prompt equally long: one bucket, not two empty rows of nan
                continue
            entry = {"model": model.name, "bucket": label, "n": len(idx)}
            entry.update({name: float(np.mean([v[i] for i in idx])) for name, v in values.items()})
            breakdown.append(entry)
        all_gens.extend({"model": model.name, "prompt": p, "generation": g,
                         **{name: v[i] for name, v in values.items()}}
                        for i, (p, g) in enumerate(zip(prompts, gens)))
        log(f"evaluated {model.name}: {len(gens)} generations")
    names = [name for name, _ in metrics]
    return {"columns": ["model", "n", *names, "perplexity", "distinct_1", "distinct_2", "mean_words"],
            "rows": rows, "breakdown_columns": ["model", "bucket", "n", *names], "breakdown": breakdown,
            "generations": all_gens, "difficulty": what, "reference": reference.name,
            "decoding": "greedy" if greedy else "sampled", "precision": precision, "split": split}


# -- CLI ---------------------------------------------------------------------------------------

def resolve_env_config(config_path: str | None, overrides: list[str], models: list[Model]) -> dict:
    if config_path:
        from agents.config import ConfigError, env_config, load

        try:
            return env_config(load(config_path, overrides))
        except ConfigError as e:
            raise EvalError(str(e)) from None
    if overrides:  # they would be dropped: a checkpoint's settings are its own
        raise EvalError(f"--set: changes --config's values, and no --config was given (a checkpoint's task and "
                        f"lengths are its own; give an RL YAML with --config to change them): {overrides[0]}")
    for model in models:
        if model.env_config is not None:
            return model.env_config
    raise EvalError("--config: needed to know the task (no checkpoint among the models)")


def main(argv=None, prog: str = "python -m agents.evaluate") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", metavar="MODEL", help="checkpoints or Hugging Face model directories")
    parser.add_argument("--config", help="RL YAML giving the task and lengths (default: the first checkpoint's)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a value of --config (repeatable)")
    parser.add_argument("--names", nargs="+", help="a row name per model (default: from the paths)")
    parser.add_argument("--split", default="test")
    parser.add_argument("--greedy", action="store_true", help="argmax decoding (default: sampling)")
    parser.add_argument("--num-samples", type=int, default=1, help="generations per prompt (default 1)")
    parser.add_argument("--max-examples", type=int, help="use the split's first N prompts")
    parser.add_argument("--reference", help="LM for perplexity: a model directory or checkpoint (default: the first model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch CPU threads (tiny models on a busy machine: 1 is fastest)")
    parser.add_argument("--device", default="cpu", help="where the models generate and the reference LM computes "
                        "perplexity: cpu (default) or cuda[:N] (reward models keep their own reward.device)")
    parser.add_argument("--precision", default="fp32", help="the models' weights while they generate: fp32 (default) "
                        "or bf16 (a bf16 copy of each; perplexity stays fp32)")
    parser.add_argument("--curves", nargs="+", metavar="RUN", help="trial or experiment directories to plot")
    parser.add_argument("--metric", action="append", help="metric to plot (repeatable; default episode_return_mean)")
    parser.add_argument("--out", default="results/evaluation", help="output directory (default results/evaluation)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not args.models and not args.curves:
        parser.error("give models to evaluate, --curves RUN, or both")
    try:
        from agents.generate import check_device, check_device_name, check_precision, check_seed, use_device
        from env.validation import directory_error

        # The flags and paths first, with the standard library alone (a wrong one is refused at once),
        # then what needs torch: the device's presence, its bf16.
        for error in (directory_error("--out", args.out), check_seed(args.seed),
                      check_device_name(args.device) or check_precision(args.precision, "cpu")):  # the names alone
            if error:
                raise EvalError(error)
        if args.threads is not None and args.threads < 1:
            raise EvalError(f"--threads: expected an integer >= 1, got {args.threads}")
        if args.metric and not args.curves:
            raise EvalError("--metric: chooses what --curves plots; give --curves RUN")
        if args.overrides and not args.config:
            resolve_env_config(None, args.overrides, [])  # refused: a checkpoint's settings are its own
        if args.num_samples < 1:
            raise EvalError(f"--num-samples: expected an integer >= 1, got {args.num_samples}")
        if args.greedy and args.num_samples > 1:
            raise EvalError(GREEDY_SAMPLES.format(args.num_samples))
        if args.max_examples is not None and args.max_examples < 1:
            raise EvalError(f"--max-examples: expected an integer >= 1, got {args.max_examples}")
        if args.names and len(args.names) != len(args.models):
            raise EvalError(f"--names: {len(args.names)} names for {len(args.models)} models")
        names = [n or _short_name(os.path.abspath(os.path.expanduser(p)))
                 for p, n in zip(args.models, args.names or [None] * len(args.models))]  # Model's names
        twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if twice is not None:  # their rows would be one
            raise EvalError(f"--names: {twice!r} names two models" + ("" if args.names else
                                                                     " (their paths end alike); give --names"))
        for path in args.models:
            model_kind(path)
        if args.reference:
            try:
                model_kind(args.reference)
            except EvalError as e:
                raise EvalError(f"--reference: {e}") from None
        for run in args.curves or []:
            find_trials(run)
        error = check_device(args.device) or check_precision(args.precision, args.device)
        if error:
            raise EvalError(error)
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        if args.models:
            from agents.core import no_transformers_bars  # torch and transformers: for the models alone

            no_transformers_bars()
            # --config (and its --set) checked before the models load
            env_cfg = resolve_env_config(args.config, args.overrides, []) if args.config else None
            use_device(args.device)
            models = [Model(p, n).to(args.device) for p, n in zip(args.models, names)]
            env_cfg = env_cfg or resolve_env_config(None, [], models)
            reference = Model(args.reference).to(args.device) if args.reference else None
            result = evaluate(models, env_cfg, split=args.split, greedy=args.greedy, num_samples=args.num_samples,
                              max_examples=args.max_examples, reference=reference, seed=args.seed,
                              precision=args.precision)
            paths = write_results(result, args.out)
            print(markdown_summary(result))
            print(f"wrote {paths['csv']}, {paths['md']} and {paths['generations']}")
        if args.curves:
            for path in plot_curves(args.curves, args.metric or ["episode_return_mean"], args.out):
                print(f"wrote {path}")
    except (EvalError, ValueError, OSError) as e:
        print(f"error: {first_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from agents import exit_with

    exit_with(main())
