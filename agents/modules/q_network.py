"""Q-network RLModule around any Hugging Face causal LM, for RLlib's DQN.

Q(s, .) has one value per vocabulary token, read from the LM trunk's final hidden
state at the observation's last (newest) column, like the actor-critic's logits.
Two heads (`dqn.head`):

- `logits`: a linear layer initialised from the LM's output embedding, so Q
  starts as the LM's logits and the greedy policy starts as the LM's argmax
  (the remedy the CS224N report proposes for its randomly initialised head).
- `mlp`: the report's head, 3 linear layers (hidden 64, ReLU), randomly initialised.

With `dueling`, Q = V(s) + A(s, a) - mean_a A(s, a), the head above giving A and a
zero-initialised linear layer giving V (so the initial greedy action is unchanged).

Acting is epsilon-greedy with RLlib's schedule (`model_config["epsilon"]`, filled in
by DQNConfig); random actions are uniform over the vocabulary. EnvRunners step the
trunk incrementally with the same per-episode KV cache as the actor-critic.
`forward_inference` returns Q / `sample_temperature` as action-distribution inputs:
RLlib's greedy evaluation takes their argmax, `agents.generate` without `--greedy`
samples softmax(Q / T).

The target network (a copy of trunk and heads) is learner-only; RLlib's DQN learner
syncs it every `target_network_update_freq` sampled steps, by Polyak averaging with
`tau` (1.0: a hard copy).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from ray.rllib.algorithms.dqn.default_dqn_rl_module import QF_NEXT_PREDS, QF_PREDS, QF_TARGET_NEXT_PREDS
from ray.rllib.core.columns import Columns
from ray.rllib.core.learner.utils import make_target_network
from ray.rllib.core.rl_module.apis import InferenceOnlyAPI, QNetAPI, TargetNetworkAPI
from ray.rllib.core.rl_module.torch import TorchRLModule
from ray.rllib.utils.schedules.scheduler import Scheduler

from agents.core import SEQ_ID
from agents.models import build_causal_lm, build_tokenizer
from agents.modules.actor_critic import hidden_at_last_token
from agents.modules.kv_cache import WindowKVCache
from env.text_env import env_setting

HEADS = ("logits", "mlp")


def mlp_head(hidden: int, width: int, out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(hidden, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, out))


class CausalLMQNetwork(TorchRLModule, QNetAPI, TargetNetworkAPI, InferenceOnlyAPI):
    def setup(self):
        cfg = self.model_config
        env_cfg, dqn = cfg["env"], cfg.get("dqn") or {}
        self.tokenizer = build_tokenizer(env_cfg)
        seq_len = env_setting(env_cfg, "max_prompt_len") + env_setting(env_cfg, "max_new_tokens")
        self.lm = build_causal_lm(cfg["model"], self.tokenizer, seed=cfg.get("seed", 0), max_positions=seq_len)
        self.kv_cache = WindowKVCache() if cfg["model"].get("kv_cache", True) else None
        hidden, vocab = self.lm.config.hidden_size, self.action_space.n
        self.head_kind = dqn.get("head", "logits")
        if self.head_kind == "logits":
            lm_head = self.lm.get_output_embeddings()
            self.q_head = nn.Linear(hidden, vocab)
            with torch.no_grad():  # a copy: GPT-2 ties its output embedding to the input embedding
                self.q_head.weight.copy_(lm_head.weight[:vocab])
                if getattr(lm_head, "bias", None) is not None:
                    self.q_head.bias.copy_(lm_head.bias[:vocab])
                else:
                    self.q_head.bias.zero_()
        elif self.head_kind == "mlp":
            with torch.random.fork_rng(devices=[]):  # seeded initialisation without resetting the process's stream
                torch.manual_seed(cfg.get("seed", 0))
                self.q_head = mlp_head(hidden, dqn.get("mlp_hidden", 64), vocab)
        else:
            raise ValueError(f"dqn.head: expected one of {', '.join(HEADS)}, got {self.head_kind!r}")
        self.dueling = bool(cfg.get("dueling", False))
        if self.dueling:
            self.v_head = nn.Linear(hidden, 1)
            nn.init.zeros_(self.v_head.weight)
            nn.init.zeros_(self.v_head.bias)
        self.double_q = bool(cfg.get("double_q", True))
        self.temperature = float(dqn.get("sample_temperature", 1.0))
        self.epsilon_schedule = Scheduler(fixed_value_or_schedule=cfg.get("epsilon", 0.0), framework="torch")
        if self.inference_only:
            self.eval()
            return
        if cfg.get("reference_model", False):  # the frozen initial LM for the per-token reference term
            self.ref_model = copy.deepcopy(self.lm).requires_grad_(False).eval()

    # -- Q-values --------------------------------------------------------------------

    def _q_from_hidden(self, hidden, q_head, v_head=None) -> torch.Tensor:
        q = q_head(hidden).float()
        if v_head is None:
            return q
        return v_head(hidden).float() + q - q.mean(-1, keepdim=True)

    def _heads(self):
        return self.q_head, getattr(self, "v_head", None)

    def compute_q_values(self, batch) -> dict:
        hidden = hidden_at_last_token(self.lm.base_model, batch[Columns.OBS])
        return {QF_PREDS: self._q_from_hidden(hidden, *self._heads())}

    def _acting_q(self, obs: dict) -> torch.Tensor:
        if self.kv_cache is not None:
            hidden = self.kv_cache.hidden_at_last_token(self.lm.base_model, obs)
        else:
            hidden = hidden_at_last_token(self.lm.base_model, obs)
        return self._q_from_hidden(hidden, *self._heads())

    # -- forward passes --------------------------------------------------------------

    @torch.no_grad()
    def _forward_inference(self, batch, **kwargs):
        return {Columns.ACTION_DIST_INPUTS: self._acting_q(batch[Columns.OBS]) / self.temperature}

    @torch.no_grad()
    def _forward_exploration(self, batch, t: int = 0, **kwargs):
        q = self._acting_q(batch[Columns.OBS])
        self.epsilon_schedule.update(t)
        epsilon = float(self.epsilon_schedule.get_current_value())
        greedy = q.argmax(-1)
        random = torch.randint(0, q.shape[-1], greedy.shape, device=q.device)
        explore = torch.rand(greedy.shape, device=q.device) < epsilon
        return {Columns.ACTIONS: torch.where(explore, random, greedy)}

    def _forward_train(self, batch, **kwargs):
        """Q(s), Q(s') for double Q's pick, and the target's Q(s').

        With `seq_id` (whole-sequence replay) the rows of one stored episode, s and s'
        alike, are prefixes of one sequence: each network runs once per sequence.
        """
        obs, next_obs, seq = batch[Columns.OBS], batch[Columns.NEXT_OBS], batch.get(SEQ_ID)
        out = {}
        if self.double_q:  # online Q of s and s' in one pass; s' picks the bootstrap action
            both = {k: torch.cat([obs[k], next_obs[k]]) for k in obs}
            hidden = hidden_at_last_token(self.lm.base_model, both, None if seq is None else torch.cat([seq, seq]))
            out[QF_PREDS], out[QF_NEXT_PREDS] = self._q_from_hidden(hidden, *self._heads()).chunk(2)
        else:
            hidden = hidden_at_last_token(self.lm.base_model, obs, seq)
            out[QF_PREDS] = self._q_from_hidden(hidden, *self._heads())
        out[QF_TARGET_NEXT_PREDS] = self.forward_target({Columns.OBS: next_obs, SEQ_ID: seq})[QF_PREDS]
        return out

    # -- target network --------------------------------------------------------------

    def make_target_networks(self) -> None:
        self._target_trunk = make_target_network(self.lm.base_model)
        self._target_q_head = make_target_network(self.q_head)
        if self.dueling:
            self._target_v_head = make_target_network(self.v_head)

    def get_target_network_pairs(self):
        pairs = [(self.lm.base_model, self._target_trunk), (self.q_head, self._target_q_head)]
        if self.dueling:
            pairs.append((self.v_head, self._target_v_head))
        return pairs

    @torch.no_grad()
    def forward_target(self, batch) -> dict:
        hidden = hidden_at_last_token(self._target_trunk, batch[Columns.OBS], batch.get(SEQ_ID))
        return {QF_PREDS: self._q_from_hidden(hidden, self._target_q_head, getattr(self, "_target_v_head", None))}

    def get_non_inference_attributes(self) -> list[str]:
        return ["_target_trunk", "_target_q_head", "_target_v_head", "ref_model"]

    def set_state(self, state) -> None:
        super().set_state(state)
        self.weights_changed()

    def weights_changed(self) -> None:
        """New weights (a sync): every cached key/value is stale."""
        if self.kv_cache is not None:
            self.kv_cache.invalidate()
