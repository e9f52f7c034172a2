"""The rollout side of the policy modules: how an EnvRunner's module acts one token at a time.

`Acting` is mixed into `CausalLMActorCritic` (and through it the seq2seq and Q-network
modules): the decode engine's KV cache (`agents/modules/decode_engine.py`; the window cache
for the trunks the engine does not serve), the truncation sampler's mask and per-row state, a
guide's roll-ins, the draw at pre-drawn uniforms from the module's own generator, and the
rollout state an EnvRunner checkpoints. With a logits-only sampler and no guide the whole step
after the trunk is one static function (`_sample`), captured as a CUDA graph on CUDA.
"""
from __future__ import annotations

import copy

import numpy as np
import torch
from ray.rllib.core.columns import Columns

from agents.core import GUIDE_ROLE, ROW_CONTINUES, SAMPLER_STATE, cpu_copy, on_device
from agents.modules.decode_engine import RingKVCache
from agents.modules.kv_cache import rows_that_continue
from agents.samplers import MASKED, Sampler, sample_rows
from env.text_env import env_setting


def shift_windows(obs: dict, tokens: torch.Tensor) -> dict:
    """The env's transition on the device: each row's window shifted left by one, `tokens` (rows,)
    appended as real columns. With the decode engine a step reads only the newest column, so these
    two ops are all a block adds outside the captured step."""
    ids, mask = obs["input_ids"], obs["attention_mask"]
    return {**obs, "input_ids": torch.cat([ids[:, 1:], tokens.to(ids.dtype)[:, None]], 1),
            "attention_mask": torch.cat([mask[:, 1:], torch.ones_like(mask[:, :1])], 1)}


def static_rollout_step(module, explore: bool = True) -> bool:
    """Whether the module's rollout step (exploring, or greedy) is one static function of the
    decode engine: a sampler with no learned mask and no per-row state, a `RingKVCache`, and while
    exploring no guide (a greedy step takes no guide's token)."""
    return ((module.guided is None or not explore) and module._static_tail()
            and isinstance(module.kv_cache, RingKVCache))


def static_block(module, first: dict, steps: int, device: torch.device, explore: bool = True) -> dict | None:
    """`act_steps`' outputs (first step's `first`, read before any other replay) with its other
    steps in one static function (`RingKVCache.continue_block`), or None where that does not apply
    (not `static_rollout_step`, no decode engine). Exploring, the uniforms are drawn as the steps
    one at a time would draw them; a greedy block's tail takes a placeholder input."""
    if steps < 2 or not static_rollout_step(module, explore):
        return None
    rows = len(first[Columns.ACTIONS])
    if explore:
        tail, key = module._sample, ("explore", module.values_in_rollouts)
        draw = lambda: (torch.stack([torch.rand(rows, 1, dtype=torch.float64, device=device,  # noqa: E731
                                                generator=module.rollout_generator(device))
                                     for _ in range(steps - 1)]),)
    else:
        tail, key = module._greedy, GREEDY_KEY
        draw = lambda: (torch.zeros(steps - 1, 1, device=device),)  # noqa: E731
    rest = module.kv_cache.continue_block(module._trunk(module.lm), first[Columns.ACTIONS], steps - 1, draw,
                                          tail, key, lambda out: out[Columns.ACTIONS])
    return None if rest is None else {k: torch.cat([v[None], rest[k]]) for k, v in first.items()}


GREEDY_KEY = ("greedy step",)  # the greedy rollout step's graphs (`Acting._greedy`)


class RowSamplerState:
    """A stateful sampler's state per vector-env row, carried while the row's episode continues."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self.ids = self.mask = self.state = self.source = None
        self.row_prefixes = False  # True: calls over another number of rows continue the rows `cont` says

    def __call__(self, obs: dict, source_logits: torch.Tensor, cont=None) -> torch.Tensor:
        ids, mask = obs["input_ids"], obs["attention_mask"]
        state = self.sampler.initial_state(ids.shape[0], device=source_logits.device)
        if self.row_prefixes and cont is not None and self.ids is not None and len(self.ids) != len(ids):
            cont = torch.as_tensor(cont, dtype=torch.bool, device=ids.device)  # a serving batch's first rows
        else:
            cont = rows_that_continue(self.ids, self.mask, ids, mask, cont)
        if cont.any():  # the token each continuing row appended is its last column
            m = min(len(cont), len(self.state))  # rows the last call did not step carry none (idle ones)
            keep = cont[:m]
            state[:m][keep] = self.sampler.next_state(self.state[:m][keep], self.source[:m][keep], ids[:m][keep, -1])
        self.ids, self.mask, self.state, self.source = ids, mask, state, source_logits
        return state


class RolloutState:
    """The rollout state of an acting module (EnvRunner side): seeded per EnvRunner, saved in its
    checkpoints. Needs `Acting`'s `row_sampler_state` and `guided`."""

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


