"""Evaluation tables and training curves (agents/evaluate.py) on tiny models written here."""
import csv
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from agents.evaluate import (EvalError, Model, distinct_n, evaluate, main, plot_curves, terciles,
                             write_results)
from env.tasks.review_corpus import review_corpus, vocabulary
from tests.conftest import PROBE, ROOT, one_line_cli_error, run_module, write_jsonl


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Two randomly initialised tiny GPT-2 directories sharing a word-level tokenizer, and review data."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from env.tokenization import word_level_tokenizer

    root = tmp_path_factory.mktemp("evaluate")
    tok = word_level_tokenizer(vocabulary())
    dirs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        lm = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=32, n_layer=1, n_head=2, n_embd=16,
                                        eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
                                        pad_token_id=tok.pad_token_id))
        path = str(root / f"model{seed}")
        lm.save_pretrained(path)
        tok.save_pretrained(path)
        dirs.append(path)
    data = {"train": write_jsonl(root / "train.jsonl", review_corpus(20, seed=0)),
            "test": write_jsonl(root / "test.jsonl", review_corpus(12, seed=2))}
    env_config = {"task": {"name": "imdb", "dataset": data, "prompt_words": 6}, "tokenizer": dirs[0],
                  "max_prompt_len": 8, "max_new_tokens": 6, "truncation_side": "right"}
    return {"dirs": dirs, "env_config": env_config, "root": root, "data": data}


def test_distinct_n_is_the_hand_count():
    gens = ["the cat sat", "the cat ran", ""]
    # unigrams: the cat sat the cat ran -> 4 unique of 6; bigrams: the-cat sat... -> 3 unique of 4
    assert distinct_n(gens, 1) == pytest.approx(4 / 6)
    assert distinct_n(gens, 2) == pytest.approx(3 / 4)
    assert distinct_n(["a"], 2) == 0.0


def test_terciles_cut_at_the_thirds_and_keep_ties_together():
    buckets, labels = terciles([-0.5, -0.5, 0.0, 0.0, 0.0, 0.7])
    assert buckets == [0, 0, 1, 1, 1, 2] and len(labels) == 3  # cuts at -0.167 and 0.0
    assert terciles([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])[0] == [0, 0, 1, 1, 2, 2]


