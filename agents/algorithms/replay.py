"""DQN's replay of whole stored episodes (`dqn.replay: sequences`): every step of an episode in
one update, so the Q-network forwards each stored sequence once (agents/algorithms/dqn.py)."""
from __future__ import annotations

import numpy as np
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer

from agents.core import SEQ_ID


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
            seq = position  # groups one sample()'s steps by stored episode (a deterministic order)
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
