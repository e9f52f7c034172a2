"""Sequence-level policy gradient: REINFORCE with a per-prompt baseline, and self-critical training.

The whole generation is one action sequence with one return R (the task reward, minus the
per-token KL penalty when `reward.kl_coef > 0`). The loss per minibatch is

    -1/N * sum over sequences of (R - b) * sum_t log pi(a_t | s_t)   -  entropy_coeff * H
    (+ training.mle_coef * NLL of the task's references, the mixed objective)

with N the number of sequences, no value head, no ratio, no clipping. Each batch should be
used once (`training.num_epochs: 1`); later minibatches of the same batch are slightly
off-policy, as in any REINFORCE implementation that takes several steps per batch.

The baseline b:
  reinforce      the mean return of the `reinforce.num_samples` episodes of the same prompt
                 (the env draws each prompt that many times in a row, `RepeatedPromptEnv`;
                 episodes of one prompt in a batch are grouped by their prompt tokens, in
                 chunks of num_samples in batch order);
  self_critical  the task reward of the policy's own greedy decode of the same prompt
                 (Rennie et al., 2017), decoded on the learner with the weights that sampled
                 the batch and scored by the task's reward.
"""
from __future__ import annotations

import numpy as np
import torch

from ray.rllib.connectors.connector_v2 import ConnectorV2
from ray.rllib.connectors.learner import GeneralAdvantageEstimation
from ray.rllib.core.columns import Columns
from ray.rllib.evaluation.postprocessing import Postprocessing

from agents.algorithms.base import pick
from agents.algorithms.ppo import PPOSpec
from agents.algorithms.token_learner import TOKEN_TRAINING, TokenAlgorithm, TokenLearner, TokenLearnerConfig
from agents.algorithms.token_learner import loss_step_mean, policy_shift_metrics
from agents.core import SEQ_ID
from agents.modules.decoding import Decoder
from env.text_env import TokenGenerationEnv
from env.validation import Field


def per_prompt_baselines(prompt_keys: list, returns: np.ndarray, num_samples: int) -> np.ndarray:
    """Each episode's baseline: the mean return of its group, where a group is up to
    `num_samples` episodes with the same prompt, taken in batch order."""
    baselines = np.zeros(len(returns), dtype=np.float64)
    by_prompt: dict = {}
    for i, key in enumerate(prompt_keys):
        by_prompt.setdefault(key, []).append(i)
    for idx in by_prompt.values():
        for start in range(0, len(idx), num_samples):
            chunk = idx[start:start + num_samples]
            baselines[chunk] = returns[chunk].mean()
    return baselines


REINFORCE_PARAMS = {  # the RLlib config's own attributes (Fields: type, range, default)
    # "mean": the mean return of the episodes of the same prompt (REINFORCE); "greedy": the reward
    # of the policy's greedy decode of the prompt (self-critical); set by the algorithm's name.
    "baseline": Field(str, "mean", choices=["mean", "greedy"]),
    # reinforce.num_samples: each prompt is drawn for this many episodes in a row (the env repeats
    # it); the baseline is their mean reward.
    "num_samples": Field(int, 4, lo=2),
}


class SequenceLevelAdvantages(ConnectorV2):
    """Learner connector piece (in place of GAE): every step of an episode gets the episode's
    R - b as its advantage. Records the baselines it used in `self.last` (and per episode in
    `self.last_baselines`)."""

    def __init__(self, input_observation_space=None, input_action_space=None, *, baseline: str = "mean",
                 num_samples: int = 4):
        super().__init__(input_observation_space, input_action_space)
        self.baseline, self.num_samples = baseline, num_samples
        self.scorer = None  # the task's reward on the learner (self-critical)
        self.greedy = Decoder()  # its decode engine (captured on a GPU) kept from one batch to the next
        self.last, self.last_baselines = {}, None

    def greedy_baselines(self, module, episodes) -> np.ndarray:
        """The task reward of the greedy decode of each episode's prompt (one decode per distinct prompt)."""
        if self.scorer is None:
            self.scorer = TokenGenerationEnv(module.model_config["env"])
        device = next(module.lm.parameters()).device
        keys, firsts, metas, prompts = [], [], [], []
        for e in episodes:
            first = e.get_observations(0)
            info = e.get_infos(0) or {}
            keys.append((tuple(np.asarray(first["input_ids"])[np.asarray(first["attention_mask"]) == 1].tolist()),
                         repr(info.get("meta", {}))))
            firsts.append(first)
            metas.append(info.get("meta", {}))
        unique = {k: i for i, k in enumerate(keys)}
        order = list(unique.values())
        ids = torch.as_tensor(np.stack([np.asarray(firsts[i]["input_ids"]) for i in order]), device=device)
        mask = torch.as_tensor(np.stack([np.asarray(firsts[i]["attention_mask"]) for i in order]), device=device)
        gens = self.greedy(module, ids, mask, self.scorer.max_new_tokens, self.scorer.eos_id)
        tok = self.scorer.tokenizer
        prompts = [tok.decode(ids[j][mask[j].bool()].tolist(), skip_special_tokens=True) for j in range(len(order))]
        texts = [tok.decode(g, skip_special_tokens=True) for g in gens]
        rewards = self.scorer.score(prompts, texts, [metas[i] for i in order])
        reward_of = {k: rewards[j] for j, k in enumerate(unique)}
        return np.array([reward_of[k] for k in keys], dtype=np.float64)

    def __call__(self, *, rl_module, batch, episodes, **kwargs):
        eps = list(self.single_agent_episode_iterator(episodes, agents_that_stepped_only=False))
        lens = [len(e) for e in eps]
        bounds = np.cumsum([0] + lens)
        for module_id, module_batch in batch.items():
            rewards = torch.as_tensor(module_batch[Columns.REWARDS]).detach().cpu().numpy().astype(np.float64)
            if len(rewards) != bounds[-1]:
                continue
            returns = np.array([rewards[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:])])
            if self.baseline == "greedy":
                baselines = self.greedy_baselines(rl_module[module_id].unwrapped(), eps)
            else:
                keys = []
                for e in eps:
                    first = e.get_observations(0)
                    keys.append(tuple(np.asarray(first["input_ids"])[np.asarray(first["attention_mask"]) == 1].tolist()))
                baselines = per_prompt_baselines(keys, returns, self.num_samples)
            adv = np.repeat(returns - baselines, lens).astype(np.float32)
            if Columns.LOSS_MASK in module_batch:
                adv = adv * torch.as_tensor(module_batch[Columns.LOSS_MASK]).cpu().numpy()
            device = module_batch[Columns.REWARDS].device if torch.is_tensor(module_batch[Columns.REWARDS]) else None
            module_batch[Postprocessing.ADVANTAGES] = torch.as_tensor(adv, device=device)
            module_batch[Postprocessing.VALUE_TARGETS] = torch.zeros(len(adv), device=device)
            self.last_baselines = baselines
            self.last[module_id] = {"baseline_mean": float(baselines.mean()), "sequence_return_mean": float(returns.mean()),
                                    "advantage_abs_mean": float(np.abs(returns - baselines).mean())}
        return batch


