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
import warnings

import numpy as np
import torch
from torch import nn

from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.apis import InferenceOnlyAPI, ValueFunctionAPI
from ray.rllib.core.rl_module.torch import TorchRLModule

from agents.core import MASK_SIZE, SAMPLER_STATE, SEQ_ID, cpu_copy, on_device
from agents.models import (DTYPES, adapters_disabled, auto_precision, add_lora, build_causal_lm, build_tokenizer, cast_frozen,
                           has_lora, is_adapter_key)
from agents.modules.decode_engine import HostTransfers, RingKVCache
from agents.modules.kv_cache import ROW_CONTINUES, lean_forward, rows_that_continue, sequence_pass_rows
from agents.modules.sync_state import from_lean_state, lean_state, synced_tensors
from agents.samplers import MASKED, Sampler, sample_rows



class RowSamplerState:
    """A stateful sampler's state per vector-env row, carried while the row's episode continues."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self.ids = self.mask = self.state = self.source = None

    def __call__(self, obs: dict, source_logits: torch.Tensor, cont=None) -> torch.Tensor:
        ids, mask = obs["input_ids"], obs["attention_mask"]
        state = self.sampler.initial_state(ids.shape[0], device=source_logits.device)
        cont = rows_that_continue(self.ids, self.mask, ids, mask, cont)
        if cont.any():  # the token each continuing row appended is its last column
            state[cont] = self.sampler.next_state(self.state[cont], self.source[cont], ids[cont, -1])
        self.ids, self.mask, self.state, self.source = ids, mask, state, source_logits
        return state


def hidden_at_last_token(trunk: nn.Module, obs: dict, seq_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The trunk's final hidden state at each row's last (newest) token, shape (rows, hidden).

    With `seq_ids`, rows of one sequence share a single forward pass: each
    row's tokens are a prefix of the sequence's longest row, so its hidden
    state is read at the matching column of that row's pass.
    """
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


