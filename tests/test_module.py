import gymnasium as gym
import numpy as np
import pytest
import torch

from ray.rllib.core.columns import Columns

from agents.modules import CausalLMActorCritic
from agents.modules.actor_critic import hidden_at_last_token
from env.text_env import TokenGenerationEnv

ENV_CFG = {"task": {"name": "increasing_numbers", "num_numbers": 10}, "max_prompt_len": 4, "max_new_tokens": 6}


def make_module(inference_only=False, **model):
    env = TokenGenerationEnv(ENV_CFG)
    module = CausalLMActorCritic(
        observation_space=env.observation_space,
        action_space=env.action_space,
        inference_only=inference_only,
        model_config={"model": {"name_or_path": "tiny-gpt2", **model}, "env": ENV_CFG, "seed": 0,
                      "reference_model": True},
    )
    return env, module.eval()


def rollout_obs(env, episodes=3, seed=0):
    rng = np.random.default_rng(seed)
    obs, seq, actions = [], [], []
    for ep in range(episodes):
        o, _ = env.reset(seed=ep, options={"prompt": ["1", "2 3", "4 5 6 7"][ep % 3]})
        done = False
        while not done:
            a = int(rng.integers(2, env.vocab_size))
            obs.append(o)
            seq.append(ep)
            actions.append(a)
            o, _, done, _, _ = env.step(a)
    batch = {k: torch.as_tensor(np.stack([x[k] for x in obs])) for k in obs[0]}
    return batch, torch.as_tensor(seq), torch.as_tensor(actions)


def test_output_shapes():
    env, module = make_module()
    obs, seq, actions = rollout_obs(env)
    n = len(actions)
    with torch.no_grad():
        out = module.forward_inference({Columns.OBS: obs})
        train = module.forward_train({Columns.OBS: obs})
        values = module.compute_values({Columns.OBS: obs})
    assert out[Columns.ACTION_DIST_INPUTS].shape == (n, env.vocab_size)
    assert train[Columns.EMBEDDINGS].shape == (n, module.lm.config.hidden_size)
    assert values.shape == (n,)


def test_logits_are_the_lms_next_token_logits_and_ignore_padding():
    env, module = make_module()
    env.reset(options={"prompt": "1 2"})
    obs, *_ = env.step(5)
    batch = {k: torch.as_tensor(v)[None] for k, v in obs.items()}
    real = batch["attention_mask"][0] == 1
    with torch.no_grad():
        ours = module.forward_inference({Columns.OBS: batch})[Columns.ACTION_DIST_INPUTS][0]
        # The same tokens with no padding at all, through the plain HF model.
        plain = module.lm(input_ids=batch["input_ids"][:, real]).logits[0, -1]
        # More left padding (a longer window) must not change anything either.
        wide = {k: torch.nn.functional.pad(v, (7, 0), value=0) for k, v in batch.items()}
        wider = module.forward_inference({Columns.OBS: wide})[Columns.ACTION_DIST_INPUTS][0]
    torch.testing.assert_close(ours, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours, wider, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("value_model", ["shared", "separate"])
def test_sequence_grouped_forward_equals_per_row_forward(value_model):
    env, module = make_module(value_model=value_model)
    obs, seq, actions = rollout_obs(env, episodes=4)
    perm = torch.randperm(len(seq), generator=torch.Generator().manual_seed(0))
    obs = {k: v[perm] for k, v in obs.items()}
    seq, actions = seq[perm], actions[perm]
    with torch.no_grad():
        per_row = module.forward_train({Columns.OBS: obs})
        grouped = module.forward_train({Columns.OBS: obs, "seq_id": seq})
        v_row = module.compute_values({Columns.OBS: obs})
        v_grp = module.compute_values({Columns.OBS: obs, "seq_id": seq})
        ref_row = module.reference_logp({Columns.OBS: obs, Columns.ACTIONS: actions})
        ref_grp = module.reference_logp({Columns.OBS: obs, Columns.ACTIONS: actions, "seq_id": seq})
    for key in (Columns.ACTION_DIST_INPUTS, Columns.EMBEDDINGS):
        torch.testing.assert_close(grouped[key], per_row[key], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_grp, v_row, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref_grp, ref_row, atol=1e-5, rtol=1e-5)


def test_grouped_forward_runs_each_sequence_once():
    env, module = make_module()
    obs, seq, _ = rollout_obs(env, episodes=3)
    calls = []
    hook = module.lm.base_model.register_forward_hook(lambda m, a, kw, out: calls.append(kw["input_ids"].shape[0]),
                                                     with_kwargs=True)
    with torch.no_grad():
        hidden_at_last_token(module.lm.base_model, obs, seq)
    hook.remove()
    assert calls == [3]  # one batched pass over the 3 sequences, not one per step


def test_learner_passes_skip_the_columns_that_are_padding_in_every_row():
    # Windows of width 16 whose rows use their last 3..10 columns: a pass needs only the last 10,
    # and each row's hidden state is the one its own tokens give without any padding.
    _, module = make_module()
    trunk = module.lm.base_model
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 10, 7, 5]
    ids = torch.randint(0, 12, (len(lengths), 16), generator=gen)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        mask[r, 16 - n:] = 1
    widths = []
    hook = trunk.register_forward_hook(lambda m, a, kw, out: widths.append(kw["input_ids"].shape[1]),
                                       with_kwargs=True)
    with torch.no_grad():
        hidden = hidden_at_last_token(trunk, {"input_ids": ids, "attention_mask": mask})
        hook.remove()
        alone = [trunk(input_ids=ids[r:r + 1, 16 - n:]).last_hidden_state[0, -1] for r, n in enumerate(lengths)]
    assert widths == [10]
    torch.testing.assert_close(hidden, torch.stack(alone), atol=1e-5, rtol=1e-5)