def _logprob(model_dir, context, target):
    """Sum of log p(target | context) one unpadded sequence at a time (as tests/test_rewards.py does)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    lm = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ctx = tok(context, add_special_tokens=False)["input_ids"]
    tgt = tok(target, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logp = lm(torch.tensor([ctx + tgt])).logits[0].log_softmax(-1)
    return sum(logp[len(ctx) - 1 + t, i].item() for t, i in enumerate(tgt)), len(tgt)


def test_table_matches_direct_reward_calls_and_files_are_written(setup, tmp_path):
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    models = [Model(setup["dirs"][0], "first"), Model(setup["dirs"][1], "second")]
    result = evaluate(models, setup["env_config"], num_samples=2, log=lambda line: None)
    assert [r["model"] for r in result["rows"]] == ["first", "second"]
    assert result["columns"] == ["model", "n", "sentiment", "perplexity", "distinct_1", "distinct_2", "mean_words"]
    vader = SentimentIntensityAnalyzer()
    for row in result["rows"]:
        gens = [g for g in result["generations"] if g["model"] == row["model"]]
        texts = [g["generation"] for g in gens]
        assert row["n"] == len(gens) == 24  # 12 test prompts x 2 samples
        direct = [(vader.polarity_scores(t)["compound"] + 1) / 2 for t in texts]  # sentiment without a model
        assert row["sentiment"] == pytest.approx(sum(direct) / len(direct))
        assert row["distinct_1"] == pytest.approx(distinct_n(texts, 1))
        assert row["distinct_2"] == pytest.approx(distinct_n(texts, 2))
        # Perplexity under the first model, over all generated tokens after their prompts.
        total = count = 0
        for g in gens:
            if g["generation"]:
                lp, n = _logprob(setup["dirs"][0], g["prompt"], g["generation"])
                total, count = total + lp, count + n
        assert row["perplexity"] == pytest.approx(math.exp(-total / count), rel=1e-4)
    # The same prompts for both models, each sampled twice.
    prompts = [g["prompt"] for g in result["generations"]]
    assert prompts[:24] == prompts[24:] and prompts[0] == prompts[1]
    # The breakdown covers every generation once per model, by the prompt's own VADER score.
    for name in ("first", "second"):
        parts = [b for b in result["breakdown"] if b["model"] == name]
        assert sum(b["n"] for b in parts) == 24
        overall = next(r for r in result["rows"] if r["model"] == name)["sentiment"]
        assert sum(b["n"] * b["sentiment"] for b in parts if b["n"]) / 24 == pytest.approx(overall)
    assert result["difficulty"] == "prompt VADER compound"

    paths = write_results(result, str(tmp_path / "out"))
    with open(paths["csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    overall = [r for r in rows if r["table"] == "overall"]
    assert [r["model"] for r in overall] == ["first", "second"]
    assert float(overall[0]["sentiment"]) == pytest.approx(result["rows"][0]["sentiment"])
    assert len([r for r in rows if r["table"] == "by_difficulty"]) == 6
    md = open(paths["md"]).read()
    assert "| model | n | sentiment | perplexity | distinct_1 | distinct_2 | mean_words |" in md
    assert "| first | 24 |" in md and "By prompt VADER compound (terciles)" in md
    assert sum(1 for _ in open(paths["generations"])) == 48


def test_greedy_decoding_repeats_itself_so_greedy_copies_are_refused(setup):
    model = Model(setup["dirs"][0])
    a, b = (evaluate([model], setup["env_config"], greedy=True, seed=seed, log=lambda line: None) for seed in (0, 1))
    assert [g["generation"] for g in a["generations"]] == [g["generation"] for g in b["generations"]]
    with pytest.raises(EvalError, match="^--num-samples: greedy decoding gives one generation per prompt"):
        evaluate([model], setup["env_config"], greedy=True, num_samples=2, log=lambda line: None)


def test_bf16_decoding_leaves_the_models_fp32_and_perplexity_fp32(setup):
    """--precision bf16: each model generates from a bf16 copy of its weights (the texts a bf16
    cast gives), while the model itself, which scores perplexity as the reference, stays fp32."""
    import copy

    from agents.evaluate import markdown_summary, perplexity, rollout
    from env.tasks import make_task
    from tests.test_serve_batching import build_module

    model = Model(setup["dirs"][0])
    decoding = model.decoding("bf16")  # (this tiny model's texts are the same in fp32)
    assert decoding is not model.policy and {p.dtype for p in decoding.lm.parameters()} == {torch.bfloat16}
    result = evaluate([model], setup["env_config"], precision="bf16", log=lambda line: None)
    assert {p.dtype for p in model.lm.parameters()} == {torch.float32}
    gens = [g["generation"] for g in result["generations"]]
    cast = copy.deepcopy(model.policy)
    cast.lm.to(torch.bfloat16)
    cfg = {**setup["env_config"], "split": "test", "tokenizer": model.tokenizer_spec, "encoder_decoder": False}
    examples = make_task(cfg["task"], max_new_tokens=cfg["max_new_tokens"]).examples("test")
    assert gens == rollout(cast, cfg, examples, greedy=False)
    prompts = [g["prompt"] for g in result["generations"]]
    assert result["rows"][0]["perplexity"] == perplexity(model.lm, model.tokenizer, prompts, gens)
    assert "sampled decoding with bf16 weights" in markdown_summary(result)
    # a checkpoint's policy: a bf16 copy (its decode engine follows); the policy itself stays fp32
    checkpoint = Model.__new__(Model)
    checkpoint.kind, checkpoint.policy = "checkpoint", build_module()
    decoding = checkpoint.decoding("bf16")
    assert decoding is not checkpoint.policy and checkpoint.decoding("fp32") is checkpoint.policy
    assert {p.dtype for p in decoding.parameters() if p.is_floating_point()} == {torch.bfloat16}
    assert {p.dtype for p in checkpoint.policy.parameters() if p.is_floating_point()} == {torch.float32}


def write_trial(path, returns, kl):
    os.makedirs(path)
    with open(os.path.join(path, "result.json"), "w") as f:
        for i, (r, k) in enumerate(zip(returns, kl), start=1):
            f.write(json.dumps({"training_iteration": i, "env_runners": {"episode_return_mean": r},
                                "learners": {"default_policy": {"ref_kl": k}}}) + "\n")


def test_curves_png_per_metric(tmp_path):
    write_trial(tmp_path / "run" / "trial_a", [0.5, 0.6, 0.8], [0.0, 1.0, 2.0])
    write_trial(tmp_path / "run" / "trial_b", [0.4, 0.7], [0.0, 0.5])
    other = tmp_path / "other"
    os.makedirs(other)
    with open(other / "progress.csv", "w") as f:  # a trial with only progress.csv
        f.write("training_iteration,env_runners/episode_return_mean\n1,0.3\n2,0.9\n")
    paths = plot_curves([str(tmp_path / "run"), str(other)], ["episode_return_mean", "ref_kl"][:1],
                        str(tmp_path / "plots"))
    assert [os.path.basename(p) for p in paths] == ["curve_episode_return_mean.png"]
    data = open(paths[0], "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    paths = plot_curves([str(tmp_path / "run")], ["ref_kl"], str(tmp_path / "plots"))
    assert os.path.getsize(paths[0]) > 5000
    with pytest.raises(EvalError, match=r"^--metric: 'episode_reward' is not logged in any of the 2 trials "
                                        r"\(did you mean 'episode_return_mean'\?\)$"):
        plot_curves([str(tmp_path / "run")], ["episode_reward"], str(tmp_path / "plots"))
    with pytest.raises(EvalError, match=r"^--metric: 'ref_kl' is not logged in .*other$"):
        plot_curves([str(other)], ["ref_kl"], str(tmp_path / "plots"))


def test_curves_of_an_experiment_with_broken_and_unfinished_trials(tmp_path, capsys):
    """A trial that stopped before its first result, one whose last line was cut mid-write, and a
    metric that only some trials log are plotted around, each with a note; a bad line inside a
    result.json is named with its file and line."""
    run = tmp_path / "run"
    write_trial(run / "done", [0.5, 0.6, 0.8], [0.0, 1.0, 2.0])
    write_trial(run / "cut", [0.4, 0.7], [0.0, 0.5])
    with open(run / "cut" / "result.json", "a") as f:
        f.write('{"training_iteration": 3, "env_run')
    os.makedirs(run / "failed_early")
    open(run / "failed_early" / "result.json", "w").close()
    with open(run / "failed_early" / "params.json", "w") as f:  # written by Tune before any result
        f.write("{}")
    os.makedirs(run / "no_kl")
    with open(run / "no_kl" / "result.json", "w") as f:
        f.write(json.dumps({"training_iteration": 1, "env_runners": {"episode_return_mean": 0.2}}) + "\n")
    capsys.readouterr()
    paths = plot_curves([str(run)], ["episode_return_mean", "ref_kl"], str(tmp_path / "plots"))
    assert [os.path.basename(p) for p in paths] == ["curve_episode_return_mean.png", "curve_ref_kl.png"]
    err = capsys.readouterr().err
    assert "failed_early: no results yet (it stopped before its first iteration); not plotted" in err
    assert "cut/result.json: its last line is cut short" in err
    with open(run / "done" / "result.json") as f:
        lines = f.readlines()
    lines[1] = "{not json\n"
    with open(run / "done" / "result.json", "w") as f:
        f.writelines(lines)
    with pytest.raises(EvalError, match=r"^--curves: .*done/result\.json: line 2 is not valid JSON \(Expecting "):
        plot_curves([str(run)], ["episode_return_mean"], str(tmp_path / "plots"))
    shutil.rmtree(run)
    os.makedirs(run / "failed_early")
    open(run / "failed_early" / "result.json", "w").close()
    with pytest.raises(EvalError, match=r"^--curves: no trial under .*run has a result yet$"):
        plot_curves([str(run)], ["episode_return_mean"], str(tmp_path / "plots"))


def _cli_error(capsys, *argv):
    return one_line_cli_error(capsys, main, *argv)


def test_cli_bad_input_is_one_line(setup, tmp_path, capsys):
    missing = str(tmp_path / "nothing")
    assert _cli_error(capsys, missing) == f"error: {missing}: no such checkpoint or model directory"
    assert "neither a checkpoint" in _cli_error(capsys, str(tmp_path))
    from agents.saved_policy import MODULE_SUBDIR

    policy = tmp_path / "exp" / "trial_0" / "checkpoint_000003" / MODULE_SUBDIR
    policy.mkdir(parents=True)
    (policy / "module_state.pt").write_bytes(b"")
    assert _cli_error(capsys, str(tmp_path / "exp")) == (
        f"error: {tmp_path / 'exp'} is a run directory, not a checkpoint; its newest checkpoint is "
        f"{tmp_path / 'exp' / 'trial_0' / 'checkpoint_000003'}")
    assert _cli_error(capsys, setup["dirs"][0]).startswith("error: --config: needed to know the task")
    assert _cli_error(capsys, "--curves", missing) == f"error: --curves: {missing}: no such run directory"
    assert _cli_error(capsys, setup["dirs"][0], "--metric", "ref_kl").endswith(
        "error: --metric: chooses what --curves plots; give --curves RUN")
    assert _cli_error(capsys, setup["dirs"][0], "--threads", "0").endswith("error: --threads: expected an integer >= 1, got 0")
    assert _cli_error(capsys, setup["dirs"][0], setup["dirs"][0]).startswith(
        "error: --names: ")
    assert _cli_error(capsys, setup["dirs"][0], "--config", str(tmp_path / "x.yaml")).endswith(
        "x.yaml: no such config file")
    assert _cli_error(capsys, setup["dirs"][0], "--num-samples", "0").startswith("error: --num-samples")
    assert _cli_error(capsys, setup["dirs"][0], "--set", "env.max_new_tokens=4").startswith(
        "error: --set: changes --config's values, and no --config was given")
    assert _cli_error(capsys, setup["dirs"][0], "--seed", "-1") == "error: --seed: expected an integer in [0, 2147483647], got -1"
    assert _cli_error(capsys, setup["dirs"][0], "--device", "gpu") == "error: --device: expected cpu or cuda[:N], got 'gpu'"
    assert _cli_error(capsys, setup["dirs"][0], "--precision", "fp16") == "error: --precision: expected one of fp32, bf16, got 'fp16'"
    (tmp_path / "afile").write_text("x")  # refused before anything is evaluated
    assert _cli_error(capsys, setup["dirs"][0], "--out", str(tmp_path / "afile" / "sub")) == \
        f"error: --out: {tmp_path / 'afile'} is a file, so {tmp_path / 'afile' / 'sub'} cannot be a directory"


def test_cli_refuses_a_wrong_model_run_or_flag_in_one_line_before_importing_torch(tmp_path):
    """`python -m agents.evaluate` checks its flags and every MODEL and RUN path with the standard
    library before it imports torch, transformers or RLlib."""
    from tests.conftest import assert_refused_lightly, run_directory

    missing, out = tmp_path / "missing", tmp_path / "out"
    run, checkpoint = run_directory(tmp_path)
    cases = [
        ([missing], f"error: {missing}: no such checkpoint or model directory"),
        ([checkpoint, run],
         f"error: {run} is a run directory, not a checkpoint; its newest checkpoint is {checkpoint}"),
        ([checkpoint, "--reference", missing], f"error: --reference: {missing}: no such checkpoint or model directory"),
        ([checkpoint, "--seed", "-1"], "error: --seed: expected an integer in [0, 2147483647], got -1"),
        ([checkpoint, "--set", "env.max_new_tokens=4"], "error: --set: changes --config's values, and no --config "
         "was given (a checkpoint's task and lengths are its own; give an RL YAML with --config to change them): "
         "env.max_new_tokens=4"),
        (["--curves", missing], f"error: --curves: {missing}: no such run directory"),
        ([checkpoint, "--precision", "fp16"], "error: --precision: expected one of fp32, bf16, got 'fp16'"),
        ([checkpoint, "--num-samples", "0"], "error: --num-samples: expected an integer >= 1, got 0"),
        # greedy copies of one generation would count in n and divide distinct-n by the copies
        ([checkpoint, "--greedy", "--num-samples", "3"], "error: --num-samples: greedy decoding gives one "
         "generation per prompt (the same each time), so 3 would only repeat it; give --num-samples 1 or sample "
         "(drop --greedy)"),
    ]
    assert_refused_lightly("agents.evaluate", [([*argv, "--out", out], expected) for argv, expected in cases])
    assert not out.exists()


def test_curves_alone_plot_without_torch(tmp_path):
    """`--curves RUN` alone reads JSON and draws: it imports neither torch, transformers nor Ray."""
    write_trial(tmp_path / "run" / "trial", [0.5, 0.6], [0.0, 1.0])
    proc = subprocess.run([sys.executable, "-c", PROBE, "agents.evaluate", "--curves", str(tmp_path / "run"),
                           "--out", str(tmp_path / "plots")], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"wrote {tmp_path / 'plots' / 'curve_episode_return_mean.png'}", "[]"]


def test_cli_writes_table_and_plot(setup, tmp_path, capsys):
    from agents.evaluate import main

    cfg = tmp_path / "rl.yaml"
    data = setup["data"]
    cfg.write_text(f"task:\n  name: imdb\n  prompt_words: 6\n  dataset: {{train: {data['train']}, test: {data['test']}}}\n"
                   f"model:\n  name_or_path: {setup['dirs'][0]}\nenv:\n  max_prompt_len: 8\n  max_new_tokens: 6\n")
    write_trial(tmp_path / "run" / "trial", [0.5, 0.6], [0.0, 1.0])
    # The CLI's main in this process (without --threads, which would change this process's torch threads).
    code = main([*setup["dirs"], "--names", "a", "b", "--config", str(cfg), "--out", str(tmp_path / "eval"),
                 "--curves", str(tmp_path / "run")])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "| a | 12 |" in out.out and "| b | 12 |" in out.out
    for name in ("evaluation.csv", "evaluation.md", "generations.jsonl", "curve_episode_return_mean.png"):
        assert os.path.getsize(tmp_path / "eval" / name) > 0


@pytest.mark.slow
def test_demo_end_to_end_with_a_short_budget(tmp_path):
    """corpus -> pretrain -> PPO -> evaluate, shortened; asserts what a short run guarantees. An
    earlier demo interrupted in its warm start left a checkpoint there: the demo starts over."""
    out = tmp_path / "demo"
    os.makedirs(out / "warm_start")
    (out / "warm_start" / "pretrain_checkpoint.pt").write_bytes(b"an interrupted warm start's")
    run = run_module("agents.demo", "--out", str(out), "--pretrain-set", "training.steps=40",
                     "--ppo-set", "stop.training_iteration=2", "--ppo-set", "training.train_batch_size=256",
                     "--ppo-set", "training.minibatch_size=128", "--num-samples", "1", timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(out / "eval" / "evaluation.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["table"] == "overall"]
    assert [r["model"] for r in rows] == ["warm_start", "ppo"]
    assert all(0.0 <= float(r["sentiment"]) <= 1.0 and float(r["perplexity"]) > 1.0 for r in rows)
    assert os.path.getsize(out / "eval" / "curve_episode_return_mean.png") > 0
    assert "wall time:" in run.stdout
    assert os.path.isdir(ROOT)


def test_the_demo_commands_in_the_configs_headers_are_accepted_and_a_bad_one_is_refused_first(tmp_path, capsys):
    """Every `agents.demo --ppo-set ...` a config's header gives is accepted by the demo's RL step
    (REINFORCE and self-critical read no lambda), and a bad --ppo-set stops the demo in one line
    before it writes the corpus or the warm start."""
    import glob
    import re
    import shlex

    from agents.demo import main as demo_main, ppo_overrides

    commands = []
    for path in sorted(glob.glob(os.path.join(ROOT, "tune_configs", "*.yaml"))):
        header = re.sub(r"[\s\\]+", " ", "".join(line.lstrip("#") for line in open(path) if line.startswith("#")))
        commands += [(path, m.group(1)) for m in re.finditer(r"agents\.demo((?: --ppo-set \S+)+)", header)]
    assert len(commands) >= 3, commands
    for path, args in commands:
        words = shlex.split(args.replace("$PWD", str(tmp_path)))
        ppo_overrides(str(tmp_path), words[1::2])  # raises ConfigError naming the field if refused
    out = tmp_path / "demo"
    assert one_line_cli_error(capsys, demo_main, "--out", str(out), "--ppo-set", "training.lambda=2") == (
        "error: --ppo-set: training.lambda: expected a number in [0.0, 1.0], got 2.0")
    assert not out.exists()


def test_a_model_directory_saved_in_bf16_is_evaluated_with_fp32_weights(setup, tmp_path):
    """A Hugging Face directory saved in bf16 (config torch_dtype bfloat16) is held in fp32, as a
    model and as the reference: its perplexity is the one an fp32 copy of the same weights gives."""
    from transformers import AutoModelForCausalLM

    from agents.evaluate import perplexity

    path = str(tmp_path / "bf16")
    AutoModelForCausalLM.from_pretrained(setup["dirs"][0]).to(torch.bfloat16).save_pretrained(path)
    for name in os.listdir(setup["dirs"][0]):
        if "token" in name:
            shutil.copy(os.path.join(setup["dirs"][0], name), path)
    assert json.load(open(os.path.join(path, "config.json")))["dtype"] == "bfloat16"
    fp32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model, reference = Model(path), Model(path)
    assert {p.dtype for p in model.lm.parameters()} == {p.dtype for p in reference.lm.parameters()} == {torch.float32}
    result = evaluate([model], setup["env_config"], greedy=True, reference=reference, log=lambda line: None)
    prompts = [g["prompt"] for g in result["generations"]]
    gens = [g["generation"] for g in result["generations"]]
    assert sum(map(len, gens)) > 0
    assert result["rows"][0]["perplexity"] == pytest.approx(perplexity(fp32, reference.tokenizer, prompts, gens),
                                                            rel=1e-6)


def test_evaluate_refuses_an_unknown_precision_in_one_line_before_generating(setup):
    """The library function checks `precision` itself (the CLI is not its only caller)."""
    lines = []
    with pytest.raises(ValueError) as err:
        evaluate([Model(setup["dirs"][0])], setup["env_config"], precision="fp16", log=lines.append)
    assert str(err.value) == "precision: expected one of fp32, bf16, got 'fp16'"
    assert lines == []  # no model generated


def test_bf16_is_refused_on_a_gpu_that_would_only_emulate_it_for_each_models_device(setup, monkeypatch):
    """bf16 needs it in the GPU's hardware (a V100 emulates it, slowly): `check_precision` asks
    `gpu_has_bf16` of the device given, and `evaluate` checks the device of every model, not the
    first one's alone. (On this CPU machine the GPUs are stand-ins: the answers are patched.)"""
    import agents.generate
    import agents.models

    monkeypatch.setattr(agents.models, "gpu_has_bf16", lambda device=None: device.index != 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"GPU {device.index}")
    assert agents.generate.check_precision("bf16", "cuda:0") is None
    assert agents.generate.check_precision("bf16", "cuda:1") == "--precision bf16: GPU 1 has no bf16; use fp32"
    assert agents.generate.check_precision("fp32", "cuda:1") is None

    asked = []
    monkeypatch.setattr(agents.generate, "check_precision",
                        lambda precision, device: asked.append(device) or ("--precision bf16: no" if device == "meta" else None))
    on_cpu, elsewhere = Model(setup["dirs"][0]), Model(setup["dirs"][0])
    elsewhere.lm = torch.nn.Linear(2, 2, device="meta")  # a second model on another device
    with pytest.raises(ValueError, match="^precision bf16: no$"):
        evaluate([on_cpu, elsewhere], setup["env_config"], precision="bf16", log=lambda line: None)
    assert asked == ["cpu", "meta"]


