"""Encoder-decoder (T5/BART) policies: env observation, cached decoder stepping, encoder once per
episode, whole-sequence learner pass, config checks, warm start, and PPO raising BLEU."""
import math

import numpy as np
import pytest
import torch

from ray.rllib.core.columns import Columns

from agents.config import ConfigError, algorithm_config, env_config, validate
from agents.modules.seq2seq import Seq2SeqActorCritic, decoder_hidden, lm_logits
from env.text_env import TokenGenerationEnv

ENV = {"task": {"name": "sort_numbers"}, "max_prompt_len": 5, "max_new_tokens": 6, "encoder_decoder": True}


def module_for(name, inference_only=True, **extra):
    return Seq2SeqActorCritic(model_config={"model": {"name_or_path": name}, "env": ENV, "seed": 0, **extra},
                              inference_only=inference_only)


def batch_of(obs):
    return {k: torch.as_tensor(np.stack([o[k] for o in obs])) for k in obs[0]}


def test_env_puts_the_source_in_the_encoder_and_restarts_on_the_decoder_side():
    env = TokenGenerationEnv(ENV)
    obs, info = env.reset(seed=0)
    assert set(obs) == {"input_ids", "attention_mask", "encoder_input_ids", "encoder_attention_mask"}
    assert obs["input_ids"].shape == (6,) and obs["attention_mask"].sum() == 0  # nothing generated yet
    source = env.tokenizer(info["prompt"], add_special_tokens=False)["input_ids"]
    assert obs["encoder_input_ids"][:len(source)].tolist() == source and obs["encoder_attention_mask"].sum() == 5
    assert env.observation_space.contains(obs)
    obs, _ = env.reset(options={"prompt_ids": [4, 5, 6], "prefix_ids": [7, 8]})
    assert obs["input_ids"][-2:].tolist() == [7, 8] and obs["attention_mask"].tolist() == [0, 0, 0, 0, 1, 1]
    assert obs["encoder_input_ids"].tolist() == [4, 5, 6, 0, 0] and obs["encoder_attention_mask"].tolist() == [1, 1, 1, 0, 0]
    obs, *_ = env.step(9)
    assert obs["input_ids"][-3:].tolist() == [7, 8, 9]
    # Causal observations are unchanged: prompt + generation in one window, no encoder keys.
    causal = TokenGenerationEnv({**ENV, "encoder_decoder": False}).reset(options={"prompt_ids": [4, 5, 6]})[0]
    assert set(causal) == {"input_ids", "attention_mask"} and causal["input_ids"][-3:].tolist() == [4, 5, 6]


@pytest.mark.parametrize("name", ["tiny-t5", "tiny-bart"])
def test_cached_decoder_steps_give_the_logits_of_a_full_pass_and_of_the_model_itself(name):
    module = module_for(name)
    envs = [TokenGenerationEnv(ENV) for _ in range(3)]
    obs = [e.reset(seed=i)[0] for i, e in enumerate(envs)]
    gen = torch.Generator().manual_seed(0)
    for t in range(14):  # rows end at different steps and restart: mixed prefill and cached rows
        b = batch_of(obs)
        cached = module._next_token_logits(b)
        full = lm_logits(module.lm, decoder_hidden(module.lm, b, module.start_id))
        assert torch.allclose(cached, full, atol=1e-5), (t, (cached - full).abs().max())
        for r in range(3):  # the model's own forward on the unpadded source and decoder input
            n, n_src = int(b["attention_mask"][r].sum()), int(b["encoder_attention_mask"][r].sum())
            dec = [module.start_id] + (b["input_ids"][r, 6 - n:].tolist() if n else [])
            own = module.lm(input_ids=b["encoder_input_ids"][r:r + 1, :n_src],
                            decoder_input_ids=torch.tensor([dec])).logits[0, -1]
            assert torch.allclose(cached[r], own, atol=1e-5)
        actions = torch.multinomial(torch.softmax(cached, -1), 1, generator=gen)[:, 0].tolist()
        for i, a in enumerate(actions):
            o, _, done, _, _ = envs[i].step(a)
            obs[i] = envs[i].reset(seed=100 + 10 * t + i)[0] if done else o
    assert module.kv_cache.stats["incremental_rows"] > module.kv_cache.stats["prefill_rows"]


