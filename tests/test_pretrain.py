"""Supervised warm start (agents/pretrain.py) on a tiny corpus written here; no network."""

import pytest
import torch

from agents.config import ConfigError
from agents.pretrain import (collate, encode_example, lm_loss, load_pairs, main, pretrain,
                             scheduled_sampling_inputs, ss_probability, validate)
from env.tasks.review_corpus import review_corpus
from tests.conftest import one_line_cli_error, run_module, write_jsonl


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    return {"train": write_jsonl(root / "train.jsonl", review_corpus(400, seed=0)),
            "validation": write_jsonl(root / "validation.jsonl", review_corpus(40, seed=1))}


def config(corpus, out, **training):
    return validate({"output_dir": str(out), "data": {"dataset": corpus},
                     "training": {"steps": 60, "batch_size": 16, "lr": 3e-3, "max_len": 40, "log_every": 20,
                                  "num_threads": 1, **training}})


@pytest.fixture(scope="module")
def warm_start(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("warm") / "model"
    lines = []
    result = pretrain(config(corpus, out, ss_max=0.2), log=lines.append)
    return result, lines


def test_pretraining_lowers_held_out_cross_entropy_and_saves_a_loadable_dir(warm_start, corpus):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result, lines = warm_start
    assert result["eval_after"] < result["eval_before"] - 1.0  # from ~log(V) = 4 nats to well below
    assert any(line.startswith("step    20/60  loss") and "tokens/s" in line for line in lines)
    assert lines[0].startswith("held-out cross-entropy before: ") and lines[0].endswith(" (40 examples)")
    model = AutoModelForCausalLM.from_pretrained(result["output_dir"])
    tok = AutoTokenizer.from_pretrained(result["output_dir"])
    text = "the film was very good . i loved it ."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and tok.eos_token_id not in ids  # every corpus word is in the vocabulary
    # The saved model scores held-out text as the trained one did.
    cfg = config(corpus, result["output_dir"])
    held = [encode_example(tok, c, x, None, 40) for c, x in load_pairs(cfg, "validation")]
    ids, attn, mask = collate(held[:16], tok.pad_token_id)
    with torch.no_grad():
        assert lm_loss(model, ids, attn, ids, mask).item() < result["eval_before"] - 1.0


def test_an_rl_config_starts_from_the_saved_dir(warm_start, corpus):
    """model.name_or_path: <dir> gives the env its tokenizer and the policy its weights."""
    from transformers import AutoModelForCausalLM

    from agents.config import env_config
    from agents.config import validate as validate_rl
    from agents.models import build_causal_lm, build_tokenizer
    from env.text_env import TokenGenerationEnv

    out = warm_start[0]["output_dir"]
    cfg = validate_rl({"task": {"name": "imdb", "dataset": corpus, "prompt_words": 4}, "model": {"name_or_path": out},
                       "env": {"max_prompt_len": 6, "max_new_tokens": 8}})
    env = TokenGenerationEnv(env_config(cfg))
    _, info = env.reset(seed=0)
    assert len(info["prompt"].split()) == 4 and env.vocab_size == len(build_tokenizer(env_config(cfg)))
    lm = build_causal_lm(cfg["model"], env.tokenizer)
    saved = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(a, b) for a, b in zip(lm.state_dict().values(), saved.state_dict().values()))


