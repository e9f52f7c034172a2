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

from agents.algorithms.base import (REFERENCE_KL, AlgorithmSpec, DeclaredParams, RemoteRunnerStates, adam, candidates,
                                   pick, plain, rllib_fields, use_configured_lr)
from agents.algorithms.gradients import FusedGradients
from agents.algorithms.replay import WholeEpisodeReplayBuffer
from agents.core import state_requested
from agents.modules.actor_critic import reference_logp
from agents.weight_sync import install_colocated_sync
from env.validation import ConfigError, Field

REF_LOGP_MEAN = "ref_logp_mean"
REPLAY_BUFFER = "replay_buffer"  # algorithm state key (dqn.checkpoint_buffer)


class LMDQNTorchLearner(FusedGradients, DQNTorchLearner):
    def build(self) -> None:
        super().build()
        self.ref_coef = float(self.config.ref_kl_coef)

    def compute_loss_for_module(self, *, module_id, config, batch, fwd_out):
        if self.ref_coef > 0.0:
            ref_logp = reference_logp(self.module[module_id].unwrapped().ref_model, batch)
            batch = {**batch, Columns.REWARDS: batch[Columns.REWARDS] + self.ref_coef * ref_logp}
            self.metrics.log_value((module_id, REF_LOGP_MEAN), ref_logp.mean().item(), window=1)
        return super().compute_loss_for_module(module_id=module_id, config=config, batch=batch, fwd_out=fwd_out)

    def configure_optimizers_for_module(self, module_id, config=None):
        params = self.get_parameters(self.module[module_id])  # RLlib's default list; the project's Adam
        self.register_optimizer(module_id=module_id, optimizer=adam(params, self), params=params,
                                lr_or_lr_schedule=config.lr)

    def get_state(self, *args, **kwargs):
        # and when each module's target network was last synced (RLlib's learner keeps it apart)
        return {**super().get_state(*args, **kwargs), "target_updated_at": dict(self.last_update_ts_by_mid)}

    def set_state(self, state):
        super().set_state(state)
        use_configured_lr(self)
        self.last_update_ts_by_mid.update(state.get("target_updated_at", {}))


class LMDQNConfig(DeclaredParams, DQNConfig):
    @classmethod
    def declared_params(cls) -> dict:
        # Every step's reward gains ref_kl_coef * log p_ref(a_t | s_t) under the frozen initial LM.
        return {**rllib_fields(DQNSpec.reward_params), "checkpoint_buffer": DQNSpec.schema["checkpoint_buffer"]}

    def __init__(self, algo_class=None):
        super().__init__(algo_class=algo_class or LMDQN)

    def get_default_learner_class(self):
        return LMDQNTorchLearner


class LMDQN(RemoteRunnerStates, DQN):
    @classmethod
    def get_default_config(cls) -> LMDQNConfig:
        return LMDQNConfig()

    def setup(self, config):
        super().setup(config)
        install_colocated_sync(self)  # one process, one device: weights go device to device

    def get_state(self, components=None, *, not_components=None, **kwargs):
        """RLlib's state; with `dqn.checkpoint_buffer`, also the replay buffer (at most its
        capacity in steps) and the generator it draws from, which RLlib does not save."""
        state = super().get_state(components, not_components=not_components, **kwargs)
        buffer = self.local_replay_buffer
        if (self.config.checkpoint_buffer and buffer is not None
                and state_requested(REPLAY_BUFFER, components, not_components)):
            state[REPLAY_BUFFER] = {"buffer": buffer.get_state(), "rng": buffer.rng.bit_generator.state}
        return state

    def set_state(self, state) -> None:
        super().set_state(state)
        saved = state.get(REPLAY_BUFFER)
        if saved is not None and self.local_replay_buffer is not None:
            self.local_replay_buffer.set_state(saved["buffer"])
            self.local_replay_buffer.rng.bit_generator.state = saved["rng"]

    def _create_local_replay_buffer_if_necessary(self, config):
        # RLlib builds buffers from a type name it looks up in its own package. A dotted type
        # ("agents.algorithms.replay.WholeEpisodeReplayBuffer") is not a way out: under Tune,
        # AlgorithmConfig.update_from_dict turns it into a class and RLlib's own
        # `"EpisodeReplayBuffer" in type` check then raises TypeError. Pinned in
        # tests/test_rllib_contract.py.
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