def test_encoder_runs_once_per_episode_and_a_step_runs_one_decoder_token():
    module = module_for("tiny-t5")
    encoded_rows, decoder_tokens = [], []
    module.lm.get_encoder().register_forward_hook(lambda m, args, kw, out: encoded_rows.append(kw["input_ids"].shape[0]),
                                                  with_kwargs=True)
    module.lm.get_decoder().register_forward_hook(lambda m, args, kw, out: decoder_tokens.append(kw["input_ids"].shape),
                                                  with_kwargs=True)
    envs = [TokenGenerationEnv({**ENV, "max_new_tokens": 4}) for _ in range(4)]
    obs = [e.reset(seed=i)[0] for i, e in enumerate(envs)]
    seed = 10
    for _ in range(40):
        b = batch_of(obs)
        # Never EOS, so every episode lasts exactly 4 steps and the rows stay in step.
        actions = module._next_token_logits(b)[:, 2:].argmax(-1) + 2
        for i, a in enumerate(actions.tolist()):
            o, _, done, _, _ = envs[i].step(a)
            if done:
                o, seed = envs[i].reset(seed=seed)[0], seed + 1
            obs[i] = o
    # 40 steps = 10 episodes per row, 40 in all, each with its own source (distinct seeds).
    assert sum(encoded_rows) == 40  # one encoder row per episode
    assert len(encoded_rows) == 10  # one encoder call per batch of episodes that started together
    # 40 steps = 10 episodes per row: each first step prefills [start] (the padding columns before it
    # are skipped), the other 3 feed one token each: every decoder call is one token wide.
    assert len(decoder_tokens) == 40 and all(shape[1] == 1 for shape in decoder_tokens)
    assert module.kv_cache.stats["incremental_rows"] == 4 * 30


def test_learner_pass_over_whole_sequences_matches_per_step_logits_and_values():
    module = module_for("tiny-bart", inference_only=False, reference_model=True)
    env = TokenGenerationEnv(ENV)
    rows, seq, actions = [], [], []
    for episode in range(2):
        obs = env.reset(seed=episode)[0]
        for a in ([5, 6, 7, 1], [8, 9, 3, 4, 12, 13])[episode]:
            rows.append(obs)
            seq.append(episode)
            actions.append(a)
            obs = env.step(a)[0]
    batch = {Columns.OBS: batch_of(rows), Columns.ACTIONS: torch.tensor(actions)}
    per_step = module.forward_train(batch)
    grouped = module.forward_train({**batch, "seq_id": torch.tensor(seq)})
    assert torch.allclose(per_step[Columns.ACTION_DIST_INPUTS], grouped[Columns.ACTION_DIST_INPUTS], atol=1e-5)
    values = module.compute_values({**batch, "seq_id": torch.tensor(seq)})
    assert values.shape == (len(rows),)
    # The frozen reference starts equal to the policy: its log-probs are the policy's.
    logp = torch.log_softmax(per_step[Columns.ACTION_DIST_INPUTS], -1)[torch.arange(len(rows)), batch[Columns.ACTIONS]]
    assert torch.allclose(module.reference_logp({**batch, "seq_id": torch.tensor(seq)}), logp, atol=1e-5)


def seq2seq_config(*extra):
    raw = {"task": {"name": "sort_numbers"}, "model": {"name_or_path": "tiny-t5"},
           "env": {"max_prompt_len": 5, "max_new_tokens": 6},
           "training": {"train_batch_size": 256, "minibatch_size": 128},
           "env_runners": {"num_envs_per_env_runner": 8}}
    for key, value in extra:
        section, field = key.split(".")
        raw.setdefault(section, {})[field] = value
    return raw


def test_config_detects_seq2seq_and_refuses_what_it_does_not_support(tmp_path):
    cfg = validate(seq2seq_config())
    assert env_config(cfg)["encoder_decoder"] is True
    assert algorithm_config(cfg).rl_module_spec.module_class is Seq2SeqActorCritic
    causal = validate({**seq2seq_config(), "model": {"name_or_path": "tiny-gpt2"}, "task": {"name": "increasing_numbers"}})
    assert env_config(causal)["encoder_decoder"] is False
    with pytest.raises(ConfigError, match=r"^model.kind: seq2seq policies are not supported by algorithm 'dqn'"):
        validate({**seq2seq_config(), "algorithm": "dqn", "training": {}})
    with pytest.raises(ConfigError, match=r"^training.mle_coef: "):
        validate(seq2seq_config(("training.mle_coef", 0.5)))
    # model.kind that contradicts the model directory's own config
    from agents.models import build_causal_lm, build_tokenizer

    lm = build_causal_lm({"name_or_path": "tiny-gpt2"}, build_tokenizer({"task": {"name": "sort_numbers"}}))
    lm.save_pretrained(tmp_path / "gpt")
    with pytest.raises(ConfigError, match=r"^model.kind: seq2seq does not match model.name_or_path .*causal LM"):
        validate(seq2seq_config(("model.name_or_path", str(tmp_path / "gpt")), ("model.kind", "seq2seq")))
    with pytest.raises(ConfigError, match=r"^model.kind: causal does not match .*encoder-decoder"):
        validate(seq2seq_config(("model.kind", "causal")))


