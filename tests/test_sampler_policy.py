"""Masked policies: acting and the PPO loss use the same renormalised masked distribution."""
import math

import numpy as np
import pytest
import torch

from ray.rllib.core.columns import Columns
from ray.rllib.core.distribution.torch.torch_distribution import TorchCategorical

from agents import samplers
from agents.algorithms.sequence_batching import SEQ_ID
from agents.modules import CausalLMActorCritic
from agents.modules.actor_critic import MASK_SIZE, SAMPLER_STATE
from env.text_env import TokenGenerationEnv

ENV_CFG = {"task": {"name": "increasing_numbers", "num_numbers": 40}, "max_prompt_len": 4, "max_new_tokens": 8}


def make_module(sampler=None, inference_only=False, seed=0):
    env = TokenGenerationEnv(ENV_CFG)
    return CausalLMActorCritic(
        observation_space=env.observation_space, action_space=env.action_space, inference_only=inference_only,
        # A wider initialisation than GPT-2's gives peaked, LM-like next-token distributions.
        model_config={"model": {"name_or_path": "tiny-gpt2", "overrides": {"initializer_range": 0.15}},
                      "env": ENV_CFG, "seed": seed, "sampler": sampler},
    ).eval()


def roll(module, rows=6, steps=8, seed=0):
    """Steps `rows` envs with the module's exploration path; returns per-step obs, outputs and actions."""
    torch.manual_seed(seed)
    envs = [TokenGenerationEnv(ENV_CFG) for _ in range(rows)]
    obs = [e.reset(seed=i)[0] for i, e in enumerate(envs)]
    record = []
    for _ in range(steps):
        batch = {k: torch.as_tensor(np.stack([o[k] for o in obs])) for k in obs[0]}
        out = module.forward_exploration({Columns.OBS: batch})
        record.append((batch, out))
        for i, a in enumerate(out[Columns.ACTIONS].tolist()):
            obs[i], _, done, _, _ = envs[i].step(a)
            if done:
                obs[i] = envs[i].reset()[0]
    return record


SPECS = [
    {"name": "top_p", "p": 0.3}, {"name": "top_k", "k": 3}, {"name": "typical", "p": 0.2},
    {"name": "epsilon", "epsilon": 0.03}, {"name": "eta", "eta": 0.03},
    {"name": "mirostat", "tau": 4.0, "learning_rate": 0.5},
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s["name"])
def test_rollout_log_prob_is_the_masked_renormalised_one_and_masked_tokens_are_never_sampled(spec):
    masked, plain = make_module(spec), make_module(None)
    sampler = samplers.Sampler(spec)
    kept_fraction = []
    for batch, out in roll(masked, steps=10):
        raw = plain.forward_inference({Columns.OBS: batch})[Columns.ACTION_DIST_INPUTS].float()
        keep = sampler.keep(raw, out.get(SAMPLER_STATE))
        kept_fraction.append(keep.float().mean().item())
        actions = out[Columns.ACTIONS]
        assert keep.gather(-1, actions[:, None]).all()  # never a masked-out token
        expected = torch.log_softmax(raw.masked_fill(~keep, -math.inf), -1).gather(-1, actions[:, None])[:, 0]
        torch.testing.assert_close(out[Columns.ACTION_LOGP], expected, atol=1e-5, rtol=1e-5)
    assert np.mean(kept_fraction) < 0.9  # the mask really truncates


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s["name"])
def test_training_forward_gives_the_rollout_log_probs(spec):
    module = make_module(spec)
    record = roll(module, rows=4, steps=8)
    obs = {k: torch.cat([b[k] for b, _ in record]) for k in record[0][0]}
    batch = {Columns.OBS: obs, Columns.ACTIONS: torch.cat([o[Columns.ACTIONS] for _, o in record])}
    if spec["name"] == "mirostat":
        batch[SAMPLER_STATE] = torch.cat([o[SAMPLER_STATE] for _, o in record])
    out = module.forward_train(batch)
    logp = TorchCategorical.from_logits(out[Columns.ACTION_DIST_INPUTS]).logp(batch[Columns.ACTIONS])
    rollout_logp = torch.cat([o[Columns.ACTION_LOGP] for _, o in record])
    torch.testing.assert_close(logp, rollout_logp, atol=1e-4, rtol=1e-4)  # PPO's ratio starts at 1
    assert (out[MASK_SIZE] < 42).any() and (out[MASK_SIZE] >= 1).all()
    # The entropy the loss sees is the masked distribution's, finite.
    assert torch.isfinite(TorchCategorical.from_logits(out[Columns.ACTION_DIST_INPUTS]).entropy()).all()


