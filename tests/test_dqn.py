"""DQN on the token env: Q-targets by hand, the logits head's start, config refusals, checkpoints."""
import os

import numpy as np
import pytest
import torch

from ray.rllib.core.columns import Columns

from agents.config import ConfigError, algorithm_config, env_config, load
from tests.conftest import ROOT

DQN_YAML = os.path.join(ROOT, "tune_configs", "dqn_synthetic.yaml")
SMALL = ["env_runners.num_envs_per_env_runner=4", "dqn.learning_starts=100", "training.train_batch_size=32",
         "dqn.steps_per_iteration=100"]


def _learner(overrides):
    from env.text_env import TokenGenerationEnv

    cfg = load(DQN_YAML, SMALL + overrides)
    learner = algorithm_config(cfg).build_learner(env=TokenGenerationEnv(env_config(cfg)))
    return cfg, learner, learner.module["default_policy"].unwrapped()


def _episode(cfg, rng, rewards):
    """A finished episode of the token env with random actions and the given per-step rewards."""
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    from env.text_env import TokenGenerationEnv

    env = TokenGenerationEnv(env_config(cfg))
    obs = env.reset(seed=int(rng.integers(1000)))[0]
    episode = SingleAgentEpisode(observations=[obs], observation_space=env.observation_space,
                                 action_space=env.action_space)
    for i, r in enumerate(rewards):
        action = int(rng.integers(2, env.action_space.n))  # a number token: 0 is pad, 1 is EOS
        obs = env.step(action)[0]
        episode.add_env_step(obs, action, float(r), terminated=i == len(rewards) - 1)
    return episode


def _replayed_batch(learner, episodes):
    """A learner batch (tensors) of 8 one-step transitions replayed from RLlib's episode buffer."""
    from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer

    buffer = EpisodeReplayBuffer(capacity=100)
    buffer.add(episodes)
    sampled = buffer.sample(num_items=8, n_step=1, gamma=1.0, sample_episodes=True)
    batch = learner._learner_connector(rl_module=learner.module, batch={}, episodes=sampled, shared_data={},
                                       metrics=None)["default_policy"]
    batch = {k: ({kk: torch.as_tensor(vv) for kk, vv in v.items()} if isinstance(v, dict) else torch.as_tensor(v))
             for k, v in batch.items()}
    batch.setdefault("weights", torch.ones(len(batch[Columns.ACTIONS])))
    return batch


def _key(input_ids, action) -> tuple:
    return tuple(np.asarray(input_ids).tolist()), int(action)


