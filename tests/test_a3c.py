"""A3C: the advantage actor-critic loss, asynchronous updates without a barrier, checkpoints."""
import os
import time

import numpy as np
import pytest
import torch

from ray.rllib.core.columns import Columns
from ray.rllib.evaluation.postprocessing import Postprocessing

from agents.config import algorithm_config, env_config, load, read_yaml, validate
from tests.conftest import QUICKSTART

SMALL = ["algorithm=a3c", "training.train_batch_size=512", "env_runners.num_envs_per_env_runner=8"]


def a2c_quickstart(overrides=()):
    """The quickstart's config as A3C: its PPO-only keys (minibatch_size, num_epochs) removed."""
    raw = read_yaml(QUICKSTART, list(SMALL) + list(overrides))
    for key in ("minibatch_size", "num_epochs"):
        raw["training"].pop(key, None)
    return validate(raw)


def test_a3c_loss_is_the_advantage_actor_critic_loss_by_hand():
    from env.text_env import TokenGenerationEnv

    cfg = a2c_quickstart(["training.vf_loss_coeff=0.7", "training.entropy_coeff=0.03"])
    learner = algorithm_config(cfg).build_learner(env=TokenGenerationEnv(env_config(cfg)))
    module = learner.module["default_policy"].unwrapped()

    env = TokenGenerationEnv(env_config(cfg))
    rng = np.random.default_rng(0)
    obs, rows = env.reset(seed=0)[0], []
    for _ in range(6):  # one short episode's observations, random actions
        rows.append(obs)
        obs = env.step(int(rng.integers(env.action_space.n)))[0]
    n = len(rows)
    batch = {
        Columns.OBS: {k: torch.as_tensor(np.stack([o[k] for o in rows])) for k in rows[0]},
        Columns.ACTIONS: torch.as_tensor(rng.integers(env.action_space.n, size=n)),
        Columns.ACTION_LOGP: torch.full((n,), -2.0),  # stale acting log-probs: A3C must not use them
        Postprocessing.ADVANTAGES: torch.tensor([1.0, -0.5, 2.0, 0.0, -1.5, 0.3]),
        Postprocessing.VALUE_TARGETS: torch.tensor([0.9, 0.1, -0.3, 0.5, 0.0, 1.2]),
        Columns.LOSS_MASK: torch.tensor([True, True, True, True, True, False]),  # last row: padding
    }
    fwd = module.forward_train(batch)
    loss = learner.compute_loss_for_module(
        module_id="default_policy", config=learner.config.get_config_for_module("default_policy"),
        batch=batch, fwd_out=fwd)

    # By hand: -log pi(a|s) A + c_v (V - R)^2 - c_H H, averaged over the 5 real steps.
    logits = fwd[Columns.ACTION_DIST_INPUTS].detach().double()
    log_p = torch.log_softmax(logits, -1)
    chosen = log_p[torch.arange(n), batch[Columns.ACTIONS]]
    entropy = -(log_p.exp() * log_p).sum(-1)
    values = module.compute_values(batch).detach().double()
    adv, target = batch[Postprocessing.ADVANTAGES].double(), batch[Postprocessing.VALUE_TARGETS].double()
    per_step = -chosen * adv + 0.7 * (values - target) ** 2 - 0.03 * entropy
    expected = per_step[:5].mean()
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-5, abs=1e-6)
    # No importance ratio: the stale log-probs do not change the loss.
    batch[Columns.ACTION_LOGP] = torch.full((n,), -9.0)
    again = learner.compute_loss_for_module(
        module_id="default_policy", config=learner.config.get_config_for_module("default_policy"),
        batch=batch, fwd_out=module.forward_train(batch))
    assert float(again.detach()) == pytest.approx(float(loss.detach()), rel=1e-6)


def _slow_down(runner, seconds):
    """Makes one EnvRunner's every sample() take `seconds` longer (runs on the EnvRunner)."""
    original = type(runner).sample

    def slow_sample(self, *args, **kwargs):
        time.sleep(seconds)
        return original(self, *args, **kwargs)

    runner.sample = slow_sample.__get__(runner)
    return os.getpid()


@pytest.mark.slow
def test_a3c_keeps_learning_while_one_env_runner_is_slow(ray_local):
    cfg = a2c_quickstart(["env_runners.num_env_runners=2", "env_runners.num_cpus_per_env_runner=0.25"])
    algo = algorithm_config(cfg).build_algo()
    try:
        group = algo.env_runner_group
        slow, fast = group.healthy_worker_ids()
        group.foreach_env_runner(lambda r: _slow_down(r, 5.0), remote_worker_ids=[slow], local_env_runner=False)
        returns = []
        while algo.updates_by_env_runner.get(slow, 0) < 3:
            returns.append(algo.train()["env_runners"]["episode_return_mean"])
        counts = dict(algo.updates_by_env_runner)
        # With a barrier every EnvRunner would contribute one batch per round; here the fast
        # one's batches went into the learner while the slow one was still sampling.
        assert counts[fast] >= 2 * counts[slow], counts
        assert all(np.isfinite(returns))
    finally:
        algo.stop()


@pytest.mark.slow
def test_a3c_raises_the_reward_and_its_checkpoint_restores_and_keeps_training(ray_local, tmp_path):
    cfg = a2c_quickstart()  # num_env_runners 0: A2C in the trial's own process
    algo = algorithm_config(cfg).build_algo()
    try:
        returns = [algo.train()["env_runners"]["episode_return_mean"] for _ in range(40)]
        path = algo.save(str(tmp_path / "ckpt")).checkpoint.path
        weights = {k: v.clone() for k, v in algo.learner_group._learner.module["default_policy"].state_dict().items()}
    finally:
        algo.stop()
    # The first batch is the random policy's (about 0.39 with whole, unbiased episodes); A2C with
    # one 8-episode batch per step climbs slowly from there.
    assert returns[0] < 0.45 and np.mean(returns[-3:]) > returns[0] + 0.07, returns

    from agents.algorithms.a3c import A3C

    restored = A3C.from_checkpoint(path)
    try:
        module = restored.learner_group._learner.module["default_policy"]
        for k, v in module.state_dict().items():
            assert torch.equal(v, weights[k]), k
        more = [restored.train()["env_runners"]["episode_return_mean"] for _ in range(3)]
        assert np.mean(more) > returns[0] + 0.07, more  # continues from the trained policy
    finally:
        restored.stop()


def test_lr_anneals_linearly_over_env_steps_and_half_a_schedule_is_refused():
    from ray.rllib.utils.metrics import NUM_ENV_STEPS_SAMPLED_LIFETIME

    from agents.config import ConfigError
    from env.text_env import TokenGenerationEnv

    cfg = a2c_quickstart(["training.lr=1e-3", "training.lr_end=0", "training.lr_decay_steps=1000"])
    learner = algorithm_config(cfg).build_learner(env=TokenGenerationEnv(env_config(cfg)))
    optimizer = next(iter(learner._named_optimizers.values()))
    for steps, expected in ((0, 1e-3), (250, 7.5e-4), (1000, 0.0), (5000, 0.0)):
        learner.after_gradient_based_update(timesteps={NUM_ENV_STEPS_SAMPLED_LIFETIME: steps})
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ConfigError, match=r"^training.lr_end: needs training.lr_decay_steps too"):
        load(QUICKSTART, ["training.lr_end=1e-5"])