class ReinforceTorchLearner(TokenLearner):
    floor_after_gae = False  # sequence-level advantages replace GAE's

    def build(self) -> None:
        super().build()
        self.sequence_advantages = SequenceLevelAdvantages(baseline=self.config.baseline,
                                                           num_samples=self.config.num_samples)
        if self._learner_connector is not None:
            self._learner_connector.insert_after(GeneralAdvantageEstimation, self.sequence_advantages)
            self._learner_connector.remove(GeneralAdvantageEstimation)

    def compute_loss_for_module(self, *, module_id, config, batch, fwd_out):
        module = self.module[module_id].unwrapped()
        mask = batch[Columns.LOSS_MASK] if Columns.LOSS_MASK in batch else torch.ones_like(batch[Columns.ACTIONS],
                                                                                           dtype=torch.bool)
        dist = module.get_train_action_dist_cls().from_logits(fwd_out[Columns.ACTION_DIST_INPUTS])
        logp = dist.logp(batch[Columns.ACTIONS])
        adv = batch[Postprocessing.ADVANTAGES]
        # Sum over each sequence's tokens, mean over sequences: the REINFORCE gradient of E[R].
        n_seq = torch.unique(batch[SEQ_ID][mask]).numel() if SEQ_ID in batch else int(mask.sum())
        policy_loss = -(logp * adv)[mask].sum() / max(n_seq, 1)
        masked_mean = loss_step_mean(batch)
        entropy = masked_mean(dist.entropy())
        entropy_coeff = self.entropy_coeff_schedulers_per_module[module_id].get_current_value()
        self.metrics.log_dict(
            {"policy_loss": policy_loss, "entropy": entropy, **policy_shift_metrics(batch, logp, fwd_out, masked_mean),
             **self.sequence_advantages.last.get(module_id, {})},
            key=module_id, window=1)
        return self.add_mle_term(module_id, policy_loss - entropy_coeff * entropy)


class ReinforceConfig(TokenLearnerConfig):
    @classmethod
    def declared_params(cls) -> dict:
        return {**super().declared_params(), **REINFORCE_PARAMS}

    def __init__(self, algo_class=None):
        super().__init__(algo_class=algo_class or Reinforce)

    def get_default_learner_class(self):
        return ReinforceTorchLearner


class Reinforce(TokenAlgorithm):
    """REINFORCE (per-prompt mean baseline) or self-critical (greedy baseline): PPO's sampling
    and learner plumbing with the sequence-level loss above."""

    @classmethod
    def get_default_config(cls):
        return ReinforceConfig()


class ReinforceSpec(PPOSpec):
    names = ("reinforce", "self_critical")
    summary = "sequence-level policy gradient with a per-prompt mean (reinforce) or greedy (self_critical) baseline"
    training_params = pick(TOKEN_TRAINING, "minibatch_size", "num_epochs", "entropy_coeff", "mle_coef", "mle_batch_size",
                           "update_clipping")
    section = "reinforce"
    schema = {"num_samples": REINFORCE_PARAMS["num_samples"]}
    section_searchable = False  # the env repeats prompts by it: EnvRunners and learner must agree
    seq2seq = False

    def config_class(self):
        return ReinforceConfig

    def env_config(self, cfg: dict, c: dict, env_cfg: dict) -> dict:
        # each prompt num_samples times in a row, for the per-prompt baseline
        return {**env_cfg, "repeat_prompt": c["reinforce"]["num_samples"] if cfg["algorithm"] == "reinforce" else 1}

    def training(self, cfg: dict, c: dict) -> dict:
        return {**super().training(cfg, c), "baseline": "greedy" if cfg["algorithm"] == "self_critical" else "mean",
                "num_samples": c["reinforce"]["num_samples"]}


SPEC = ReinforceSpec()