def test_hub_names_are_told_apart_by_their_config(monkeypatch):
    import transformers
    from transformers import GPT2Config, T5Config

    from agents.models import model_kind

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        lambda name: T5Config() if "t5" in name else GPT2Config())
    assert model_kind({"name_or_path": "org/t5-x"}) == "seq2seq"
    assert model_kind({"name_or_path": "org/gpt-x"}) == "causal"
    with pytest.raises(ValueError, match=r"^model.kind: seq2seq does not match .*'org/gpt-x', which is a causal LM"):
        model_kind({"name_or_path": "org/gpt-x", "kind": "seq2seq"})
    raw = {**seq2seq_config(("model.name_or_path", "org/t5-x")), "algorithm": "dqn", "training": {}}
    cfg = validate(raw)  # the kind of a hub name is only known once its config is read: in env_config
    with pytest.raises(ConfigError, match=r"^model.kind: seq2seq policies are not supported by algorithm 'dqn'"):
        env_config(cfg)


# ppo goes on from the trained checkpoint through export, evaluation, the server and the generate CLI: slow
@pytest.mark.parametrize("algorithm", [pytest.param("ppo", marks=pytest.mark.slow), "a3c"])
def test_samplers_learned_masking_separate_value_model_and_a3c_build_and_update(algorithm, tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    from agents.algorithms.a3c import A3CConfig
    from agents.export import export_policy

    raw = seq2seq_config(("model.value_model", "separate"), ("model.kv_cache", False),
                         ("reward.kl_coef", 0.01), ("training.train_batch_size", 64),
                         ("training.minibatch_size", 32), ("env_runners.num_envs_per_env_runner", 4))
    raw["sampler"] = {"name": "top_p", "p": 0.9, "masking": "learned", "sync_every": 1}
    raw["algorithm"] = algorithm
    if algorithm == "a3c":  # one gradient step per batch: no minibatches
        del raw["training"]["minibatch_size"]
    cfg = validate(raw)
    config = algorithm_config(cfg)
    assert isinstance(config, A3CConfig) == (algorithm == "a3c")
    algo = config.build_algo()
    try:
        result = algo.train()
        checkpoint = algo.save(str(tmp_path / "checkpoint")).checkpoint.path
    finally:
        algo.stop()
    learner = result["learners"]["default_policy"]
    vocab = TokenGenerationEnv(ENV).vocab_size
    assert learner["mask_size"] < vocab and np.isfinite(learner["policy_loss"]) and "ref_kl" in learner
    # The exported directory is a plain seq2seq model with the trained weights.
    exported = export_policy(checkpoint, str(tmp_path / "export"))
    assert exported["auto_class"] == "AutoModelForSeq2SeqLM"
    model = AutoModelForSeq2SeqLM.from_pretrained(exported["out_dir"]).eval()
    from agents.generate import load_policy

    trained = load_policy(checkpoint).lm.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())
    if algorithm == "ppo":  # agents.evaluate reads the checkpoint and its export alike (greedy: same text)
        from agents.evaluate import Model, evaluate

        models = [Model(checkpoint, "checkpoint"), Model(exported["out_dir"], "export")]
        result = evaluate(models, models[0].env_config, greedy=True, max_examples=6, log=lambda line: None)
        gens = {m: [g["generation"] for g in result["generations"] if g["model"] == m] for m in ("checkpoint", "export")}
        assert len(gens["checkpoint"]) == 6 and gens["checkpoint"] == gens["export"]
        # An untrained policy may stop at once, so compare the two on states with generated tokens too.
        env = TokenGenerationEnv(ENV)
        rng = np.random.default_rng(0)
        obs = []
        for i in range(6):
            o, _ = env.reset(seed=i)
            for _ in range(i % 4):
                o, *_ = env.step(int(rng.integers(3, env.vocab_size)))
            obs.append(o)
        batch = {Columns.OBS: batch_of(obs)}
        with torch.no_grad():
            argmax = [m.policy.forward_inference(batch)[Columns.ACTION_DIST_INPUTS].argmax(-1) for m in models]
        assert torch.equal(argmax[0], argmax[1])
        # The served application (in-process, no Ray) answers for a seq2seq checkpoint too:
        # greedy, it writes what agents.evaluate wrote for the same source.
        from agents.serve import Policy
        from tests.conftest import served_in_process

        def post(**request):
            with served_in_process(served) as client:
                response = client.post("/generate", json=request)
            return response.status_code, response.json()

        served = Policy(checkpoint)
        assert served.info["reward_needs_references"]  # BLEU against the sorted source
        prompt = result["generations"][0]["prompt"]
        status, reply = post(prompt=prompt, greedy=True)
        assert status == 200, reply
        assert reply["generations"][0] == {"text": gens["checkpoint"][0], "reward": None}  # no references given
        # With references the reply is scored, as the task scores it.
        from env.tasks import make_task

        refs = [" ".join(sorted(prompt.split(), key=int))]
        status, reply = post(prompt=prompt, num_samples=3, seed=1, references=refs)
        assert status == 200 and len(reply["generations"]) == 3, reply
        task = make_task(models[0].env_config["task"], max_new_tokens=6)
        texts = [g["text"] for g in reply["generations"]]
        expected = task.reward([prompt] * 3, texts, [{"references": refs}] * 3)
        assert [g["reward"] for g in reply["generations"]] == pytest.approx([float(x) for x in expected])
        status, reply = post(prompt=prompt, references=[])
        assert status == 400 and reply["error"].startswith("references: must be a non-empty string"), reply
        # The generate CLI prints unscored generations for typed prompts, with a note saying why.
        from tests.conftest import run_module

        out = run_module("agents.generate", "--checkpoint", checkpoint, "--prompt", prompt, "-n", "2", timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert len([l for l in out.stdout.splitlines() if l.startswith("[reward n/a] ")]) == 2
        assert "scores a text against references" in out.stderr


def test_pretrain_warm_starts_a_seq2seq_model_that_the_env_policy_loads(tmp_path):
    from agents.models import declared_kind
    from agents.pretrain import pretrain, validate as validate_pretrain
    from env.tasks.sort_numbers import write_dataset

    paths = write_dataset(str(tmp_path / "data"), num_train=200, num_eval=50)
    cfg = validate_pretrain({
        "output_dir": str(tmp_path / "warm"), "data": {"dataset": {"train": paths["train"], "validation": paths["validation"]},
                                                      "source_field": "source", "target_field": "target"},
        "model": {"name_or_path": "tiny-bart", "tokenizer": str(tmp_path / "data" / "tokenizer")},
        "training": {"steps": 30, "batch_size": 16, "max_len": 16, "log_every": 30, "ss_max": 0.25}})
    result = pretrain(cfg, log=lambda line: None)
    assert result["eval_after"] < result["eval_before"] - 1.0
    assert declared_kind({"name_or_path": result["output_dir"]}) == "seq2seq"
    module = module_for(result["output_dir"])  # loads through AutoModelForSeq2SeqLM, same vocabulary
    assert module.lm.get_output_embeddings().weight.shape[0] == TokenGenerationEnv(ENV).vocab_size
    with pytest.raises(ConfigError, match=r"^data.source_field: a seq2seq model"):
        validate_pretrain({"output_dir": "x", "model": {"name_or_path": "tiny-t5"},
                           "data": {"dataset": {"train": paths["train"]}}})


def sampled_bleu(policy, env_cfg, examples):
    from agents.evaluate import rollout
    from env.tasks import make_task

    task = make_task(env_cfg["task"], max_new_tokens=env_cfg["max_new_tokens"])
    gens = rollout(policy, env_cfg, examples, greedy=False, seed=0)
    return float(np.mean(task.reward([e["prompt"] for e in examples], gens, [e["meta"] for e in examples])))


@pytest.mark.slow
def test_mle_warm_start_then_ppo_raises_bleu_on_sorting(tmp_path):
    """The README's set-up, shorter: warm start (40 steps) then 25 PPO iterations; BLEU on held-out sources."""
    from agents.pretrain import pretrain, validate as validate_pretrain
    from env.tasks import make_task
    from env.tasks.sort_numbers import write_dataset

    torch.set_num_threads(1)
    paths = write_dataset(str(tmp_path / "data"))
    warm = pretrain(validate_pretrain({
        "output_dir": str(tmp_path / "warm"), "data": {"dataset": {"train": paths["train"], "validation": paths["validation"]},
                                                      "source_field": "source", "target_field": "target"},
        "model": {"name_or_path": "tiny-t5", "tokenizer": str(tmp_path / "data" / "tokenizer")},
        "training": {"steps": 40, "batch_size": 32, "max_len": 16, "log_every": 40}}), log=lambda line: None)
    raw = seq2seq_config(("model.name_or_path", warm["output_dir"]), ("env.max_new_tokens", 8),
                         ("reward.kl_coef", 1e-3), ("training.lr", 5e-4), ("training.train_batch_size", 512),
                         ("training.minibatch_size", 256), ("env_runners.num_envs_per_env_runner", 32))
    cfg = validate(raw)
    env_cfg = {**env_config(cfg), "split": "test"}
    test_examples = make_task(cfg["task"], max_new_tokens=8).examples("test")
    before = sampled_bleu(module_for(warm["output_dir"]), env_cfg, test_examples)
    algo = algorithm_config(cfg).build_algo()
    try:
        returns = [algo.train()["env_runners"]["episode_return_mean"] for _ in range(25)]
        policy = algo.get_module()
        policy.eval()
        after = sampled_bleu(policy, env_cfg, test_examples)
    finally:
        algo.stop()
    print(f"sampled BLEU on the 200 held-out test sources: warm start {before:.3f}, + PPO {after:.3f}; "
          f"training return {returns[0]:.3f} -> {np.mean(returns[-3:]):.3f}")
    assert np.mean(returns[-3:]) > returns[0] + 0.05, returns
    assert after > before + 0.05  # on sources PPO never trained on


@pytest.mark.parametrize("name", ["tiny-t5", "tiny-bart"])
def test_evaluate_decodes_like_hf_generate_and_scores_perplexity_like_hf_loss(name, tmp_path):
    """agents.evaluate on a plain seq2seq directory: greedy generations equal transformers'
    `generate`, and the perplexity column equals exp of the model's own token-mean loss."""
    from agents.evaluate import Model, evaluate
    from env.tasks import make_task

    module = module_for(name)
    task = make_task(ENV["task"], max_new_tokens=ENV["max_new_tokens"])
    with torch.no_grad():  # an untrained model's argmax may be a special token: make it write numbers
        special = task.tokenizer().all_special_ids
        module.lm.get_output_embeddings().weight[special] = 0.0
        if getattr(module.lm, "final_logits_bias", None) is not None:
            module.lm.final_logits_bias[..., special] = -10.0
    module.lm.save_pretrained(tmp_path / "m")
    task.tokenizer().save_pretrained(tmp_path / "m")
    model = Model(str(tmp_path / "m"))
    env_cfg = {**ENV, "tokenizer": str(tmp_path / "m")}
    result = evaluate([model], env_cfg, greedy=True, max_examples=8, log=lambda line: None)

    tok, lm = model.tokenizer, model.lm
    gens = [g["generation"] for g in result["generations"]]
    prompts = [g["prompt"] for g in result["generations"]]
    nll = n = 0
    for prompt, gen in zip(prompts, gens):
        src = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
        out = lm.generate(input_ids=src, attention_mask=torch.ones_like(src), max_new_tokens=ENV["max_new_tokens"],
                          do_sample=False, num_beams=1)
        assert tok.decode(out[0, 1:], skip_special_tokens=True).strip() == gen.strip()
        target = tok(gen, add_special_tokens=False)["input_ids"]
        if target:
            with torch.no_grad():
                loss = lm(input_ids=src, attention_mask=torch.ones_like(src), labels=torch.tensor([target])).loss
            nll, n = nll + loss.item() * len(target), n + len(target)
    assert n >= 8
    # Every sort_numbers prompt has 5 numbers: the difficulty breakdown is one bucket, not empty ones.
    assert [b["n"] for b in result["breakdown"]] == [8]
    assert result["rows"][0]["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-4)