class Acting(RolloutState):
    """The acting half of a policy module (see the module docstring). The module provides
    `lm`, `_trunk`, `_hidden`, `_logits`, `_new_cache`, `mask_lm_logits`, `values_in_rollouts`
    and `value_head`."""

    def _setup_rollouts(self, cfg: dict, env_cfg: dict, seq_len: int) -> None:
        """The rollout side's parts: the KV cache, the sampler (with NLPO's masking policy) and,
        on EnvRunner modules of the guided algorithms, the guide."""
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
                max_new_tokens=env_setting(env_cfg, "max_new_tokens"), beta=g["beta"], mix=g["mix"],
                seed=cfg.get("seed", 0), mode=g.get("mode", "ppo_pp"))  # EnvRunners reseed it: seed_rollouts

    def _next_token_hidden(self, obs: dict, cont=None) -> torch.Tensor:
        return self._hidden(self._trunk(self.lm), obs, cache=self.kv_cache, cont=cont)

    def _next_token_logits(self, obs: dict, cont=None) -> torch.Tensor:
        return self._logits(self.lm, self._next_token_hidden(obs, cont))

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

    def can_act_in_blocks(self, explore: bool = True) -> bool:
        return self.guided is None or not explore  # a guide's roll-in plans are drawn on the host, step by step

    @torch.no_grad()
    def act_steps(self, batch, steps: int, explore: bool = True) -> dict:
        """`steps` exploration (or greedy: `act_greedy`) steps with no host round trip between
        them: after the first, each row continues on its window shifted by the token it took
        (`shift_windows`, on the device, as the env's transition). Each output stacked (steps, rows)."""
        if self.training:
            self.eval()
        forward = self._forward_exploration if explore else self.act_greedy
        obs, first = batch[Columns.OBS], forward(batch)
        block = static_block(self, first, steps, obs["input_ids"].device, explore)
        if block is not None:  # the steps after the first in one static function (a CUDA graph on CUDA)
            return block
        # each step's outputs copied out: a replayed CUDA graph returns its static output tensors,
        # which the next replay overwrites
        outs = [{k: v.clone() for k, v in first.items()}]
        every_row = torch.ones(obs["input_ids"].shape[0], dtype=torch.bool)
        for _ in range(steps - 1):
            obs = shift_windows(obs, outs[-1][Columns.ACTIONS])
            out = forward({Columns.OBS: obs, ROW_CONTINUES: every_row})
            outs.append({k: v.clone() for k, v in out.items()})
        return {k: torch.stack([o[k] for o in outs]) for k in outs[0]}

    @torch.no_grad()
    def act_greedy(self, batch) -> dict:
        """A greedy rollout step (`explore=False`): every row's most likely token under the
        sampler's mask and its log-prob, as one static step of the decode engine where the sampler
        allows (`_greedy`, captured on CUDA), else from `act`'s logits."""
        if self.training:
            self.eval()
        cont, obs = batch.get(ROW_CONTINUES), batch[Columns.OBS]
        if static_rollout_step(self, explore=False):
            return dict(self.kv_cache.hidden_at_last_token(self._trunk(self.lm), obs, cont, tail=self._greedy,
                                                           key=GREEDY_KEY))
        return self._argmax(self._acting_logits(obs, cont)[0])

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
        if static_rollout_step(self):
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

    def _greedy(self, hidden: torch.Tensor, _unused=None) -> dict:
        """The greedy step after the trunk (`_static_tail` samplers; a block's placeholder input
        unused). Tensors of fixed shapes only."""
        return self._argmax(self._masked_logits(hidden)[0])

    @staticmethod
    def _argmax(logits: torch.Tensor) -> dict:
        actions = logits.argmax(-1)
        return {Columns.ACTIONS: actions, Columns.ACTION_LOGP: torch.log_softmax(logits.float(), -1)
                .gather(-1, actions[:, None])[:, 0]}

    @staticmethod
    def _draw(logits: torch.Tensor, extra: dict, uniform: torch.Tensor, guide=None) -> dict:
        """The action drawn at `uniform` from the (masked) logits (masked tokens have probability
        exactly 0: never drawn), or the guide's where `guide(actions)` says so, and its log-prob."""
        logp_all = torch.log_softmax(logits, -1)
        actions = sample_rows(logp_all.exp(), uniform)
        if guide is not None:
            actions, extra[GUIDE_ROLE] = guide(actions)
        return {Columns.ACTIONS: actions, Columns.ACTION_LOGP: logp_all.gather(-1, actions[:, None])[:, 0], **extra}

    def set_guide_mode(self, mode: str) -> None:
        """Which roll-in new episodes get (`none`, `ppo_pp`, `aggrevated`); DLOLS/LOLS switch it."""
        if self.guided is not None:
            self.guided.set_mode(mode)

    def weights_changed(self) -> None:
        """New weights (a sync): every cached key/value is stale."""
        for cache in (self.kv_cache, getattr(self, "mask_kv_cache", None)):
            if cache is not None:
                cache.invalidate()
        guide_cache = getattr(getattr(self.guided, "guide", None), "cache", None)
        if guide_cache is not None:  # re-prefilled here too, so a resumed run computes what an uninterrupted one does
            guide_cache.invalidate()
