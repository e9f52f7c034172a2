"""Actor-critic RLModule around any Hugging Face causal LM.

The policy's action-distribution inputs are the LM's logits at the last
column of the (left-padded) observation, i.e. for the next token. Logits are
the LM's output embedding (head) applied to its trunk's final hidden state;
models whose logits need more than that (e.g. final soft-capping) are not
reproduced exactly. The value
head reads the LM's final hidden state there (shared trunk), or the hidden
state of a separate copy of the trunk (`model.value_model: separate`).

Learner-only parts (value head, separate value trunk, frozen reference model
for the KL penalty) are listed in `get_non_inference_attributes`, so
EnvRunners build and receive only the LM itself.

Truncation samplers (`model_config["sampler"]`, see `agents.samplers`) mask
the logits when acting and in the loss alike, so PPO's log-probs are those of
the renormalised masked distribution. The mask comes from the current policy
(`masking: current`) or from a frozen copy of it (`masking: learned`, NLPO),
`mask_lm`, which the learner re-syncs every `sync_every` iterations and which
travels to the EnvRunners with the weights. Mirostat's per-episode `mu` is
tracked per row across steps (same continuation rule as the KV cache) and
stored with each step (`sampler_state`), so the learner rebuilds the same mask.

model_config keys: `model` (the YAML model section), `env` (the env config,
for the tokenizer and lengths), `seed`, `reference_model` (bool: keep a frozen
copy of the initial policy for the KL penalty), `sampler` (the sampler
section; absent or `name: none` for no truncation), `guide` (guided algorithms: the guide
and its roll-in parameters, see `agents.guides`; EnvRunner modules then play the guide's
tokens where its roll-in plan says so and store each step's role).
"""
from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.apis import InferenceOnlyAPI, ValueFunctionAPI
from ray.rllib.core.rl_module.torch import TorchRLModule

from agents.core import MASK_SIZE, PASS_ROWS, SAMPLER_STATE, SEQ_ID
from agents.models import (DTYPES, adapters_disabled, add_lora, auto_precision, auto_rollout_dtype, build_causal_lm,
                           build_tokenizer, capturing, cast_frozen, has_lora)
from agents.modules.acting import Acting
from agents.modules.decode_engine import RingKVCache
from agents.modules.kv_cache import lean_forward, sequence_pass_rows
from agents.modules.sync_state import SyncedState
from agents.samplers import MASKED
from env.text_env import env_setting


def hidden_at_last_token(trunk: nn.Module, obs: dict, seq_ids: torch.Tensor | None = None,
                         pass_rows: tuple | None = None) -> torch.Tensor:
    """The trunk's final hidden state at each row's last (newest) token, shape (rows, hidden).

    With `seq_ids`, rows of one sequence share a single forward pass: each
    row's tokens are a prefix of the sequence's longest row, so its hidden
    state is read at the matching column of that row's pass. `pass_rows`: that pass's
    (ids, mask, inverse, column), made beforehand (the static update's, padded to fixed shapes).
    """
    if pass_rows is not None:  # read by index_select, whose backward reads nothing back to the host
        ids, mask, inverse, column = pass_rows
        hidden, _ = lean_forward(trunk, ids, mask)
        return hidden.flatten(0, 1).index_select(0, inverse * hidden.shape[1] + column)
    _, ids, mask, inverse, column = sequence_pass_rows(obs["input_ids"], obs["attention_mask"], seq_ids)
    hidden, _ = lean_forward(trunk, ids, mask)  # GPT-2 as tensor ops where it gives transformers' result
    return hidden[inverse, column]


@torch.no_grad()
def reference_logp(ref_model: nn.Module, batch) -> torch.Tensor:
    """log p_ref(a_t | s_t) of the batch's actions under a frozen causal LM (one pass per
    sequence when the batch has `seq_id`)."""
    hidden = hidden_at_last_token(ref_model.base_model, batch[Columns.OBS], batch.get(SEQ_ID))
    logits = ref_model.get_output_embeddings()(hidden)
    return torch.log_softmax(logits.float(), -1).gather(-1, batch[Columns.ACTIONS].long()[:, None])[:, 0]