def test_mirostat_mu_follows_each_episode_and_restarts_with_it():
    spec = {"name": "mirostat", "tau": 3.0, "learning_rate": 0.5}
    module, plain = make_module(spec), make_module(None)
    sampler = samplers.Sampler(spec)
    record = roll(module, rows=3, steps=12)
    prev = None
    restarts = 0
    for batch, out in record:
        mu = out[SAMPLER_STATE]
        new_episode = batch["attention_mask"].sum(-1) == batch["attention_mask"][:, -ENV_CFG["max_prompt_len"]:].sum(-1)
        if prev is None:
            assert torch.allclose(mu, torch.full_like(mu, 6.0))
        else:
            p_batch, p_logits, p_mu = prev
            expected = sampler.next_state(p_mu, p_logits, batch["input_ids"][:, -1])
            expected = torch.where(new_episode, torch.full_like(mu, 6.0), expected)
            restarts += int(new_episode.sum())
            torch.testing.assert_close(mu, expected)
        raw = plain.forward_inference({Columns.OBS: batch})[Columns.ACTION_DIST_INPUTS].float()
        prev = (batch, raw, mu)
    assert restarts >= 1  # an episode ended and its row started over from mu_0 = 2 tau


def test_learned_masking_uses_the_frozen_copy_not_the_current_policy():
    spec = {"name": "top_k", "k": 2, "masking": "learned", "sync_every": 5}
    module = make_module(spec)
    with torch.no_grad():  # move the policy away from its masking copy
        for p in module.lm.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    frozen = make_module(None)  # the initial weights the masking copy still holds
    for batch, out in roll(module, steps=4):
        keep = samplers.top_k_mask(frozen.forward_inference({Columns.OBS: batch})[Columns.ACTION_DIST_INPUTS], 2)
        assert keep.gather(-1, out[Columns.ACTIONS][:, None]).all()
    module.sync_mask_model()
    for a, b in zip(module.mask_lm.parameters(), module.lm.parameters()):
        assert torch.equal(a, b)
    assert not any(p.requires_grad for p in module.mask_lm.parameters())


def test_learned_masking_syncs_exactly_every_sync_every_iterations(ray_local):
    from agents.config import algorithm_config, load
    from tests.conftest import QUICKSTART

    cfg = load(QUICKSTART, ["training.train_batch_size=128", "training.minibatch_size=64",
                            "env_runners.num_envs_per_env_runner=8", "sampler.name=top_p", "sampler.p=0.9",
                            "sampler.masking=learned", "sampler.sync_every=2"])
    algo = algorithm_config(cfg).build_algo()

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))

    try:
        learner_module = algo.learner_group._learner.module["default_policy"]
        runner_module = algo.env_runner.module
        synced = []
        for it in range(1, 5):
            result = algo.train()
            synced.append(same(learner_module.mask_lm, learner_module.lm))
            # The EnvRunner acts with the learner's current masking copy.
            assert same(runner_module.mask_lm, learner_module.mask_lm)
            assert result["learners"]["default_policy"]["mask_model_syncs"] == it // 2
            assert 1 <= result["learners"]["default_policy"]["mask_size"] <= 52
        assert synced == [False, True, False, True]
        state = algo.learner_group._learner.get_state()
        assert state["num_updates"] == 4
    finally:
        algo.stop()


def test_generation_from_a_masked_policy_respects_the_mask():
    from agents.generate import generate

    prompts = [None] * 4
    sampled_top1 = generate(make_module({"name": "top_k", "k": 1}), ENV_CFG, prompts, seed=3)
    greedy = generate(make_module(None), ENV_CFG, prompts, greedy=True, seed=3)
    assert [r["generation"] for r in sampled_top1] == [r["generation"] for r in greedy]
    unmasked = generate(make_module(None), ENV_CFG, prompts, seed=3)
    assert [r["generation"] for r in unmasked] != [r["generation"] for r in greedy]


def test_generation_reports_the_task_reward_with_a_dense_env_reward_too():
    from agents.generate import generate
    from env.rewards import increasing_pairs_reward

    prompts = [None] * 4
    sparse = generate(make_module(None), ENV_CFG, prompts, seed=5)
    dense = generate(make_module(None), {**ENV_CFG, "dense_reward": True}, prompts, seed=5)
    assert [r["generation"] for r in dense] == [r["generation"] for r in sparse]
    length = ENV_CFG.get("max_new_tokens", 20)
    by_hand = increasing_pairs_reward(["" for _ in sparse], [r["generation"] for r in sparse], [{}] * 4, length=length)
    assert [r["reward"] for r in dense] == pytest.approx([r["reward"] for r in sparse])
    assert [r["reward"] for r in sparse] == pytest.approx(by_hand)
    assert any(r > 0 for r in by_hand)