class CausalLMActorCritic(TorchRLModule, ValueFunctionAPI, InferenceOnlyAPI):
    def setup(self):
        cfg = self.model_config
        env_cfg = cfg["env"]
        self.tokenizer = build_tokenizer(env_cfg)
        seq_len = env_cfg.get("max_prompt_len", 5) + env_cfg.get("max_new_tokens", 20)
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
        # Rollouts (forward_inference / forward_exploration) step the LM incrementally.
        self.kv_cache = self._new_cache() if cfg["model"].get("kv_cache", True) else None
        self.sampler = Sampler(cfg.get("sampler") or {"name": "none"})
        self.row_sampler_state = RowSamplerState(self.sampler) if self.sampler.stateful else None
        if self.sampler.learned:  # the delayed masking policy; needed for acting, never trained
            self.mask_lm = copy.deepcopy(self.lm).requires_grad_(False)
            self.mask_kv_cache = self._new_cache() if self.kv_cache is not None else None
        # Guided algorithms (agents/guides.py): the guide acts where the rollouts run, so only
        # EnvRunner (inference-only) modules build it; the learner reads the stored roles.
        self.guided = None
        if self.inference_only and cfg.get("guide"):
            from agents.guides import GuidedRollout, build_guide

            g = cfg["guide"]
            self.guided = GuidedRollout(
                build_guide(g, self.tokenizer, seed=cfg.get("seed", 0), max_positions=seq_len),
                max_new_tokens=env_cfg.get("max_new_tokens", 20), beta=g.get("beta", 0.2), mix=g.get("mix", 0.8),
                seed=cfg.get("seed", 0), mode=g.get("mode", "ppo_pp"))  # EnvRunners reseed it: seed_rollouts
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

    def autocast(self):
        """The learner's passes in its `train_precision` (a no-op in fp32); losses, log-probs and
        the PPO ratio are computed from float32 logits either way."""
        if self.precision == "fp32" or self.inference_only:
            return contextlib.nullcontext()
        device = next(self.lm.parameters()).device.type
        precision = self.precision if self.precision != "auto" else auto_precision(device)
        if precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=device, dtype=DTYPES[precision])

    # -- what depends on the kind of LM (Seq2SeqActorCritic overrides these) ------------

    def _build_lm(self, cfg: dict, seq_len: int) -> nn.Module:
        return build_causal_lm(cfg["model"], self.tokenizer, seed=cfg.get("seed", 0), max_positions=seq_len)

    def _new_cache(self):
        return RingKVCache()

    @staticmethod
    def _trunk(lm: nn.Module) -> nn.Module:
        """The part of an LM that gives hidden states (what `_hidden` and the value trunk take)."""
        return lm.base_model

    def _hidden(self, trunk: nn.Module, obs: dict, seq_ids=None, cache=None, cont=None) -> torch.Tensor:
        """The trunk's final hidden state at each row's newest token, through `cache` when given
        (`cont`: which rows continue the cache's previous call, when the caller knows)."""
        if cache is not None:
            return cache.hidden_at_last_token(trunk, obs, cont)
        return hidden_at_last_token(trunk, obs, seq_ids)

    @staticmethod
    def _logits(lm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return lm.get_output_embeddings()(hidden)

    # -- forward passes ----------------------------------------------------------------

    def _next_token_hidden(self, obs: dict, cont=None) -> torch.Tensor:
        return self._hidden(self._trunk(self.lm), obs, cache=self.kv_cache, cont=cont)

    def _next_token_logits(self, obs: dict, cont=None) -> torch.Tensor:
        return self._logits(self.lm, self._next_token_hidden(obs, cont))

    def mask_lm_logits(self, obs: dict, seq_ids=None, cached: bool = False, cont=None) -> torch.Tensor:
        """NLPO's masking policy's logits (float32, no gradient) for the sampler's learned mask."""
        with torch.no_grad():
            cache = self.mask_kv_cache if cached else None
            return self._logits(self.mask_lm,
                                self._hidden(self._trunk(self.mask_lm), obs, seq_ids, cache, cont)).float()

    def _acting_logits(self, obs: dict, cont=None, values: bool = False) -> tuple[torch.Tensor, dict]:
        """Next-token logits with the sampler's mask applied, plus what to store with the step
        (with `values`, V(s) from the same hidden state when the value head reads the policy's
        trunk). `cont`: which rows continue the previous call's (the batch's ROW_CONTINUES), if known."""
        return self._masked_logits(self._next_token_hidden(obs, cont), obs, cont, values)

    def _masked_logits(self, hidden: torch.Tensor, obs: dict | None = None, cont=None,
                       values: bool = False) -> tuple[torch.Tensor, dict]:
        """`_acting_logits` from the hidden state at the new token (`obs` and `cont` are needed
        only by a learned mask (NLPO) and a stateful sampler (mirostat))."""
        logits = self._logits(self.lm, hidden).float()
        extra = {}
        if values and self.values_in_rollouts:
            extra[Columns.VF_PREDS] = self.value_head(hidden.float()).squeeze(-1)
        if not self.sampler.active:
            return logits, extra
        source = self.mask_lm_logits(obs, cached=True, cont=cont) if self.sampler.learned else logits
        state = None
        if self.sampler.stateful:
            state = self.row_sampler_state(obs, source, cont)
            extra[SAMPLER_STATE] = state
        keep = self.sampler.keep(source, state)
        return logits.masked_fill(~keep, MASKED), extra

    def _forward(self, batch, **kwargs):
        return {Columns.ACTION_DIST_INPUTS: self._acting_logits(batch[Columns.OBS], batch.get(ROW_CONTINUES))[0]}

    def act(self, batch, *, explore: bool = True, **kwargs) -> dict:
        """One rollout step for the project's EnvRunner: exploration (a sampled action and its
        log-prob) or inference (the logits). RLlib's forward_exploration/forward_inference wrap
        the same methods in an eval()/train() flip of the whole module on every call (thousands
        of submodule visits per token, ~8% of a tiny model's rollout); here the module is put
        in eval mode once and stays there (dropout is off on the rollout side either way)."""
        if self.training:
            self.eval()
        return self._forward_exploration(batch, **kwargs) if explore else self._forward(batch, **kwargs)

    @torch.no_grad()
    def _forward_exploration(self, batch, **kwargs):
        """Samples here and returns only the action and its log-prob.

        RLlib would otherwise store every step's full logits in the episode
        (V floats: 200 KB per token at a 50k vocabulary); the loss needs only
        the log-prob of the action taken.
        """
        cont, obs = batch.get(ROW_CONTINUES), batch[Columns.OBS]
        ids = obs["input_ids"]
        # The draws come first (the forward pass draws nothing), so a static step can take them.
        uniform = torch.rand(ids.shape[0], 1, dtype=torch.float64, device=ids.device,
                             generator=self.rollout_generator(ids.device))
        if self.guided is None and self._static_tail() and isinstance(self.kv_cache, RingKVCache):
            # forward, mask, draw, log-prob and value in one static step (a CUDA graph on CUDA)
            return dict(self.kv_cache.hidden_at_last_token(self._trunk(self.lm), obs, cont, tail=self._sample,
                                                           tail_inputs=(uniform,),
                                                           key=("explore", self.values_in_rollouts)))
        guide = None
        if self.guided is not None:  # the guide's tokens replace the policy's where its roll-in plan says so
            guide = lambda actions: self.guided(obs, actions, cont)  # noqa: E731
        return self._draw(*self._acting_logits(obs, cont, values=True), uniform, guide)

    def _static_tail(self) -> bool:
        """Whether the rollout step after the trunk is a function of the hidden state alone (no
        learned mask model, no per-row sampler state)."""
        return not (self.sampler.learned or self.sampler.stateful)

    def _sample(self, hidden: torch.Tensor, uniform: torch.Tensor) -> dict:
        """The rollout step after the trunk (`_static_tail` samplers): logits, the sampler's mask,
        the action drawn at `uniform`, its log-prob and V(s). Tensors of fixed shapes only."""
        return self._draw(*self._masked_logits(hidden, values=True), uniform)

    @staticmethod
    def _draw(logits: torch.Tensor, extra: dict, uniform: torch.Tensor, guide=None) -> dict:
        """The action drawn at `uniform` from the (masked) logits (masked tokens have probability
        exactly 0: never drawn), or the guide's where `guide(actions)` says so, and its log-prob."""
        logp_all = torch.log_softmax(logits, -1)
        actions = sample_rows(logp_all.exp(), uniform)
        if guide is not None:
            from agents.core import GUIDE_ROLE

            actions, extra[GUIDE_ROLE] = guide(actions)
        return {Columns.ACTIONS: actions, Columns.ACTION_LOGP: logp_all.gather(-1, actions[:, None])[:, 0], **extra}

    def _forward_train(self, batch, **kwargs):
        obs, seq_ids = batch[Columns.OBS], batch.get(SEQ_ID)
        with self.autocast():
            hidden = self._hidden(self._trunk(self.lm), obs, seq_ids)
            embeddings = self._hidden(self.value_trunk, obs, seq_ids) if hasattr(self, "value_trunk") else hidden
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

    lean_sync = True  # False: weight syncs send RLlib's inference state (benchmarks/weight_sync.py's "before")

    def get_state(self, *args, inference_only: bool = False, **kwargs):
        """RLlib's state (numpy arrays), bf16 weights as float32 (numpy has no bfloat16). With
        LoRA, the state EnvRunners receive (inference_only) holds the adapters only: the base
        weights are frozen, and every module builds the same ones from the config. A learner's
        inference state (what a weight sync sends) is `sync_state`'s."""
        if inference_only and not self.inference_only and self.lean_sync:  # (components: as TorchRLModule, none)
            return self.sync_state()
        if not any(p.dtype == torch.bfloat16 for p in self.parameters()):
            state = super().get_state(*args, inference_only=inference_only, **kwargs)
        else:
            from ray.rllib.utils.numpy import convert_to_numpy

            state = self.state_dict()
            if inference_only and not self.inference_only:  # as TorchRLModule.get_state
                drop = tuple(a + "." for a in self.get_non_inference_attributes())
                state = {k: v for k, v in state.items() if not k.startswith(drop)}
            state = convert_to_numpy({k: v.float() if v.dtype == torch.bfloat16 else v for k, v in state.items()})
        if inference_only and has_lora(self.lm):
            state = {k: v for k, v in state.items() if not self._frozen_base_key(k)}
        return state

    def sync_state(self) -> dict:
        """What a weight sync sends EnvRunners (`agents.modules.sync_state.lean_state`): the
        inference weights once each, with LoRA the adapters only, the LM in the rollout precision,
        from a GPU through pinned buffers. `set_state` takes it back."""
        dtype = DTYPES[self.model_config.get("rollout_precision") or "fp32"]
        cast = lambda key, t: t.to(dtype) if t.is_floating_point() and key.startswith(("lm.", "mask_lm.")) else t  # noqa: E731
        if "_sync_transfers" not in self.__dict__:
            self.__dict__["_sync_transfers"] = HostTransfers()
        return lean_state(self, cast, self.__dict__["_sync_transfers"])

    def _copy_state(self, state) -> bool:
        """Copies `state` into the module's tensors where it holds exactly the module's state
        keys with their shapes, or those less tied duplicates and keys a sync leaves out
        (`sync_state`; a weight sync: on the quickstart's module a `set_state` took 190 us this
        way against 460 us through `load_state_dict`, one-off timing), and says whether it did."""
        own = self.state_dict(keep_vars=True)
        if own.keys() != state.keys() and synced_tensors(self).keys() != state.keys():
            return False
        if any(tuple(own[k].shape) != tuple(np.shape(v)) for k, v in state.items()):
            return False
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # Ray's arrays are read-only; copy_ only reads them
            for k, v in state.items():
                own[k].copy_(torch.as_tensor(v))
        return True

    @staticmethod
    def _frozen_base_key(key: str) -> bool:
        return key.startswith(("lm.", "mask_lm.")) and not is_adapter_key(key)

    def set_state(self, state) -> None:
        from ray.rllib.utils.torch_utils import convert_to_torch_tensor

        state = from_lean_state(state)
        if has_lora(self.lm) and self.inference_only:  # adapters only (see get_state)
            missing, _ = self.load_state_dict(convert_to_torch_tensor(state), strict=False)
            lacking = [k for k in missing if not self._frozen_base_key(k)]
            if lacking:
                raise ValueError(f"the policy's state lacks {lacking}")
        elif self.inference_only and self.values_in_rollouts and not any(k.startswith("value_head.") for k in state):
            # a state without the value head (a checkpoint's EnvRunner state written before
            # rollouts stored values): the rollouts store none until a state brings it
            missing, _ = self.load_state_dict(convert_to_torch_tensor(state), strict=False)
            lacking = [k for k in missing if not k.startswith("value_head.")]
            if lacking:
                raise ValueError(f"the policy's state lacks {lacking}")
            self.values_in_rollouts = False
        else:
            if not self._copy_state(state):
                super().set_state(state)
            if self.inference_only and any(k.startswith("value_head.") for k in state):
                self.values_in_rollouts = True
        self.weights_changed()

    def weights_changed(self) -> None:
        """New weights (a sync): every cached key/value is stale."""
        for cache in (self.kv_cache, getattr(self, "mask_kv_cache", None)):
            if cache is not None:
                cache.invalidate()
        guide_cache = getattr(getattr(self.guided, "guide", None), "cache", None)
        if guide_cache is not None:  # re-prefilled here too, so a resumed run computes what an uninterrupted one does
            guide_cache.invalidate()

    def sync_skips(self, key: str) -> bool:
        """State keys a weight sync leaves out (`agents.modules.sync_state`): the learner-only
        parts, and with LoRA the frozen base (the same weights on both sides; only adapters train)."""
        if not self.inference_only and key.startswith(tuple(a + "." for a in self.get_non_inference_attributes())):
            return True
        return has_lora(self.lm) and self._frozen_base_key(key)

    @property
    def can_move_device(self) -> bool:
        """Whether rollouts may move to the learner's device (a guide acts on the CPU)."""
        return self.guided is None

    # -- rollout state (EnvRunner side): seeded per EnvRunner, saved in its checkpoints --------

    def seed_rollouts(self, seed: int) -> None:
        """Reseeds what acting draws from: the sampling generator (`rollout_generator`), the
        guide's roll-in plans and an LM guide's sampling. EnvRunners call it with their own seed."""
        self._sampling_seed = int(np.random.SeedSequence([int(seed), 0x73616D70]).generate_state(1)[0])
        self._sampling_generator = None
        if self.guided is not None:
            self.guided.seed(seed)

    def rollout_generator(self, device: torch.device) -> torch.Generator:
        """The generator rollout sampling draws from: the module's own, on `device`, so nothing
        else in the process (a colocated learner's draws on the same device included) moves it.
        Seeded by `seed_rollouts` (else from torch's global seed); made anew from its seed where
        the device changes (a colocated EnvRunner moving to the learner's GPU, before it samples)."""
        g = getattr(self, "_sampling_generator", None)
        if g is None or g.device.type != device.type:
            g = self._sampling_generator = torch.Generator(device)
            seed = getattr(self, "_sampling_seed", None)
            g.manual_seed(seed if seed is not None else torch.initial_seed())
        return g

    def get_rollout_state(self) -> dict:
        """Per-row state carried from one rollout call to the next (mirostat's mu, guide plans)
        and the rollout generators, for an EnvRunner's checkpoint. KV caches are left out: every
        weight sync drops them, and a restore is followed by one."""

        state = {}
        if self.row_sampler_state is not None:
            rs = self.row_sampler_state
            state["sampler"] = {k: cpu_copy(v) for k, v in (("ids", rs.ids), ("mask", rs.mask), ("state", rs.state),
                                                            ("source", rs.source))}
        if self.guided is not None:
            state["guided"] = self.guided.get_state()
        g = getattr(self, "_sampling_generator", None)
        if g is not None:
            state["sampling"] = {"device": g.device.type, "state": g.get_state()}
        return state

    def set_rollout_state(self, state: dict) -> None:

        device = next(self.parameters()).device
        if "sampler" in state and self.row_sampler_state is not None:
            for k, v in state["sampler"].items():
                setattr(self.row_sampler_state, k, on_device(v, device))
        if "guided" in state and self.guided is not None:
            self.guided.set_state(state["guided"], device=device)
        if "sampling" in state and state["sampling"]["device"] == device.type:
            self.rollout_generator(device).set_state(state["sampling"]["state"])

    def set_guide_mode(self, mode: str) -> None:
        """Which roll-in new episodes get (`none`, `ppo_pp`, `aggrevated`); DLOLS/LOLS switch it."""
        if self.guided is not None:
            self.guided.set_mode(mode)

    def sync_mask_model(self) -> None:
        """NLPO's delayed sync: the masking policy becomes a copy of the current policy."""
        self.mask_lm.load_state_dict(self.lm.state_dict())
        if self.mask_kv_cache is not None:
            self.mask_kv_cache.invalidate()

    def get_non_inference_attributes(self) -> list[str]:
        # the value head goes to EnvRunners when it reads the policy's trunk (rollouts store V(s))
        return ["value_trunk", "ref_model"] + ([] if self.values_in_rollouts else ["value_head"])
