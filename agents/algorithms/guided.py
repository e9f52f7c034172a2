"""RL with guided feedback (RLGF): PPO++, AggreVaTeD, LOLS and DLOLS as configurations of one algorithm.

All four are PPO (the `LMPPO` learner: clipped ratio, value head, KL penalty, whole-sequence
minibatches) on data whose roll-ins come partly from a guide policy (`agents/guides.py`).
The EnvRunner-side module plays the guide's tokens and stores each step's role; the learner
turns roles into losses (`guided_advantages.py`) and this file decides, per training iteration,
which roll-in episodes get:

  ppo_pp      every iteration PPO++: with probability `guide.beta` an episode starts with a
              guide roll-in of k ~ U{1..T-1} tokens, and only the policy's own steps (those
              after the roll-in) enter the loss. The roll-in is the restart distribution:
              the transition is deterministic, so the policy continues from exactly the
              state a restart to the guide's prefix would give.
  aggrevated  every iteration AggreVaTeD: a mixture roll-in (each token the guide's with
              probability `guide.mix`) up to a step d ~ U{0..T-1}, one policy action at d,
              the guide completes the text. The only loss step is d; its advantage is the
              completed text's return minus the value head's V(s_d), under the same
              clipped PPO objective.
  lols        each iteration is AggreVaTeD with probability `guide.lols_prob`, else PPO++
              (a seeded coin per iteration, the same on resume).
  dlols       AggreVaTeD for the first `switch_iteration` iterations (`guide.switch_iteration`,
              or `guide.switch_fraction` of `stop.training_iteration`), PPO++ after.
  ppo         no guide at all (lets a sweep over `algorithm` include the baseline).

Guide steps neither pay the KL penalty nor count in the loss (their loss mask is off);
advantages are standardised over the loss steps only.
"""
from __future__ import annotations

import os

import numpy as np
from ray.rllib.connectors.learner import GeneralAdvantageEstimation

from agents.algorithms.base import candidates, module_seed, plain
from agents.algorithms.guided_advantages import GuidedAdvantageEstimation, MaskGuideSteps
from agents.algorithms.ppo import LMPPO, LMPPOConfig, LMPPOTorchLearner, PPOSpec
from agents.algorithms.sequence_batching import AddSequenceIds
from agents.core import EPISODES_PER_RESULT, GUIDE_ROLE
from agents.guides import POLICY
from env.validation import ConfigError, Field, is_search_space


GUIDE_SECTION = {  # the `guide` section
    "name_or_path": Field(str, None, optional=True),  # a causal LM sharing the policy's vocabulary
    "callable": Field(str, None, optional=True),  # 'module:function': prefix texts -> continuations
    "greedy": Field(bool, False),  # an LM guide takes its argmax token instead of sampling
    "beta": Field(float, 0.2, lo=0.0, hi=1.0),  # PPO++: probability an episode starts with a guide roll-in
    "mix": Field(float, 0.8, lo=0.0, hi=1.0),  # AggreVaTeD: probability a roll-in token is the guide's
    "lols_prob": Field(float, 0.2, lo=0.0, hi=1.0),  # LOLS: probability an iteration is AggreVaTeD
    # DLOLS: AggreVaTeD for this many iterations, or this fraction of stop.training_iteration; then PPO++.
    "switch_iteration": Field(int, None, lo=0, optional=True),
    "switch_fraction": Field(float, 0.2, lo=0.0, hi=1.0),
}

GUIDED_PARAMS = {  # the RLlib config's own attributes (Fields: type, range, default)
    # Which of ppo_pp, aggrevated, lols, dlols (or ppo: no guide) decides each iteration's roll-ins.
    "guided_algorithm": Field(str, "ppo_pp"),  # the config's `algorithm` (GuidedSpec.names, or ppo)
    # DLOLS: AggreVaTeD for iterations [0, switch_iteration), PPO++ after.
    "switch_iteration": GUIDE_SECTION["switch_iteration"],
    # LOLS: the probability an iteration is AggreVaTeD (a coin seeded by guide_seed and the iteration).
    "lols_prob": GUIDE_SECTION["lols_prob"],
    "guide_seed": Field(int, 0),
}


def guide_mode(guided: dict, iteration: int) -> str:
    """The roll-in mode ('none', 'ppo_pp' or 'aggrevated') of training iteration `iteration` (0-based)."""
    algo = guided["algorithm"]
    if algo == "ppo":
        return "none"
    if algo in ("ppo_pp", "aggrevated"):
        return algo
    if algo == "dlols":
        return "aggrevated" if iteration < guided["switch_iteration"] else "ppo_pp"
    if algo == "lols":
        coin = np.random.default_rng([int(guided.get("seed", 0)), int(iteration)]).random()
        return "aggrevated" if coin < guided["lols_prob"] else "ppo_pp"
    raise ValueError(f"algorithm: {algo!r} is not a guided algorithm")