def test_inference_only_module_has_no_learner_parts():
    _, full = make_module()
    _, lite = make_module(inference_only=True)
    assert hasattr(full, "value_head") and hasattr(full, "ref_model")
    assert not hasattr(lite, "ref_model")  # the value head (hidden x 1) is there: rollouts store V(s)
    # The learner's inference-only state carries the LM and the value head, not the reference.
    assert not any(k.startswith("ref_model.") for k in full.get_state(inference_only=True))
    # The learner's inference-only state loads into the EnvRunner's module exactly.
    lite.set_state(full.get_state(inference_only=True))
    for (name, a), (_, b) in zip(full.lm.state_dict().items(), lite.lm.state_dict().items()):
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), msg=name)


def test_weight_sync_copies_every_tensor_and_drops_the_rollout_caches():
    """A weight sync (the learner's inference-only state) is copied into the EnvRunner module's
    own tensors; a state with other keys (e.g. a full learner state) goes through
    load_state_dict. Either way every weight and buffer equals the source's and cached
    keys/values are gone."""
    _, full = make_module()
    with torch.no_grad():
        for p in full.parameters():
            p.add_(torch.randn_like(p))
    for state in (full.get_state(inference_only=True), full.get_state()):
        _, lite = make_module(inference_only=True)
        params = {id(p) for p in lite.parameters()}
        lite.kv_cache.past = "stale"
        lite.set_state(state)
        own, source = lite.state_dict(), full.state_dict()
        assert state.keys() <= own.keys() or own.keys() <= state.keys()  # the lean sync's, or a full state
        for name, value in own.items():  # a tied weight the lean sync sent once is its partner's
            torch.testing.assert_close(value, source[name], rtol=0, atol=0, msg=name)
        assert {id(p) for p in lite.parameters()} == params  # the same tensors, updated in place
        assert lite.kv_cache.past is None and lite.values_in_rollouts
    assert lite._copy_state(full.get_state(inference_only=True))
    assert not lite._copy_state(full.get_state())  # the reference's keys: load_state_dict's path


def test_reference_model_is_frozen_initial_policy():
    _, module = make_module()
    assert all(not p.requires_grad for p in module.ref_model.parameters())
    for a, b in zip(module.lm.parameters(), module.ref_model.parameters()):
        torch.testing.assert_close(a, b)


def test_same_seed_same_initial_weights():
    _, a = make_module()
    _, b = make_module()
    for x, y in zip(a.lm.parameters(), b.lm.parameters()):
        assert torch.equal(x, y)


def test_dropout_is_off_even_in_train_mode():
    env, module = make_module()
    module.train()
    obs, _, _ = rollout_obs(env)
    with torch.no_grad():
        a = module.forward_train({Columns.OBS: obs})[Columns.ACTION_DIST_INPUTS]
        b = module.forward_train({Columns.OBS: obs})[Columns.ACTION_DIST_INPUTS]
    assert torch.equal(a, b)


