"""DQN for language models: RLlib's DQN with the `CausalLMQNetwork` module.

RLlib's own DQN (new API stack) does the rest: the episode replay buffer
(prioritized or uniform), n-step returns summed in the buffer, double Q, the
target network synced every `target_network_update_freq` sampled env steps
(Polyak with `tau`, 1.0 = hard copy) and the Huber or squared TD loss. Two
additions here:

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

import torch

from ray.rllib.algorithms.dqn import DQN, DQNConfig
from ray.rllib.algorithms.dqn.torch.dqn_torch_learner import DQNTorchLearner
from ray.rllib.core.columns import Columns

from agents.modules.actor_critic import hidden_at_last_token

REF_LOGP_MEAN = "ref_logp_mean"


class LMDQNTorchLearner(DQNTorchLearner):
    def build(self) -> None:
        super().build()
        self.ref_coef = float(self.config.learner_config_dict.get("kl", {}).get("coef", 0.0))

    def compute_loss_for_module(self, *, module_id, config, batch, fwd_out):
        if self.ref_coef > 0.0:
            module = self.module[module_id].unwrapped()
            with torch.no_grad():
                ref = module.ref_model
                hidden = hidden_at_last_token(ref.base_model, batch[Columns.OBS])
                logp = torch.log_softmax(ref.get_output_embeddings()(hidden).float(), -1)
                ref_logp = logp.gather(-1, batch[Columns.ACTIONS].long()[:, None])[:, 0]
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