class DQNSpec(AlgorithmSpec):
    names = ("dqn",)
    summary = "DQN on the token MDP: Q-values from the LM's logits (or an MLP head), double/dueling/n-step"
    section = "dqn"
    schema = {
        "head": Field(str, "logits", choices=["logits", "mlp"]),
        "mlp_hidden": Field(int, 64, lo=1),
        "dueling": Field(bool, False),
        "double_q": Field(bool, True),
        "n_step": Field(int, 1, lo=1),
        # With n_step_max, each replayed step draws n uniformly from n_step..n_step_max; steps closer
        # to the episode's end than n are redrawn (RLlib), so the last steps get short returns.
        "n_step_max": Field(int, None, lo=1, optional=True),
        # Target network sync period in sampled env steps, and the Polyak factor (1.0: hard copy).
        "target_update_every": Field(int, 500, lo=1),
        "tau": Field(float, 1.0, lo=0.0, hi=1.0, lo_open=True),
        # Epsilon-greedy: linear from epsilon_start to epsilon_end over epsilon_steps env steps.
        "epsilon_start": Field(float, 1.0, lo=0.0, hi=1.0),
        "epsilon_end": Field(float, 0.05, lo=0.0, hi=1.0),
        "epsilon_steps": Field(int, 10000, lo=1),
        # sequences: every step of whole stored episodes per update, one forward pass per sequence
        # (uniform over episodes); steps: RLlib's step buffers, one pass per step (prioritized or not).
        "replay": Field(str, "sequences", choices=["sequences", "steps"]),
        "replay_capacity": Field(int, 50000, lo=1),  # stored env steps
        "prioritized": Field(bool, False),
        "alpha": Field(float, 0.6, lo=0.0),
        "beta": Field(float, 0.4, lo=0.0),
        "learning_starts": Field(int, 1000, lo=0),
        # Replayed / sampled steps; null: one update of train_batch_size per sample() call.
        "training_intensity": Field(float, None, lo=0.0, lo_open=True, optional=True),
        "td_loss": Field(str, "huber", choices=["huber", "mse"]),
        # A training iteration (one progress line, one result row) samples at least this many env steps.
        "steps_per_iteration": Field(int, 1000, lo=1),
        # agents.generate without --greedy samples softmax(Q / sample_temperature).
        "sample_temperature": Field(float, 1.0, lo=0.0, lo_open=True),
        # true: checkpoints hold the replay buffer (up to replay_capacity steps), so a resumed run
        # replays what the interrupted one would have; false: a resumed run refills it from empty.
        "checkpoint_buffer": Field(bool, False),
    }
    whole_episodes = False  # n-step fragments (batch_mode truncate_episodes) for the replay buffer
    sampler_refusal = ("DQN acts epsilon-greedy on its Q-values; truncation samplers and their masking (current or "
                       "learned) apply to the policy-gradient algorithms")
    kl_adaptive = False  # the per-token reference term has a fixed coefficient
    reward_params = pick(REFERENCE_KL, "kl_coef")
    scale_refusal = ("DQN's Q-network (a Q-head on the LM, its target copy updated from the online weights) "
                     "trains all weights in float32; LoRA, bf16/fp16 and gradient checkpointing apply to the "
                     "policy-gradient algorithms")

    def config_class(self):
        return LMDQNConfig

    def module_class(self, encoder_decoder: bool):
        from agents.modules.q_network import CausalLMQNetwork

        return CausalLMQNetwork

    def check(self, raw: dict, cfg: dict) -> None:
        rw, dqn = cfg["reward"], cfg["dqn"]
        if dqn["replay"] == "sequences" and dqn["prioritized"]:
            raise ConfigError("dqn.prioritized: prioritized replay draws single steps; set dqn.replay: steps with it")
        if dqn["n_step_max"] is not None and plain(dqn["n_step_max"]) < plain(dqn["n_step"]):
            raise ConfigError(f"dqn.n_step_max: {plain(dqn['n_step_max'])} is smaller than "
                              f"dqn.n_step={plain(dqn['n_step'])}")
        if plain(rw["kl_coef"]) > 0 and (max(candidates(dqn["n_step"])) > 1 or dqn["n_step_max"] not in (None, 1)):
            raise ConfigError("reward.kl_coef: DQN's per-token reference term needs dqn.n_step: 1 (n-step returns "
                              "are summed in the replay buffer, before the learner adds the term)")

    def module_config(self, cfg: dict, c: dict) -> dict:
        return {"dqn": {k: c["dqn"][k] for k in ("head", "mlp_hidden", "sample_temperature")}}

    def training(self, cfg: dict, c: dict) -> dict:
        dqn = c["dqn"]
        prioritized = cfg["dqn"]["prioritized"]
        return dict(
            double_q=dqn["double_q"],
            dueling=dqn["dueling"],
            n_step=dqn["n_step"] if dqn["n_step_max"] is None else (dqn["n_step"], dqn["n_step_max"] + 1),
            target_network_update_freq=dqn["target_update_every"],
            tau=dqn["tau"],
            epsilon=[[0, dqn["epsilon_start"]], [dqn["epsilon_steps"], dqn["epsilon_end"]]],
            num_steps_sampled_before_learning_starts=dqn["learning_starts"],
            training_intensity=dqn["training_intensity"],
            td_error_loss_fn=dqn["td_loss"],
            replay_buffer_config={
                "type": WholeEpisodeReplayBuffer.__name__ if cfg["dqn"]["replay"] == "sequences" else
                "PrioritizedEpisodeReplayBuffer" if prioritized else "EpisodeReplayBuffer",
                "capacity": dqn["replay_capacity"],
                **({"alpha": dqn["alpha"], "beta": dqn["beta"]} if prioritized else {}),
            },
            checkpoint_buffer=dqn["checkpoint_buffer"],
            **super().training(cfg, c),  # the reference term's coefficient
        )

    def configure(self, config, cfg: dict, c: dict) -> None:
        config.reporting(min_sample_timesteps_per_iteration=c["dqn"]["steps_per_iteration"])


SPEC = DQNSpec()
