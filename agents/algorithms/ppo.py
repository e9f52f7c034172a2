"""PPO for language models on RLlib's new API stack: the clipped surrogate with a value head and
GAE, as RL4LMs sets it up. What every token learner shares (the reference-KL penalty, whole-sequence
minibatches, the MLE term, NLPO's mask sync, the generators in checkpoints) is the base it builds
on, `agents/algorithms/token_learner.py`.
"""
from __future__ import annotations

import torch
from ray.rllib.core.columns import Columns
from ray.rllib.evaluation.postprocessing import Postprocessing

from agents.algorithms.base import REFERENCE_KL, AlgorithmSpec, plain
from agents.algorithms.token_learner import TOKEN_TRAINING, TokenAlgorithm, TokenLearner, TokenLearnerConfig
from agents.algorithms.static_update import static_config_blocker
from agents.algorithms.token_learner import policy_shift_metrics
from env.validation import ConfigError


class LMPPOTorchLearner(TokenLearner):
    """PPO's clipped surrogate, clipped value loss and entropy bonus (+ the MLE term)."""

    def loss_terms(self, module_id, config, batch, fwd_out, reduce, entropy_coeff):
        """(PPO's loss, its metrics) with means and the explained variance taken by `reduce`
        (`StepMean` over the loss steps; the static update's weighted sums over padded rows)."""
        module = self.module[module_id].unwrapped()
        mean = reduce.mean
        dist = module.get_train_action_dist_cls().from_logits(fwd_out[Columns.ACTION_DIST_INPUTS])
        logp = dist.logp(batch[Columns.ACTIONS])
        ratio = torch.exp(logp - batch[Columns.ACTION_LOGP])
        adv = batch[Postprocessing.ADVANTAGES]
        surrogate = torch.min(adv * ratio, adv * torch.clamp(ratio, 1 - config.clip_param, 1 + config.clip_param))
        entropy = dist.entropy()

        values = module.compute_values(batch, embeddings=fwd_out.get(Columns.EMBEDDINGS))
        vf_loss = (values - batch[Postprocessing.VALUE_TARGETS]).pow(2)
        vf_loss_clipped = torch.clamp(vf_loss, 0, config.vf_clip_param)

        total = mean(-surrogate + config.vf_loss_coeff * vf_loss_clipped - entropy_coeff * entropy)
        metrics = {
            "policy_loss": -mean(surrogate),
            "vf_loss": mean(vf_loss_clipped),
            "vf_explained_var": reduce.explained_variance(batch[Postprocessing.VALUE_TARGETS], values),
            "entropy": mean(entropy),
            "clip_fraction": mean(((ratio - 1).abs() > config.clip_param).float()),
            **policy_shift_metrics(batch, logp, fwd_out, mean),
        }
        return total, metrics


class LMPPOConfig(TokenLearnerConfig):
    """RLlib's PPOConfig plus the language-model options of the token learners."""

    def __init__(self, algo_class=None):
        super().__init__(algo_class=algo_class or LMPPO)

    def get_default_learner_class(self):
        return LMPPOTorchLearner


class LMPPO(TokenAlgorithm):
    @classmethod
    def get_default_config(cls):
        return LMPPOConfig()


class PPOSpec(AlgorithmSpec):
    """PPO and what builds on its learner (A3C, REINFORCE, the guided algorithms)."""

    names = ("ppo",)
    summary = "PPO with a value head, GAE and a per-token KL penalty (RL4LMs' setup)"
    training_params = TOKEN_TRAINING
    reward_params = REFERENCE_KL
    seq2seq = True

    def config_class(self):
        return LMPPOConfig

    def check(self, raw: dict, cfg: dict) -> None:
        t = cfg["training"]
        if "minibatch_size" in self.training_keys and plain(t["minibatch_size"]) > plain(t["train_batch_size"]):
            raise ConfigError(f"training.minibatch_size: {plain(t['minibatch_size'])} is larger than "
                              f"training.train_batch_size={plain(t['train_batch_size'])}")
        if "static_update" in self.training_keys and t["static_update"] is True:
            why = static_config_blocker({**cfg, "training": {k: plain(v) for k, v in t.items()}})
            if why is not None:
                raise ConfigError(f"training.static_update: {why}")

    def training(self, cfg: dict, c: dict) -> dict:
        return {**super().training(cfg, c), "use_kl_loss": False}  # the KL is a reward term here


SPEC = PPOSpec()