def test_a_checkpoint_refuses_its_warm_start_gone_or_written_again_with_another_vocabulary(warm_start, corpus,
                                                                                               tmp_path):
    """A policy is rebuilt with its model directory's config and reads tokens through its tokenizer:
    with that directory moved, or its tokenizer changed (pretrain run again into it on other data),
    loading the checkpoint is refused in one line naming the directory, not decoded through
    another vocabulary."""
    import json
    import shutil

    import yaml

    from agents.generate import load_policy
    from agents.serve.launch import untrained_checkpoint

    base = tmp_path / "warm"
    shutil.copytree(warm_start[0]["output_dir"], base)
    rl = tmp_path / "rl.yaml"
    rl.write_text(yaml.safe_dump({"task": {"name": "imdb", "dataset": corpus, "prompt_words": 4},
                                  "model": {"name_or_path": str(base)}, "env": {"max_prompt_len": 6, "max_new_tokens": 8}}))
    checkpoint = untrained_checkpoint(str(rl), str(tmp_path / "checkpoint"))
    load_policy(checkpoint)  # as trained
    (base / "config.json").write_text(json.dumps({**json.loads((base / "config.json").read_text()),
                                                  "transformers_version": "0.0.1"}))
    tok_config = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps({**tok_config, "local_files_only": True}, indent=4))
    load_policy(checkpoint)  # saved again by another transformers, offline: the same model and tokens
    tokenizer = json.loads((base / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[5:7]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two words' ids swapped
    (base / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match=rf"^--checkpoint: {base} \(model.name_or_path or env.tokenizer\) has changed "
                                         "since this policy was trained"):
        load_policy(checkpoint)
    shutil.rmtree(base)
    with pytest.raises(ValueError, match=rf"^--checkpoint: this policy was trained from {base} .* which no longer "
                                         "exists"):
        load_policy(checkpoint)


def test_ss_probability_is_linear_from_zero_to_ss_max():
    assert [ss_probability(i, 5, 0.4) for i in range(5)] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])


def _tiny_batch():
    from transformers import GPT2Config, GPT2LMHeadModel

    from env.tokenization import word_level_tokenizer

    tok = word_level_tokenizer("a b c d e f g h".split())
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=32, n_layer=1, n_head=2, n_embd=16,
                                       bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id))
    model.eval()  # no dropout, as agents.models builds every policy
    examples = [encode_example(tok, "a b", "c d e f g", None, 32), encode_example(tok, "", "h g f e d c b", None, 32)]
    return model, collate(examples, tok.pad_token_id)


def test_scheduled_sampling_at_zero_is_teacher_forcing_exactly():
    model, (ids, attn, mask) = _tiny_batch()
    inputs = scheduled_sampling_inputs(model, ids, attn, mask, 0.0, torch.Generator().manual_seed(0))
    assert torch.equal(inputs, ids)
    assert lm_loss(model, inputs, attn, ids, mask).item() == lm_loss(model, ids, attn, ids, mask).item()
    labels = torch.where(mask.bool(), ids, -100)  # the transformers loss over the same tokens
    assert lm_loss(model, ids, attn, ids, mask).item() == pytest.approx(
        model(input_ids=ids, attention_mask=attn, labels=labels).loss.item(), rel=1e-6)