def test_exploration_samples_in_the_module_and_returns_only_action_logp_and_value():
    env, module = make_module(inference_only=True)
    obs, _, _ = rollout_obs(env)
    torch.manual_seed(0)
    with torch.no_grad():
        out = module.forward_exploration({Columns.OBS: obs})
        logits = module.forward_inference({Columns.OBS: obs})[Columns.ACTION_DIST_INPUTS]
    # nothing of size V per step: the action, its log-prob and the state's value
    assert set(out) == {Columns.ACTIONS, Columns.ACTION_LOGP, Columns.VF_PREDS}
    assert out[Columns.VF_PREDS].shape == out[Columns.ACTIONS].shape
    want = torch.log_softmax(logits, -1).gather(-1, out[Columns.ACTIONS][:, None])[:, 0]
    torch.testing.assert_close(out[Columns.ACTION_LOGP], want, atol=1e-5, rtol=1e-5)


def _padded_model(path, tokens: int, padding: int = 12):
    """A GPT-2 with `padding` output rows past the tokenizer's `tokens` (as T5's 32,128 outputs for
    32,100 tokens), weighted so that an uncut head draws a padding row almost surely."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=tokens + padding, n_positions=32, n_embd=16, n_layer=1, n_head=2,
                                       tie_word_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight[:tokens] = 0.0  # every real token's logit 0; the padding rows' large
        model.lm_head.weight[tokens:] = torch.randn(padding, 16) * 100
    model.save_pretrained(path)
    return path


def _masked(logits: torch.Tensor, tokens: int) -> bool:
    """Whether the outputs from `tokens` on have the lowest logit (probability exactly 0)."""
    return bool((logits[..., tokens:] == torch.finfo(logits.dtype).min).all())


def test_a_padded_vocabulary_draws_only_the_tokenizers_tokens(tmp_path):
    """More model outputs than tokenizer tokens (T5, Pythia): every logits path masks the outputs
    past the tokens, so no rollout, train pass or reference pass draws or weighs a token the
    tokenizer lacks; the saved weights keep their rows (an export is the model as loaded)."""
    vocab = TokenGenerationEnv(ENV_CFG).vocab_size
    path = _padded_model(tmp_path / "padded", vocab)
    env, module = make_module(inference_only=True, name_or_path=str(path))
    obs, seq, actions = rollout_obs(env, episodes=6)
    with torch.no_grad():
        drawn = module.forward_exploration({Columns.OBS: obs})[Columns.ACTIONS]
        assert _masked(module.forward_inference({Columns.OBS: obs})[Columns.ACTION_DIST_INPUTS], vocab)
    assert int(drawn.max()) < vocab
    # unmasked, the same model's most likely token is a padding row: the test's model shows the bug
    with torch.no_grad():
        hidden = module.lm.transformer(input_ids=obs["input_ids"][:4]).last_hidden_state[:, -1]
        assert bool(((hidden @ module.lm.lm_head.weight.T).argmax(-1) >= vocab).all())
        # the mask is no graph break in the rollout step's tail (a CUDA graph can capture it)
        torch._dynamo.reset()
        tail = torch.compile(lambda h, u: module._sample(h, u), fullgraph=True, backend="aot_eager")
        uniform = torch.rand(4, 1, dtype=torch.float64)
        torch.testing.assert_close(tail(hidden, uniform)[Columns.ACTIONS], module._sample(hidden, uniform)[Columns.ACTIONS])
    _, learner = make_module(name_or_path=str(path))
    out = learner.forward_train({Columns.OBS: obs, "seq_id": seq, Columns.ACTIONS: actions})
    assert _masked(out[Columns.ACTION_DIST_INPUTS], vocab)
    entropy = learner.get_train_action_dist_cls().from_logits(out[Columns.ACTION_DIST_INPUTS]).entropy()
    assert bool(torch.isfinite(entropy).all())
    out[Columns.ACTION_DIST_INPUTS].sum().backward()  # the in-place mask keeps the graph differentiable
    assert float(learner.lm.lm_head.weight.grad[vocab:].abs().max()) == 0.0
    assert _masked(learner.lm(input_ids=obs["input_ids"][:2]).logits, vocab)  # the model's own forward too
    ref = learner.reference_logp({Columns.OBS: obs, "seq_id": seq, Columns.ACTIONS: actions})
    assert ref.shape == actions.shape and bool(torch.isfinite(ref).all())
    assert learner.lm.state_dict()["lm_head.weight"].shape[0] == vocab + 12


def test_a_padded_bart_vocabulary_is_masked_before_its_full_width_bias(tmp_path):
    """BART's forward adds `final_logits_bias` (one per output) after the head: the mask keeps the
    head's width, so the model's own forward, the windowed check and generate() all run."""
    from transformers import BartConfig, BartForConditionalGeneration

    from agents.models import SEQ2SEQ_CONFIGS, build_seq2seq_lm
    from env.tokenization import word_level_tokenizer

    tok = word_level_tokenizer(["a", "b", "c", "d"])
    tokens = len(tok)
    BartForConditionalGeneration(BartConfig(vocab_size=tokens + 10, pad_token_id=0, eos_token_id=1, bos_token_id=1,
                                            decoder_start_token_id=1, forced_eos_token_id=None,
                                            max_position_embeddings=64, **SEQ2SEQ_CONFIGS["tiny-bart"])
                                 ).save_pretrained(tmp_path / "bart")
    model = build_seq2seq_lm({"name_or_path": str(tmp_path / "bart")}, tok)  # runs its own forward: no shape error
    ids = torch.tensor([[2, 3, 4, 1]])
    with torch.no_grad():
        assert _masked(model(input_ids=ids, decoder_input_ids=torch.tensor([[1, 2]])).logits, tokens)
        out = model.generate(input_ids=ids, do_sample=True, max_new_tokens=8, min_new_tokens=8)
    assert int(out.max()) < tokens


def test_ppo_trains_on_a_model_with_a_padded_vocabulary(tmp_path, ray_local):
    """The run a user starts on such a model: before the mask, the rollouts drew a padding row and
    the env stopped the run ("action N outside [0, V)")."""
    from agents.config import algorithm_config, env_config, load
    from tests.conftest import QUICKSTART

    tokens = TokenGenerationEnv(env_config(load(QUICKSTART))).vocab_size
    path = _padded_model(tmp_path / "padded", tokens)
    cfg = load(QUICKSTART, [f"model.name_or_path={path}", "training.train_batch_size=256",
                            "training.minibatch_size=128", "training.num_epochs=1"])
    algo = algorithm_config(cfg).build_algo()
    try:
        results = [algo.train() for _ in range(2)]
        checkpoint = algo.save(str(tmp_path / "checkpoint")).checkpoint.path
    finally:
        algo.stop()
    assert results[-1]["env_runners"]["num_env_steps_sampled_lifetime"] >= 512
    # its export keeps every output; generate() suppresses those the policy never drew
    from transformers import AutoModelForCausalLM

    from agents.export import export_policy

    export_policy(checkpoint, str(tmp_path / "export"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert exported.config.vocab_size == tokens + 12
    assert list(exported.generation_config.suppress_tokens) == list(range(tokens, tokens + 12))
    out = exported.generate(input_ids=torch.tensor([[0, 0, 0, 0, 0]]), do_sample=True, max_new_tokens=10,
                            min_new_tokens=10, num_return_sequences=8)
    assert int(out.max()) < tokens


def test_a_model_directory_saved_in_bf16_trains_with_fp32_weights(tmp_path):
    """Many model directories hold bf16 weights, which transformers loads as they are: the policy
    (causal and seq2seq alike) gets fp32 weights, the saved values exactly, so the optimizer's
    small steps are not lost to bf16 rounding."""
    from transformers import BartConfig, BartForConditionalGeneration, GPT2Config, GPT2LMHeadModel

    from agents.models import SEQ2SEQ_CONFIGS, build_causal_lm, build_seq2seq_lm
    from env.tokenization import word_level_tokenizer

    tok = word_level_tokenizer(["a", "b", "c", "d"])
    saved = {
        "gpt2": GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=32, n_embd=16, n_layer=1, n_head=2)),
        "bart": BartForConditionalGeneration(BartConfig(vocab_size=len(tok), pad_token_id=0, eos_token_id=1,
                                                        bos_token_id=1, decoder_start_token_id=1,
                                                        max_position_embeddings=64, **SEQ2SEQ_CONFIGS["tiny-bart"])),
    }
    for name, model in saved.items():
        model.to(torch.bfloat16).save_pretrained(tmp_path / name)
        build = build_causal_lm if name == "gpt2" else build_seq2seq_lm
        built = build({"name_or_path": str(tmp_path / name)}, tok)
        params = dict(built.named_parameters())
        assert {p.dtype for p in params.values()} == {torch.float32}, name
        for key, p in model.named_parameters():
            assert torch.equal(params[key], p.float()), (name, key)