class CausalLMActorCritic(Acting, SyncedState, TorchRLModule, ValueFunctionAPI, InferenceOnlyAPI):
    """The policy (the LM and its logits), the value head or trunk, and the frozen reference;
    acting is `Acting`'s (agents/modules/acting.py), the state and weight syncs `SyncedState`'s
    (agents/modules/sync_state.py)."""

    serves_static_update = True  # its training pass takes pass rows made beforehand (the static update's)

    def setup(self):
        cfg = self.model_config
        env_cfg = cfg["env"]
        self.tokenizer = build_tokenizer(env_cfg)
        seq_len = env_setting(env_cfg, "max_prompt_len") + env_setting(env_cfg, "max_new_tokens")
        self.lm = self._build_lm(cfg, seq_len)
        if cfg["model"].get("lora"):  # only the adapters train; the reference is the base (adapters off)
            add_lora(self.lm, cfg["model"]["lora"], seed=cfg.get("seed", 0))
        # Rollouts: the whole LM in `rollout_precision`. Learner: float32 weights under autocast
        # in `train_precision`; with LoRA the frozen base weights are stored in it too.
        self.precision = cfg.get("rollout_precision" if self.inference_only else "train_precision") or "fp32"
        if self.precision not in ("fp32", "auto"):  # auto: fp32 weights, autocast decided by the device
            if self.inference_only:
                self.lm.to(DTYPES[self.precision])
            elif has_lora(self.lm):
                cast_frozen(self.lm, DTYPES[self.precision])
        self._setup_rollouts(cfg, env_cfg, seq_len)
        hidden = self.lm.config.hidden_size
        # With the value head on the policy's trunk, EnvRunners compute V(s) from the hidden state
        # each rollout step computes anyway and store it (VF_PREDS); GAE then reads it instead of a
        # value pass over the train batch (see compute_values).
        self.values_in_rollouts = cfg["model"].get("value_model", "shared") != "separate"
        if self.values_in_rollouts:
            self.value_head = nn.Linear(hidden, 1)
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)
        if self.inference_only:
            self.eval()  # rollouts only; see act
            return
        if cfg.get("gradient_checkpointing"):  # recompute each block's activations in the backward pass
            self.lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if not self.values_in_rollouts:
            self.value_trunk = copy.deepcopy(self._trunk(self.lm))
            self.value_head = nn.Linear(hidden, 1)
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)
        if cfg.get("reference_model", False) and not has_lora(self.lm):
            self.ref_model = copy.deepcopy(self.lm).requires_grad_(False).eval()

    def settle_rollout_precision(self) -> None:
        """`env_runners.precision: auto`, once this rollout module is on its device: its LM in
        bf16 on a GPU that has bf16 in hardware, else in fp32 (as built). EnvRunners call it after
        RLlib moves the module to their device, colocated syncs after moving it to the learner's;
        a module that stays on the CPU (the evaluation EnvRunner's) stays fp32."""
        if not self.inference_only or self.model_config.get("rollout_precision") != "auto":
            return
        dtype = auto_rollout_dtype(next(self.lm.parameters()).device)
        cast = [lm for lm in (self.lm, getattr(self, "mask_lm", None))
                if lm is not None and next(lm.parameters()).dtype != dtype]
        for lm in cast:
            lm.to(dtype)
        if cast:
            self.weights_changed()  # cached keys and values are in the old dtype

    def autocast(self):
        """The learner's passes in its `train_precision` (a no-op in fp32); losses, log-probs and
        the PPO ratio are computed from float32 logits either way."""
        if self.precision == "fp32" or self.inference_only:
            return contextlib.nullcontext()
        device = next(self.lm.parameters()).device.type
        precision = self.precision if self.precision != "auto" else auto_precision(device)
        if precision == "fp32":
            return contextlib.nullcontext()
        # no cast cache while a CUDA graph is captured (the static update), as PyTorch's CUDA
        # graph notes ask of autocast
        return torch.autocast(device_type=device, dtype=DTYPES[precision],
                              cache_enabled=not capturing(torch.device(device)))

    # -- what depends on the kind of LM (Seq2SeqActorCritic overrides these) ------------

    def _build_lm(self, cfg: dict, seq_len: int) -> nn.Module:
        return build_causal_lm(cfg["model"], self.tokenizer, seed=cfg.get("seed", 0), max_positions=seq_len)

    def _new_cache(self):
        return RingKVCache()

    @staticmethod
    def _trunk(lm: nn.Module) -> nn.Module:
        """The part of an LM that gives hidden states (what `_hidden` and the value trunk take)."""
        return lm.base_model

    def _hidden(self, trunk: nn.Module, obs: dict, seq_ids=None, cache=None, cont=None,
                pass_rows=None) -> torch.Tensor:
        """The trunk's final hidden state at each row's newest token, through `cache` when given
        (`cont`: which rows continue the cache's previous call, when the caller knows;
        `pass_rows`: the learner pass's rows made beforehand, see `hidden_at_last_token`)."""
        if cache is not None:
            return cache.hidden_at_last_token(trunk, obs, cont)
        return hidden_at_last_token(trunk, obs, seq_ids, pass_rows)

    @staticmethod
    def _logits(lm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return lm.get_output_embeddings()(hidden)

    def mask_lm_logits(self, obs: dict, seq_ids=None, cached: bool = False, cont=None) -> torch.Tensor:
        """NLPO's masking policy's logits (float32, no gradient) for the sampler's learned mask."""
        with torch.no_grad():
            cache = self.mask_kv_cache if cached else None
            return self._logits(self.mask_lm,
                                self._hidden(self._trunk(self.mask_lm), obs, seq_ids, cache, cont)).float()

    def _forward_train(self, batch, **kwargs):
        obs, seq_ids, rows = batch.get(Columns.OBS), batch.get(SEQ_ID), batch.get(PASS_ROWS)
        with self.autocast():
            hidden = self._hidden(self._trunk(self.lm), obs, seq_ids, pass_rows=rows)
            embeddings = (self._hidden(self.value_trunk, obs, seq_ids, pass_rows=rows) if hasattr(self, "value_trunk")
                          else hidden)
            logits = self._logits(self.lm, hidden).float()
        out = {Columns.ACTION_DIST_INPUTS: logits, Columns.EMBEDDINGS: embeddings}
        if self.sampler.active:  # the loss sees the same renormalised masked distribution as the rollout
            source = self.mask_lm_logits(obs, seq_ids) if self.sampler.learned else logits.detach().float()
            keep = self.sampler.keep(source, batch.get(SAMPLER_STATE))
            out[Columns.ACTION_DIST_INPUTS] = logits.float().masked_fill(~keep, MASKED)
            out[MASK_SIZE] = keep.sum(-1).float()
        return out

    def compute_values(self, batch, embeddings=None):
        """V(s) per row. From the loss: from the training pass's `embeddings`, with gradients.
        Without them (RLlib's GAE connector, before the update): the values the rollout stored
        (VF_PREDS, computed by the weights that sampled each step) where every episode is
        complete, else one pass per sequence, no gradient, so no autograd graph is recorded
        for a pass nothing differentiates."""
        stored = batch.get(Columns.VF_PREDS) if embeddings is None else None
        truncated = batch.get(Columns.TRUNCATEDS)
        if stored is not None and (truncated is None or not bool(torch.as_tensor(truncated).any())):
            # an episode cut short would need V of the state after its last step (RLlib's
            # bootstrap slot holds a copy of the last step's instead): computed below then
            return torch.as_tensor(stored, dtype=torch.float32, device=next(self.value_head.parameters()).device)
        if embeddings is None:
            trunk = self.value_trunk if hasattr(self, "value_trunk") else self._trunk(self.lm)
            with torch.no_grad(), self.autocast():
                embeddings = self._hidden(trunk, batch[Columns.OBS], batch.get(SEQ_ID))
            return self.value_head(embeddings.float()).squeeze(-1)
        return self.value_head(embeddings.float()).squeeze(-1)

    def reference_logp(self, batch) -> torch.Tensor:
        """log p_ref(a_t | s_t) of the batch's actions under the frozen initial policy: its copy,
        or with LoRA the policy's own base weights with the adapters switched off."""
        with self.autocast():
            if hasattr(self, "ref_model"):
                return self._reference_logp(self.ref_model, batch)
            with adapters_disabled(self.lm):
                return self._reference_logp(self.lm, batch)

    def _reference_logp(self, lm, batch) -> torch.Tensor:
        return reference_logp(lm, batch)

    def sync_mask_model(self) -> None:
        """NLPO's delayed sync: the masking policy becomes a copy of the current policy."""
        self.mask_lm.load_state_dict(self.lm.state_dict())
        if self.mask_kv_cache is not None:
            self.mask_kv_cache.invalidate()

    def get_non_inference_attributes(self) -> list[str]:
        # the value head goes to EnvRunners when it reads the policy's trunk (rollouts store V(s))
        return ["value_trunk", "ref_model"] + ([] if self.values_in_rollouts else ["value_head"])