def test_windows_longer_than_a_models_positions_are_refused_in_one_line(tmp_path, capsys):
    """--set env.max_new_tokens past what the checkpoint's model can take: train's check, not an
    IndexError from inside the decode step."""
    from agents.serve.launch import untrained_checkpoint
    from tests.conftest import QUICKSTART

    checkpoint = untrained_checkpoint(QUICKSTART, str(tmp_path / "tiny"))  # 5 + 20 tokens: 25 positions
    assert one_line_cli_error(capsys, main, checkpoint, "--config", QUICKSTART, "--set", "env.max_new_tokens=30",
                              "--out", str(tmp_path / "out")) == (
        "error: env.max_prompt_len + env.max_new_tokens: 35 tokens, more than the 25 positions of 'tiny'")


def test_a_checkpoint_of_another_vocabulary_is_refused_before_any_model_generates(setup, tmp_path, capsys):
    """A checkpoint of the number task evaluated beside a model of the review task, on the review
    task: its word-level tokenizer lacks the reviews' words (each would be read as EOS), so the
    evaluation stops in one line naming it before the first model writes anything."""
    from agents.serve.launch import untrained_checkpoint
    from tests.conftest import QUICKSTART

    checkpoint = untrained_checkpoint(QUICKSTART, str(tmp_path / "numbers"))
    logged = []
    with pytest.raises(EvalError, match=r"^numbers: its tokenizer does not know (\d+) of the \1 words of split 'test''s "
                                        r"prompts \(the first: '\w+' in prompt 1\); it reads each as its unknown "
                                        r"token\. Is it a model of another task\? Give --config with its own$"):
        evaluate([Model(setup["dirs"][0]), Model(checkpoint, "numbers")], setup["env_config"], log=logged.append)
    assert logged == []
    # the same checkpoint on its own task passes the check (and the review model's words are all known)
    result = evaluate([Model(checkpoint, "numbers")], Model(checkpoint).env_config, max_examples=1, log=logged.append)
    assert result["rows"][0]["n"] == 1 and logged == ["evaluated numbers: 1 generations"]
    # a few words the vocabulary never saw (built from the training split): a note, and it goes on
    from agents.evaluate import check_prompt_words

    model = Model(setup["dirs"][0], "reviews")
    examples = [{"prompt": "the film was good"}, {"prompt": "the zyzzyva was good"}]
    capsys.readouterr()
    check_prompt_words(model, examples, "test")
    assert capsys.readouterr().err == ("note: reviews: its tokenizer does not know 1 of the 8 words of split 'test''s "
                                       "prompts (the first: 'zyzzyva' in prompt 2); it reads each as its unknown token\n")
