"""DQN for language models: RLlib's DQN with the `CausalLMQNetwork` module.

RLlib's own DQN (new API stack) does the rest: the episode replay buffer
(prioritized or uniform), n-step returns summed in the buffer, double Q, the
target network synced every `target_network_update_freq` sampled env steps
(Polyak with `tau`, 1.0 = hard copy) and the Huber or squared TD loss. Two
additions here:

* whole-sequence replay (`dqn.replay: sequences`, `WholeEpisodeReplayBuffer`):
  an update replays every step of a few stored episodes instead of steps
  drawn one by one. Every step's observation (and n-step next observation)
  is a prefix of its episode's sequence, so the module runs the online and
  the target network once per sequence, not once per step (the same saving
  as PPO's sequence batching here: ~T times fewer forward passes for T-step
  episodes). Its n-step returns are cut at the episode's end (the last steps
  get the remaining rewards and no bootstrap), where RLlib's step buffers
  skip steps closer to the end than n. Replay is uniform over episodes;
  `dqn.replay: steps` uses RLlib's own (prioritized) step buffers;
* a greedy evaluation run (explore off, so argmax Q) every
  `evaluation.interval` iterations when the config asks for it;
* an optional per-token reference term: every step's reward gains
  `kl_coef * log p_ref(a_t | s_t)` under the frozen initial LM, the KL-control
  reward of Q-learning (Jaques et al., "Sequence Tutor"): maximising it is
  maximising the task reward minus `kl_coef` times the cross-entropy to the
  reference. The term is added in the learner, per replayed step, which is why
  it needs 1-step returns (n-step sums are formed in the buffer from the stored
  rewards, before the learner sees them; the config refuses the combination).
"""
from __future__ import annotations

import numpy as np

from ray.rllib.algorithms.dqn import DQN, DQNConfig
from ray.rllib.algorithms.dqn.torch.dqn_torch_learner import DQNTorchLearner
from ray.rllib.core.columns import Columns
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer

from agents.algorithms.sequence_batching import SEQ_ID
from agents.modules.actor_critic import reference_logp

REF_LOGP_MEAN = "ref_logp_mean"


class WholeEpisodeReplayBuffer(EpisodeReplayBuffer):
    """Replays whole stored episodes: `sample(num_items)` returns every step of randomly
    drawn episodes (uniformly, with replacement) until at least `num_items` steps, each as
    RLlib's one-transition episode `(o_t, a_t, n-step return, o_t+n)` with `n_step`,
    `weights` (1.0) and `seq_id` (its stored episode) as extra model outputs."""

    def sample(self, num_items=None, *, n_step=None, gamma: float = 0.99, **kwargs):
        n_lo, n_hi = (n_step, n_step + 1) if isinstance(n_step, int) else tuple(n_step or (1, 2))
        out, total = [], 0
        while total < (num_items or 1) and self.episodes:
            position = int(self.rng.integers(len(self.episodes)))
            episode = self.episodes[position]
            steps = len(episode)
            if steps == 0:
                continue
            rewards = np.asarray(episode.get_rewards(), dtype=np.float64)
            seq = position + self._num_episodes_evicted  # unique while the episode is stored
            for t in range(steps):
                n = min(int(self.rng.integers(n_lo, n_hi)), steps - t)
                end = t + n
                out.append(SingleAgentEpisode(
                    observations=[episode.get_observations(t), episode.get_observations(end)],
                    actions=[episode.get_actions(t)],
                    rewards=[float(np.sum(rewards[t:end] * gamma ** np.arange(n)))],
                    terminated=end == steps and episode.is_terminated,
                    truncated=end == steps and episode.is_truncated,
                    observation_space=episode.observation_space, action_space=episode.action_space,
                    extra_model_outputs={"n_step": [n], "weights": [1.0], SEQ_ID: [seq]},
                    len_lookback_buffer=0, t_started=t,
                ))
            total += steps
        self.sampled_timesteps += total
        return out


class LMDQNTorchLearner(DQNTorchLearner):
    def build(self) -> None:
        super().build()
        self.ref_coef = float(self.config.learner_config_dict.get("kl", {}).get("coef", 0.0))

    def compute_loss_for_module(self, *, module_id, config, batch, fwd_out):
        if self.ref_coef > 0.0:
            ref_logp = reference_logp(self.module[module_id].unwrapped().ref_model, batch)
            batch = {**batch, Columns.REWARDS: batch[Columns.REWARDS] + self.ref_coef * ref_logp}
            self.metrics.log_value((module_id, REF_LOGP_MEAN), ref_logp.mean().item(), window=1)
        return super().compute_loss_for_module(module_id=module_id, config=config, batch=batch, fwd_out=fwd_out)


class LMDQNConfig(DQNConfig):
    def __init__(self, algo_class=None):
        super().__init__(algo_class=algo_class or LMDQN)
        self._learner_class = LMDQNTorchLearner

    def get_default_learner_class(self):
        return LMDQNTorchLearner


class LMDQN(DQN):
    @classmethod
    def get_default_config(cls) -> LMDQNConfig:
        return LMDQNConfig()

    def _create_local_replay_buffer_if_necessary(self, config):
        # RLlib builds buffers from a type name it looks up in its own package.
        buffer_cfg = dict(config.get("replay_buffer_config") or {})
        if buffer_cfg.get("type") != WholeEpisodeReplayBuffer.__name__:
            buffer = super()._create_local_replay_buffer_if_necessary(config)
        else:
            del buffer_cfg["type"]
            buffer = WholeEpisodeReplayBuffer(**buffer_cfg, metrics_num_episodes_for_smoothing=(
                self.config.metrics_num_episodes_for_smoothing))
        # RLlib's episode buffers draw from np.random.default_rng(seed=None): seed them from the config.
        if buffer is not None and hasattr(buffer, "rng") and self.config.seed is not None:
            buffer.rng = np.random.default_rng([int(self.config.seed), 0x7265])
        return buffer