def test_scheduled_sampling_at_one_feeds_the_models_own_tokens():
    model, (ids, attn, mask) = _tiny_batch()
    seen = []
    hook = model.transformer.wte.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].clone()))
    inputs = scheduled_sampling_inputs(model, ids, attn, mask, 1.0, torch.Generator().manual_seed(3))
    loss = lm_loss(model, inputs, attn, ids, mask)
    hook.remove()
    assert torch.equal(seen[0], ids) and torch.equal(seen[1], inputs)  # a teacher-forced pass, then the mixed one
    # Direct computation: every target token after the first is a draw from the model's
    # teacher-forced distribution at the position before it (one uniform per position from the
    # seeded generator, inverting the cumulative distribution); the rest is the data.
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=ids, attention_mask=attn).logits[:, :-1].float(), -1)
    probs = probs.reshape(-1, probs.shape[-1]).double()
    uniform = torch.rand(len(probs), dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    cdf = probs.cumsum(-1)
    expected = torch.stack([torch.searchsorted(c, u * c[-1], right=True) for c, u in zip(cdf, uniform)])
    expected = expected.clamp(max=probs.shape[-1] - 1).view(ids.shape[0], -1)
    feedable = (mask[:, 1:] == 1) & (mask[:, :-1] == 1)
    assert torch.equal(inputs[:, 1:][feedable], expected[feedable])
    assert torch.equal(inputs[:, 1:][~feedable], ids[:, 1:][~feedable]) and torch.equal(inputs[:, 0], ids[:, 0])
    assert not torch.equal(inputs, ids)
    assert loss.item() != lm_loss(model, ids, attn, ids, mask).item()


def test_backward_model_trains_on_target_to_source(tmp_path):
    pairs = [{"src": f"a{i} b{i}", "tgt": f"c{i} d{i} e{i}"} for i in range(20)]
    path = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    raw = {"output_dir": str(tmp_path / "bwd"), "backward": True,
           "data": {"dataset": {"train": path}, "source_field": "src", "target_field": "tgt", "eval_split": None},
           "training": {"steps": 3, "batch_size": 4, "num_threads": 1}}
    cfg = validate(raw)
    assert load_pairs(cfg, "train")[:2] == [("c0 d0 e0", "a0 b0"), ("c1 d1 e1", "a1 b1")]
    assert load_pairs(validate({**raw, "backward": False}), "train")[0] == ("a0 b0", "c0 d0 e0")
    result = pretrain(cfg, log=lambda line: None)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(result["output_dir"])
    ids, mask = encode_example(tok, *load_pairs(cfg, "train")[0], None, 32)
    # The context is the target, the loss falls on the source and EOS.
    assert tok.decode([t for t, m in zip(ids, mask) if not m]) == "c0 d0 e0"
    assert [t for t, m in zip(ids, mask) if m] == tok("a0 b0", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


# -- bad input: one line naming the field or file, exit code 2 --------------------------------

@pytest.mark.parametrize("raw,message", [
    ({"data": {"dataset": "x.jsonl"}}, r"^output_dir: missing"),
    ({"output_dir": "o", "trainig": {}}, r"^trainig: unknown key \(did you mean 'training'\?\)"),
    ({"output_dir": "o", "training": {"stpes": 3}}, r"^training\.stpes: unknown key \(did you mean 'steps'\?\)"),
    ({"output_dir": "o", "training": {"ss_max": 1.5}}, r"^training\.ss_max: expected a number in \[0\.0, 1\.0\]"),
    ({"output_dir": "o", "data": {"dataset": "x.jsonl", "source_field": "s"}}, r"^data\.target_field: give both"),
    ({"output_dir": "o", "backward": True, "data": {"dataset": "x.jsonl"}}, r"^backward: needs pairs"),
    ({"output_dir": "o", "data": {"dataset": 3}}, r"^data\.dataset: expected a hub name"),
    pytest.param({"output_dir": "o", "data": {"dataset": "x.jsonl"}, "training": {"device": "cuda"}},
                 r"^training\.device: cuda, but torch sees no CUDA device", marks=pytest.mark.skipif(
                     __import__("torch").cuda.is_available(), reason="a CUDA device is here")),
    ({"output_dir": __file__, "data": {"dataset": "x.jsonl"}}, r"^output_dir: .*test_pretrain\.py is a file, not a directory$"),
])
def test_config_mistakes_name_the_field(raw, message):
    with pytest.raises(ConfigError, match=message):
        validate(raw)


def _cli_error(capsys, *argv):
    return one_line_cli_error(capsys, main, *argv)


def test_cli_bad_input_is_one_line(tmp_path, corpus, capsys):
    assert _cli_error(capsys, str(tmp_path / "nope.yaml")).endswith("nope.yaml: no such config file")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"output_dir: {tmp_path / 'out'}\ndata:\n  dataset: {{train: {empty}}}\n  eval_split: null\n")
    err = _cli_error(capsys, str(cfg))
    assert str(empty) in err and "empty" in err
    cfg.write_text(f"output_dir: {tmp_path / 'out'}\ndata:\n  dataset: {{train: {corpus['train']}}}\n"
                   f"  text_field: review\n  eval_split: null\n")
    err = _cli_error(capsys, str(cfg))
    assert "missing field 'review'" in err and "set data.text_field" in err and corpus["train"] in err
    err = _cli_error(capsys, str(cfg), "--set", "data.text_field=text", "--set", "model.name_or_path=no-such/model-4711")
    assert err.startswith("error: model.name_or_path: cannot load a tokenizer from 'no-such/model-4711'")
    err = _cli_error(capsys, str(cfg), "--set", "data.text_field=text", "--set", "data.eval_split=validation")
    assert err.startswith("error: data.dataset: no file for split 'validation'") and "data.eval_split: null" in err
    err = _cli_error(capsys, str(cfg), "--set", "training.lr=-1")
    assert err.startswith("error: training.lr: expected a number > 0.0, got -1")
    err = _cli_error(capsys, str(cfg), "--set", "data.text_field=text", "--set", "model.overrides={n_embd: 0}")
    assert err == "error: model.overrides.n_embd: expected an integer >= 1, got 0"
    # a word-level tokenizer that lacks the data's words would train them as its unknown token (EOS)
    from env.tokenization import word_level_tokenizer

    word_level_tokenizer(["the", "film", "was"]).save_pretrained(tmp_path / "few_words")
    err = _cli_error(capsys, str(cfg), "--set", "data.text_field=text", "--set", f"model.tokenizer={tmp_path / 'few_words'}")
    assert err.startswith("error: model.tokenizer: its tokenizer does not know words of ")
    assert "of the 400 training examples (the first: " in err and "in example 1)" in err


@pytest.mark.slow
def test_cli_runs_and_ends_with_the_output_dir(tmp_path, corpus):
    cfg = tmp_path / "c.yaml"
    out = tmp_path / "out"
    cfg.write_text(f"output_dir: {out}\ndata:\n  dataset: {{train: {corpus['train']}, validation: {corpus['validation']}}}\n"
                   "training: {steps: 4, batch_size: 8, log_every: 2, num_threads: 1, eval_batches: 2}\n")
    run = run_module("agents.pretrain", str(cfg), timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert lines[0].endswith(" nats/token (16 examples of the split's 40)"), lines[0]  # 2 batches of 8
    assert lines[-1] == f"saved model and tokenizer to {out}"
    assert sum(line.startswith("step ") and "tokens/s" in line for line in lines) == 2
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    bad = run_module("agents.pretrain", str(cfg), "--set", "training.steps=0", timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: training.steps: expected an integer >= 1, got 0"


def test_a_subword_tokenizers_unknown_pieces_are_a_note_not_an_error(capsys):
    """T5's and BERT's tokenizers encode some symbols as their unknown token, as their models were
    trained: pretraining goes on with a note; a word-level tokenizer losing whole words is refused."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from agents.pretrain import check_known_words
    from env.tokenization import word_level_tokenizer

    vocab = {"[UNK]": 0, "the": 1, "film": 2, "##s": 3, "was": 4, "good": 5}
    core = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]")
    pairs = [("", "the films was good"), ("", "the film was good {}")]
    check_known_words(wordpiece, pairs, "model.tokenizer")
    assert capsys.readouterr().err == ("note: model.tokenizer: its tokenizer does not know words of 1 of the 2 "
                                       "training examples (the first: '{}' in example 2); they train as its unknown token\n")
    with pytest.raises(ValueError, match=r"^model\.tokenizer: its tokenizer does not know words of 1 of the 2 .*'\{\}'"):
        check_known_words(word_level_tokenizer(["the", "film", "films", "was", "good"]), pairs, "model.tokenizer")


def test_scheduled_sampling_draws_the_same_tokens_in_chunks_of_rows(monkeypatch):
    """`sample_rows` holds the cumulative sums of a few rows at a time (GPT-2's vocabulary over a
    whole batch of positions would be gigabytes in float64); the chunks change nothing drawn."""
    from agents import pretrain, samplers

    probs = torch.softmax(3 * torch.randn(50, 7, generator=torch.Generator().manual_seed(0)), -1)
    whole = pretrain.draw_tokens(probs, torch.Generator().manual_seed(1))
    monkeypatch.setattr(samplers, "SAMPLE_CHUNK", (3 * 7, 3 * 7))  # three rows at a time, the last chunk shorter
    chunked = pretrain.draw_tokens(probs, torch.Generator().manual_seed(1))
    assert torch.equal(chunked, whole) and len(set(whole.tolist())) > 3
    assert not torch.equal(pretrain.draw_tokens(probs, torch.Generator().manual_seed(2)), whole)


def test_scheduled_sampling_draws_nothing_for_no_positions():
    from agents.pretrain import draw_tokens

    assert draw_tokens(torch.empty(0, 9), torch.Generator().manual_seed(0)).shape == (0,)


def test_an_interrupted_warm_start_resumes_exactly_and_a_fresh_run_does_not_take_it_over(corpus, tmp_path):
    """Killed at step 8 of 12 (its checkpoint at 6): a fresh run into the same output_dir is refused
    in one line, --resume goes on from step 6 with the same data order and scheduled-sampling draws
    (how often it logs and saves set anew; a changed lr refused), and ends with the weights an uninterrupted
    run gets; the checkpoint is gone after it."""
    import os

    from transformers import AutoModelForCausalLM

    from agents.pretrain import CHECKPOINT

    knobs = dict(steps=12, log_every=1, checkpoint_every=3, ss_max=0.5)
    pretrain(config(corpus, tmp_path / "whole", **knobs), log=lambda line: None)
    assert not os.path.exists(tmp_path / "whole" / CHECKPOINT)

    class Killed(Exception):
        pass

    def log(line):
        if line.startswith("step     8/"):
            raise Killed  # as the process dying there
    cut = config(corpus, tmp_path / "cut", **knobs)
    with pytest.raises(Killed):
        pretrain(cut, log=log)
    assert torch.load(tmp_path / "cut" / CHECKPOINT, weights_only=False)["step"] == 6
    with pytest.raises(ValueError, match=r"^output_dir: .* holds an interrupted warm start \(step 6 of 12\): "
                                         r"go on with --resume"):
        pretrain(cut, log=lambda line: None)
    with pytest.raises(ValueError, match=r"^--resume: .* differs: training.lr$"):
        pretrain(config(corpus, tmp_path / "cut", **knobs, lr=1e-3), log=lambda line: None, resume=True)
    with pytest.raises(ValueError, match=r"^--resume: .* differs: training.eval_batches$"):  # another held-out set
        pretrain(config(corpus, tmp_path / "cut", **knobs, eval_batches=2), log=lambda line: None, resume=True)
    lines = []  # how often it logs and saves may change: the weights do not
    (tmp_path / "cut" / f"{CHECKPOINT}.partial-123-456").write_bytes(b"a checkpoint a killed run was writing")
    pretrain(config(corpus, tmp_path / "cut", **knobs | dict(log_every=2, checkpoint_every=4)), log=lines.append,
             resume=True)
    assert lines[0].startswith("resumed at step 6/12") and lines[1].startswith("step     8/12")
    assert not [f for f in os.listdir(tmp_path / "cut") if f.startswith(CHECKPOINT)]  # nor a partial one
    whole, resumed = (AutoModelForCausalLM.from_pretrained(tmp_path / d) for d in ("whole", "cut"))
    for (name, a), b in zip(whole.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match=r"^--resume: no interrupted warm start in output_dir"):
        pretrain(cut, log=lambda line: None, resume=True)


def test_a_warm_start_refuses_an_output_dir_holding_other_files_and_writes_over_its_own(corpus, tmp_path):
    """output_dir holding an RL run's or a project's files is refused before training (a warm
    start would write its config.json and model over them); a warm start's own directory is
    written again (its partial files, left by a killed save, do not count)."""
    from agents.whole_files import partial_path

    run = tmp_path / "run"
    (run / "checkpoint_000000").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=rf"^output_dir: {run} holds other files than a saved model's "
                                         r"\(checkpoint_000000\); give an empty or new directory"):
        pretrain(config(corpus, run, steps=2))
    own = tmp_path / "own"
    pretrain(config(corpus, own, steps=2), log=lambda line: None)
    open(partial_path(str(own / "model.safetensors")), "w").close()
    assert pretrain(config(corpus, own, steps=2), log=lambda line: None)["output_dir"] == str(own)