class GuidedPPOTorchLearner(LMPPOTorchLearner):
    floor_after_gae = False  # the guided estimate replaces GAE and applies the floor itself

    def build(self) -> None:
        super().build()
        if self._learner_connector is not None:
            self._learner_connector.insert_before(AddSequenceIds, MaskGuideSteps())
            self._learner_connector.insert_after(GeneralAdvantageEstimation, GuidedAdvantageEstimation(
                gamma=self.config.gamma, lambda_=self.config.lambda_, floor=self.config.advantage_std_floor))
            self._learner_connector.remove(GeneralAdvantageEstimation)


class GuidedPPOConfig(LMPPOConfig):
    @classmethod
    def declared_params(cls) -> dict:
        return {**super().declared_params(), **GUIDED_PARAMS}

    def __init__(self, algo_class=None):
        super().__init__(algo_class=algo_class or GuidedPPO)

    def get_default_learner_class(self):
        return GuidedPPOTorchLearner


def _set_guide_mode(env_runner, mode: str) -> None:
    module = env_runner.module  # one RLModule, or a MultiRLModule of them
    for m in ([module] if hasattr(module, "set_guide_mode") else module.values()):
        m.unwrapped().set_guide_mode(mode)


def log_policy_return(*, episode, metrics_logger, **kwargs) -> None:
    """EnvRunner callback: the return of episodes the policy wrote alone (no guide step), the
    figure to compare with plain PPO's; plus the share of guided episodes."""
    roles = np.asarray(episode.get_extra_model_outputs(GUIDE_ROLE)) if GUIDE_ROLE in episode.extra_model_outputs \
        else np.zeros(1)
    guided = bool((roles != POLICY).any())
    metrics_logger.log_value("guided_episode_fraction", float(guided), reduce="mean", window=EPISODES_PER_RESULT)
    if not guided:
        metrics_logger.log_value("policy_return_mean", float(episode.get_return()), reduce="mean",
                                 window=EPISODES_PER_RESULT)


class GuidedPPO(LMPPO):
    @classmethod
    def get_default_config(cls):
        return GuidedPPOConfig()

    def training_step(self) -> None:
        # Pushed every iteration (a few bytes), so restarted EnvRunners get it too.
        c = self.config
        mode = guide_mode({"algorithm": c.guided_algorithm, "switch_iteration": c.switch_iteration,
                           "lols_prob": c.lols_prob, "seed": c.guide_seed}, self.iteration)
        self.env_runner_group.foreach_env_runner(lambda er: _set_guide_mode(er, mode))
        self.metrics.log_value("guide_mode_aggrevated", float(mode == "aggrevated"), window=1)
        return super().training_step()


def dlols_switch_iteration(cfg: dict) -> int | None:
    g = cfg["guide"]
    if g["switch_iteration"] is not None:
        return g["switch_iteration"]
    total = cfg["stop"]["training_iteration"]
    return None if total is None else int(round(plain(g["switch_fraction"]) * total))


class GuidedSpec(PPOSpec):
    names = ("ppo_pp", "aggrevated", "lols", "dlols")
    summary = "PPO with guide roll-ins: PPO++, AggreVaTeD, LOLS, DLOLS (a guide LM or a function)"
    search_with = ("ppo",)  # one RLlib algorithm: a sweep over `algorithm` may include the PPO baseline
    section = "guide"
    schema = GUIDE_SECTION
    seq2seq = False

    def config_class(self):
        return GuidedPPOConfig

    def check(self, raw: dict, cfg: dict) -> None:
        super().check(raw, cfg)
        g = cfg["guide"]
        if is_search_space(g["name_or_path"]) or is_search_space(g["callable"]):
            raise ConfigError("guide.name_or_path: the guide itself cannot be searched; sweep beta, mix, lols_prob "
                              "or switch_fraction")
        if bool(g["name_or_path"]) == bool(g["callable"]):
            raise ConfigError("guide: give exactly one of guide.name_or_path (a causal LM with the policy's "
                              "vocabulary) and guide.callable ('module:function')")
        spec = g["callable"]
        if spec and (spec.count(":") != 1 or not all(spec.split(":"))):
            raise ConfigError(f"guide.callable: expected 'module:function', got {spec!r}")
        if "dlols" in candidates(cfg["algorithm"]) and dlols_switch_iteration(cfg) is None:
            raise ConfigError("guide.switch_fraction: DLOLS takes it of stop.training_iteration, which is not set; "
                              "set stop.training_iteration or guide.switch_iteration")

    def module_config(self, cfg: dict, c: dict) -> dict:
        # The guide acts on the EnvRunners; GuidedPPO sets each iteration's roll-in mode.
        guide = {**{k: c["guide"][k] for k in ("name_or_path", "callable", "greedy", "beta", "mix")}, "mode": "none"}
        path = cfg["guide"]["name_or_path"]
        if path and os.path.isdir(path):  # a Tune trial does not run in this directory
            guide["name_or_path"] = os.path.abspath(path)
        return {"guide": guide}

    def training(self, cfg: dict, c: dict) -> dict:
        return {**super().training(cfg, c), "guided_algorithm": c["algorithm"],
                "switch_iteration": dlols_switch_iteration(cfg), "lols_prob": c["guide"]["lols_prob"],
                "guide_seed": module_seed(cfg, c)}

    def configure(self, config, cfg: dict, c: dict) -> None:
        config.callbacks(on_episode_end=log_policy_return)


SPEC = GuidedSpec()