@pytest.mark.parametrize("replay", ["steps", "sequences"])
def test_q_targets_match_a_hand_computation_with_double_q_n_step_and_terminal_masking(replay):
    from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer

    from agents.algorithms.replay import WholeEpisodeReplayBuffer

    extra = ["dqn.replay=steps", "dqn.prioritized=true"] if replay == "steps" else []
    cfg, learner, module = _learner(["dqn.n_step=3", "training.gamma=0.9", "dqn.td_loss=mse"] + extra)
    with torch.no_grad():  # the online net drifts from the target net, so double Q picks differ from max Q
        for p in module.q_head.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    rng = np.random.default_rng(0)
    rewards = [[0.0, 0.2, 0.0, 0.0, 1.0], [0.5, 0.0, 0.3, 0.0, 0.0, 2.0, 0.0]]
    episodes = [_episode(cfg, rng, r) for r in rewards]
    # Where each (observation, action) sits: (episode, t), to read the hand targets off the raw
    # episodes (every episode starts from the same observation; the actions tell them apart).
    where = {}
    for e, ep in enumerate(episodes):
        for t in range(len(ep)):
            where[_key(ep.get_observations(t)["input_ids"], ep.get_actions(t))] = (e, t)
    assert len(where) == sum(len(ep) for ep in episodes)

    if replay == "steps":  # RLlib's prioritized step buffer
        buffer = PrioritizedEpisodeReplayBuffer(capacity=1000, alpha=0.6)
    else:  # every step of whole episodes; the module runs once per sequence
        buffer = WholeEpisodeReplayBuffer(capacity=1000)
    buffer.add(episodes)
    sampled = buffer.sample(num_items=24, n_step=3, gamma=0.9, beta=0.4, sample_episodes=True)
    batch = learner._learner_connector(rl_module=learner.module, batch={}, episodes=sampled, shared_data={},
                                       metrics=None)["default_policy"]
    batch = {k: (v if isinstance(v, dict) else torch.as_tensor(v)) for k, v in batch.items()}
    batch[Columns.OBS] = {k: torch.as_tensor(v) for k, v in batch[Columns.OBS].items()}
    batch[Columns.NEXT_OBS] = {k: torch.as_tensor(v) for k, v in batch[Columns.NEXT_OBS].items()}
    fwd = module.forward_train(batch)
    loss = learner.compute_loss_for_module(
        module_id="default_policy", config=learner.config.get_config_for_module("default_policy"),
        batch=batch, fwd_out=fwd)

    def q(net_trunk, head, obs):
        ids, mask = obs["input_ids"], obs["attention_mask"]
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        h = net_trunk(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state[:, -1]
        return head(h).double()

    seen_terminal = seen_short = False
    per_row = []
    with torch.no_grad():
        for i in range(len(batch[Columns.ACTIONS])):
            obs = {k: v[i:i + 1] for k, v in batch[Columns.OBS].items()}
            e, t = where[_key(obs["input_ids"][0], batch[Columns.ACTIONS][i])]
            ep = episodes[e]
            n = min(3, len(ep) - t)  # cut at the end (RLlib's step buffer skips those steps instead)
            assert n == 3 or replay == "sequences", (e, t)
            assert int(batch["n_step"][i]) == n
            ret = sum(0.9 ** k * rewards[e][t + k] for k in range(n))
            nxt = {k: torch.as_tensor(np.asarray(v))[None] for k, v in ep.get_observations(t + n).items()}
            terminal = t + n == len(ep)
            seen_terminal |= terminal
            seen_short |= not terminal
            a_star = q(module.lm.base_model, module.q_head, nxt).argmax(-1)  # online net picks
            boot = q(module._target_trunk, module._target_q_head, nxt)[0, a_star]  # target net values
            target = ret + (0.0 if terminal else 0.9 ** n * float(boot))
            q_sa = q(module.lm.base_model, module.q_head, obs)[0, int(batch[Columns.ACTIONS][i])]
            assert float(batch[Columns.REWARDS][i]) == pytest.approx(ret, abs=1e-6)
            per_row.append(float(batch["weights"][i]) * (float(q_sa) - target) ** 2)
    assert seen_terminal and seen_short
    if replay == "sequences":
        assert "seq_id" in batch and len(set(batch["seq_id"].tolist())) < len(batch["seq_id"])
    assert float(loss.detach()) == pytest.approx(np.mean(per_row), rel=1e-4, abs=1e-6)


def test_logits_head_starts_greedy_as_the_lm_argmax_and_mlp_head_does_not():
    from env.text_env import TokenGenerationEnv

    cfg, _, module = _learner(["dqn.dueling=true"])
    env = TokenGenerationEnv(env_config(cfg))
    rng = np.random.default_rng(1)
    rows = []
    for seed in range(4):
        obs = env.reset(seed=seed)[0]
        for _ in range(int(rng.integers(0, 6))):
            obs = env.step(int(rng.integers(2, env.action_space.n)))[0]
        rows.append(obs)
    batch = {Columns.OBS: {k: torch.as_tensor(np.stack([o[k] for o in rows])) for k in rows[0]}}
    with torch.no_grad():
        ids, mask = batch[Columns.OBS]["input_ids"], batch[Columns.OBS]["attention_mask"]
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        lm_logits = module.lm(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
        greedy = module.forward_inference(batch)[Columns.ACTION_DIST_INPUTS].argmax(-1)
    assert torch.equal(greedy, lm_logits.argmax(-1))

    _, _, mlp = _learner(["dqn.head=mlp"])
    assert isinstance(mlp.q_head, torch.nn.Sequential) and len(mlp.q_head) == 5  # 3 linear layers, 2 ReLU
    assert mlp.q_head[0].out_features == 64 and mlp.q_head[2].out_features == 64


def _varied_observations(cfg, n=5, seed=1) -> dict:
    """A batch of env observations after 0..5 random number tokens."""
    from env.text_env import TokenGenerationEnv

    env = TokenGenerationEnv(env_config(cfg))
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        obs = env.reset(seed=i)[0]
        for _ in range(i % 6):
            obs = env.step(int(rng.integers(2, env.action_space.n)))[0]
        rows.append(obs)
    return {Columns.OBS: {k: torch.as_tensor(np.stack([o[k] for o in rows])) for k in rows[0]}}


def _last_hidden(trunk, obs) -> torch.Tensor:
    ids, mask = obs["input_ids"], obs["attention_mask"]
    return trunk(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).last_hidden_state[:, -1]


def test_dueling_q_is_v_plus_a_minus_mean_a_and_the_v_stream_moves_every_actions_q_alike():
    from ray.rllib.algorithms.dqn.default_dqn_rl_module import QF_PREDS

    cfg, learner, module = _learner(["dqn.dueling=true", "dqn.n_step=1"])
    batch = _varied_observations(cfg)
    with torch.no_grad():
        torch.manual_seed(0)  # V starts at zero (the initial greedy action is the head's); give it values
        module.v_head.weight.normal_(0.0, 0.5)
        module.v_head.bias.fill_(0.3)
        h = _last_hidden(module.lm.base_model, batch[Columns.OBS]).float()
        a, v = module.q_head(h).float(), module.v_head(h).float()
        q = module.compute_q_values(batch)[QF_PREDS]
        torch.testing.assert_close(q, v + a - a.mean(-1, keepdim=True), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(q.mean(-1), v[:, 0], atol=1e-5, rtol=1e-5)  # V is the mean Q of the state

        module.v_head.weight.add_(torch.randn_like(module.v_head.weight))  # move only the V stream
        module.v_head.bias.add_(0.7)
        moved = module.compute_q_values(batch)[QF_PREDS]
        shift = moved - q
        # every action of a state moves by that state's change of V, so the greedy action stays ...
        torch.testing.assert_close(shift, (module.v_head(h).float() - v).expand_as(shift), atol=1e-5, rtol=1e-5)
        assert (shift.abs() > 1e-2).all() and shift.std(-1).max() < 1e-5
        assert shift[:, 0].std() > 1e-2  # ... and V depends on the state, not one constant
        assert torch.equal(moved.argmax(-1), q.argmax(-1))
    # The target network has a V stream of its own, synced with the online one.
    assert any(online is module.v_head for online, _ in module.get_target_network_pairs())
    # The TD loss trains the V stream.
    rng = np.random.default_rng(2)
    train = _replayed_batch(learner, [_episode(cfg, rng, [0.0, 0.5, 1.0]), _episode(cfg, rng, [0.2, 0.0, 0.0, 1.0])])
    loss = learner.compute_loss_for_module(module_id="default_policy", batch=train, fwd_out=module.forward_train(train),
                                           config=learner.config.get_config_for_module("default_policy"))
    module.zero_grad()
    loss.backward()
    assert module.v_head.weight.grad is not None and module.v_head.weight.grad.abs().sum() > 0

    # Without dueling there is no V stream: Q is the head's output.
    cfg, _, plain = _learner(["dqn.dueling=false"])
    assert not hasattr(plain, "v_head") and not any("v_head" in k for k in plain.state_dict())
    with torch.no_grad():
        h = _last_hidden(plain.lm.base_model, batch[Columns.OBS]).float()
        torch.testing.assert_close(plain.compute_q_values(batch)[QF_PREDS], plain.q_head(h).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overrides, message", [
    (["sampler.name=top_p", "sampler.p=0.9", "sampler.masking=learned"],
     "sampler.name: DQN acts epsilon-greedy on its Q-values"),
    (["training.clip_param=0.2"], "training.clip_param: not used by algorithm 'dqn'"),
    (["reward.kl_coef=0.01", "dqn.n_step=3"], "reward.kl_coef: DQN's per-token reference term needs dqn.n_step: 1"),
    (["dqn.head=linear"], "dqn.head: expected one of 'logits', 'mlp', got 'linear'"),
    (["dqn.tau=0"], "dqn.tau: expected a number in (0.0, 1.0], got 0.0"),
])
def test_dqn_refuses_options_it_cannot_use_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load(DQN_YAML, overrides)
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


def test_dqn_section_with_another_algorithm_is_refused():
    with pytest.raises(ConfigError, match=r"^dqn: only used by algorithm dqn "):
        load(DQN_YAML, ["algorithm=ppo"])


def test_reference_term_adds_kl_coef_times_reference_logp_to_each_reward():
    cfg, learner, module = _learner(["reward.kl_coef=0.5", "dqn.n_step=1", "dqn.td_loss=mse"])
    rng = np.random.default_rng(2)
    episodes = [_episode(cfg, rng, [0.0, 0.0, 1.0])]
    batch = _replayed_batch(learner, episodes)
    cfg_m = learner.config.get_config_for_module("default_policy")
    with_term = learner.compute_loss_for_module(module_id="default_policy", config=cfg_m, batch=batch,
                                                fwd_out=module.forward_train(batch))
    with torch.no_grad():
        ids, mask = batch[Columns.OBS]["input_ids"], batch[Columns.OBS]["attention_mask"]
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        ref_logits = module.ref_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
        ref_logp = torch.log_softmax(ref_logits.float(), -1).gather(-1, batch[Columns.ACTIONS].long()[:, None])[:, 0]
    shifted = {**batch, Columns.REWARDS: batch[Columns.REWARDS] + 0.5 * ref_logp}
    learner.ref_coef = 0.0
    by_hand = learner.compute_loss_for_module(module_id="default_policy", config=cfg_m, batch=shifted,
                                              fwd_out=module.forward_train(shifted))
    assert float(with_term) == pytest.approx(float(by_hand), rel=1e-5)
    assert float(ref_logp.mean()) < -1.0  # a real penalty: the reference spreads mass over ~50 tokens


def test_prioritized_replay_gets_each_replayed_steps_td_error_as_its_priority_during_training(ray_local):
    """A short DQN run with RLlib's prioritized step buffer: after every update the buffer's
    priorities of the replayed steps are the update's TD errors (to the power alpha), no longer
    the maximal priority new steps enter with."""
    from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer

    cfg = load(DQN_YAML, SMALL + ["dqn.replay=steps", "dqn.prioritized=true", "dqn.alpha=0.6"])
    algo = algorithm_config(cfg).build_algo()
    try:
        buffer = algo.local_replay_buffer
        assert isinstance(buffer, PrioritizedEpisodeReplayBuffer)
        updates = []  # (iteration, replayed tree indices, the priorities handed to the buffer) per update
        update_priorities = buffer.update_priorities

        def recording(priorities, module_id=None):
            updates.append((len(results), list(buffer._last_sampled_indices), np.array(priorities, dtype=np.float64)))
            return update_priorities(priorities, module_id)

        buffer.update_priorities = recording
        results = []
        for _ in range(2):  # 1 update (learning starts), then 6
            results.append(algo.train())
        stored = {i: buffer._sum_segment[i] for i in updates[-1][1]}
    finally:
        algo.stop()
    assert len(updates) >= 3, len(updates)  # priorities were updated after the updates of the run
    for _, indices, td in updates:
        assert len(indices) == len(td) == cfg["training"]["train_batch_size"]
        assert np.isfinite(td).all() and (td >= 0).all() and td.std() > 0
    # The learner's logged TD error (the mean over an iteration's updates) is what the buffer received.
    for it, result in enumerate(results):
        means = [td.mean() for i, _, td in updates if i == it]
        if means:
            assert result["learners"]["default_policy"]["td_error_mean"] == pytest.approx(np.mean(means), rel=1e-5)
    # The buffer now holds |TD error| ** alpha for the last update's steps (a step replayed twice: its last error).
    _, indices, td = updates[-1]
    expected = {}
    for i, err in zip(indices, td):
        expected[i] = max(err, 1e-12) ** 0.6
    assert stored == pytest.approx(expected, rel=1e-6)
    assert all(abs(p - 1.0) > 1e-6 for p in stored.values())  # new steps enter at the max priority, 1.0


@pytest.mark.slow
def test_dqn_trains_greedy_evaluates_and_its_checkpoint_restores_and_keeps_training(ray_local, tmp_path):
    from agents.algorithms.dqn import LMDQN
    from agents.generate import generate, load_policy

    cfg = load(DQN_YAML, SMALL + ["evaluation.interval=2", "evaluation.episodes=8"])
    algo = algorithm_config(cfg).build_algo()
    try:
        results = [algo.train() for _ in range(4)]
        path = algo.save(str(tmp_path / "ckpt")).checkpoint.path
        weights = {k: v.clone() for k, v in algo.learner_group._learner.module["default_policy"].state_dict().items()}
        updates = results[-1]["learners"]["default_policy"]["num_module_steps_trained_lifetime"]
    finally:
        algo.stop()
    assert updates > 0
    assert "episode_return_mean" in results[1]["evaluation"]["env_runners"]

    restored = LMDQN.from_checkpoint(path)
    try:
        module = restored.learner_group._learner.module["default_policy"]
        for k, v in module.state_dict().items():
            assert torch.equal(v, weights[k]), k
        ((_, optimizer),) = restored.learner_group._learner.get_optimizers_for_module("default_policy")
        assert optimizer.param_groups[0]["fused"] is True  # agents.algorithms.base.adam, kept by the restore
        more = restored.train()["learners"]["default_policy"]["num_module_steps_trained_lifetime"]
        assert more > updates  # keeps training from where it was
    finally:
        restored.stop()
    policy = load_policy(path)
    out = generate(policy, policy.model_config["env"], [None, None], greedy=True)
    assert len(out) == 2 and all(0.0 <= o["reward"] <= 1.0 for o in out)
