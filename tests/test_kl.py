import numpy as np
import pytest
import torch

from ray.rllib.core.columns import Columns

from agents.algorithms.kl_control import AdaptiveKLController, ReferenceKLPenalty
from tests.test_module import make_module, rollout_obs


def penalised_rewards(module, obs, actions, coef=0.1):
    with torch.no_grad():
        logits = module.forward_train({Columns.OBS: obs})[Columns.ACTION_DIST_INPUTS]
        logp = torch.log_softmax(logits, -1).gather(-1, actions[:, None])[:, 0]
    batch = {"default_policy": {Columns.OBS: obs, Columns.ACTIONS: actions, Columns.ACTION_LOGP: logp,
                                Columns.REWARDS: torch.zeros(len(actions))}}
    piece = ReferenceKLPenalty(controller=AdaptiveKLController(coef))
    out = piece(rl_module={"default_policy": module}, batch=batch, episodes=[object()] * 3)
    return out["default_policy"][Columns.REWARDS], piece.last["default_policy"]


def test_kl_penalty_is_zero_when_policy_equals_reference():
    env, module = make_module()
    obs, _, actions = rollout_obs(env)
    rewards, measured = penalised_rewards(module, obs, actions)
    assert torch.allclose(rewards, torch.zeros_like(rewards), atol=1e-6)
    assert measured["ref_kl"] == pytest.approx(0.0, abs=1e-5)


def test_kl_penalty_is_positive_when_policy_moves_away():
    env, module = make_module()
    obs, _, actions = rollout_obs(env)
    with torch.no_grad():  # move the policy away from the reference
        module.lm.get_output_embeddings().weight.add_(torch.randn_like(module.lm.get_output_embeddings().weight))
    # The moved policy's argmax actions are more likely under it than under the reference.
    with torch.no_grad():
        logits = module.forward_train({Columns.OBS: obs})[Columns.ACTION_DIST_INPUTS]
    actions = logits.argmax(-1)
    rewards, measured = penalised_rewards(module, obs, actions, coef=0.1)
    assert measured["ref_kl"] > 0.1
    assert (rewards < 0).all()  # argmax actions are more likely under the moved policy than under the reference
    assert rewards.sum().item() == pytest.approx(-0.1 * measured["ref_kl"] * 3, rel=1e-4)


def test_adaptive_controller_follows_ziegler_update():
    c = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    c.update(12.0, n_sequences=100)  # err clipped to +0.2
    assert c.coef == pytest.approx(0.2 * (1 + 0.2 * 100 / 10000))
    c.update(3.0, n_sequences=100)  # err = -0.5 -> -0.2
    assert c.coef == pytest.approx(0.2 * (1 + 0.002) * (1 - 0.002))
    fixed = AdaptiveKLController(0.2, target=None)
    fixed.update(100.0, 64)
    assert fixed.coef == 0.2


def test_adaptive_coefficient_moves_toward_the_target_during_training(ray_local):
    """A short PPO run with `reward.kl_adaptive`: the logged coefficient falls while the measured KL
    is below the target (the first batch comes from the reference itself, KL 0) and rises once
    the policy has moved further from the reference than the target, by the Ziegler step each time."""
    from agents.config import algorithm_config, load
    from tests.conftest import QUICKSTART

    target = 0.02
    cfg = load(QUICKSTART, ["reward.kl_coef=0.05", "reward.kl_adaptive=true", f"reward.kl_target={target}",
                            "reward.kl_horizon=100", "training.lr=3.0e-3", "training.train_batch_size=128",
                            "training.minibatch_size=64", "env_runners.num_envs_per_env_runner=8"])
    algo = algorithm_config(cfg).build_algo()
    try:
        logged = [algo.train()["learners"]["default_policy"] for _ in range(3)]
    finally:
        algo.stop()
    coefs = [m["ref_kl_coef"] for m in logged]  # the coefficient each iteration's rewards paid
    kls = [m["ref_kl"] for m in logged]  # the KL per sequence that iteration measured
    assert coefs[0] == pytest.approx(0.05)
    assert kls[0] == pytest.approx(0.0, abs=1e-4)  # sampled by the reference itself: far below the target
    assert max(kls) > 1.5 * target, kls  # the policy moved further than the target
    for i in range(len(coefs) - 1):
        err = min(max(kls[i] / target - 1.0, -0.2), 0.2)
        assert np.sign(coefs[i + 1] - coefs[i]) == np.sign(err), (coefs, kls)
        # the step is err * sequences / horizon: at least 5 sequences of at most 21 steps in 128
        assert abs(coefs[i + 1] / coefs[i] - 1.0) >= abs(err) * 5 / 100
    assert coefs[1] < coefs[0] and coefs[2] > coefs[1], (coefs, kls)  # down, then up
