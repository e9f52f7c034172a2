"""Guide policies and guided roll-ins for RL with guided feedback (PPO++, AggreVaTeD, LOLS, DLOLS).

A guide proposes the next token for a batch of states (left-padded observation windows,
newest token last). Two kinds, chosen in the YAML `guide` section:

  * `guide.name_or_path`: a causal LM (a built-in config, a `save_pretrained` directory
    such as a warm start or an exported checkpoint, or a hub name) whose tokenizer has
    exactly the policy's vocabulary. It steps incrementally with its own KV cache.
  * `guide.callable: "module:function"`: any Python function (a scripted policy, a
    black-box model behind an API) called as `function(prefixes) -> continuations`, where
    `prefixes` is a list of texts (prompt + tokens generated so far, decoded with the
    policy's tokenizer) and each continuation is a string (tokenized with the policy's
    tokenizer; "" ends the text) or a list of token ids. Only the first token is taken
    per step; the rest is kept and used while the row follows it, so a function that
    returns whole continuations is called about once per roll-in, not once per token.

`GuidedRollout` decides, per vector-env row and per episode, which steps the guide takes.
The transition is deterministic (append the token), so the guide rolling in for k steps
inside an episode reaches exactly the state `env.reset(options={"prefix_ids": ...})` would
restart to: the guided roll-in *is* the paper's restart distribution, with no env restart
and no wasted policy forward passes. Each step carries a role (`GUIDE_ROLE`) that the
learner turns into its loss mask and advantages:

  POLICY     the policy's own step: PPO loss with GAE advantages
  GUIDE      a roll-in or roll-out step (the guide's token, or a policy token inside an
             AggreVaTeD mixture roll-in): no loss, no KL penalty
  DEVIATION  AggreVaTeD's one policy action at the sampled step: its advantage is the
             reward of the guide's completion minus the value baseline
"""
from __future__ import annotations

import importlib
import os
import random

import numpy as np
import torch

from agents.core import GUIDE_ROLE, cpu_copy, on_device  # noqa: F401  (GUIDE_ROLE: the column of the roles below)
from agents.modules.decode_engine import RingKVCache
from agents.modules.kv_cache import rows_that_continue
from agents.samplers import sample_rows
from env.validation import first_line

POLICY, GUIDE, DEVIATION = 0, 1, 2


class GuideError(ValueError):
    """A guide that cannot be used, reported as one line naming the `guide` field."""


# -- guides ---------------------------------------------------------------------------

class LMGuide:
    """A causal LM sharing the policy's vocabulary; samples (or takes the argmax of) its next token.
    It follows the policy onto its rollout device and samples there, from its own generator on
    that device (no host read: the draw is `sample_rows`' inverse CDF at a uniform from it)."""

    def __init__(self, name_or_path: str, tokenizer, *, greedy: bool = False, seed: int = 0, max_positions: int = 1024):
        from agents.models import build_causal_lm

        check_guide_vocabulary(name_or_path, tokenizer)
        try:  # build_causal_lm also refuses a model with fewer embeddings than the tokenizer's tokens
            self.lm = build_causal_lm({"name_or_path": name_or_path}, tokenizer, seed=seed + 1,
                                      max_positions=max_positions).eval().requires_grad_(False)
        except (OSError, ValueError) as e:
            raise GuideError(f"guide.name_or_path: cannot load {name_or_path!r}: {first_line(e)}") from None
        self.greedy = greedy
        self.cache = RingKVCache()  # the policy's decode engine: a static step (captured on CUDA) for continuing rows
        self.seed(seed)

    def seed(self, seed: int) -> None:
        self._seed, self._pending = int(seed), None
        self.generator = torch.Generator(self.lm.device).manual_seed(self._seed)

    def _generator(self, device: torch.device, drawing: bool = True) -> torch.Generator:
        """The sampling generator on `device`: made anew from the seed where the guide moved, with
        a restored state for that device where one waits (`set_state`). A restored state of
        another device is dropped at the first draw here (the run goes on from this generator)."""
        if self.generator.device != device:
            self.generator = torch.Generator(device).manual_seed(self._seed)
        if self._pending is not None and self._pending["device"] == device.type:
            self.generator.set_state(self._pending["generator"])
            self._pending = None
        elif drawing:
            self._pending = None
        return self.generator

    def get_state(self) -> dict:
        """The sampling generator and its device (the KV cache is rebuilt: see `GuidedRollout.get_state`)."""
        if self._pending is not None:  # restored and not sampled since: the state as restored
            return dict(self._pending)
        return {"generator": self.generator.get_state(), "device": self.generator.device.type}

    def set_state(self, state: dict, device=None) -> None:
        self._pending = {"generator": state["generator"], "device": state.get("device", "cpu")}
        self._generator(self.generator.device, drawing=False)  # applied now where the devices agree, else when it moves there
        self.cache.forget_rows()  # the guide's weights never change: its stored prefills hold

    @torch.no_grad()
    def next_tokens(self, obs: dict, rows: torch.Tensor, cont=None) -> torch.Tensor:
        device = obs["input_ids"].device
        if self.lm.device != device:  # follow the policy onto its EnvRunner's device
            self.lm.to(device)
            self.cache.invalidate()
        # Every row goes through the guide (not just `rows`), so its KV cache keeps continuing
        # rows and each step costs one incremental forward.
        hidden = self.cache.hidden_at_last_token(self.lm.base_model, obs, cont)
        logits = self.lm.get_output_embeddings()(hidden[rows]).float()
        if self.greedy:
            return logits.argmax(-1)
        uniform = torch.rand(logits.shape[0], 1, dtype=torch.float64, device=device, generator=self._generator(device))
        return sample_rows(torch.softmax(logits, -1), uniform)


class CallableGuide:
    """A Python function `prefixes -> continuations` (see the module docstring)."""

    def __init__(self, spec: str, tokenizer):
        self.spec, self.fn = spec, import_callable(spec)
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.eos_id = tokenizer.eos_token_id
        self.plans: dict[int, list[int]] = {}  # row -> tokens still to come from its last answer
        self.prev_ids = self.prev_mask = None

    def seed(self, seed: int) -> None:
        """Nothing to seed here: a function that draws random numbers should use Python's
        `random` or NumPy's global generator, which RLlib seeds per EnvRunner (config seed +
        worker index) and the EnvRunner saves in checkpoints."""

    def get_state(self) -> dict:
        return {"plans": {r: list(p) for r, p in self.plans.items()},
                "prev_ids": cpu_copy(self.prev_ids), "prev_mask": cpu_copy(self.prev_mask)}

    def set_state(self, state: dict, device=None) -> None:
        self.plans = {int(r): list(p) for r, p in state["plans"].items()}
        self.prev_ids, self.prev_mask = state["prev_ids"], state["prev_mask"]  # kept on the host

    def continuations(self, prefixes: list[str]) -> list[list[int]]:
        """The function's answers as token-id lists, or GuideError naming what is wrong."""
        out = self.fn(list(prefixes))
        if not isinstance(out, (list, tuple)) or len(out) != len(prefixes):
            got = f"{type(out).__name__} of length {len(out)}" if isinstance(out, (list, tuple)) else repr(out)[:80]
            raise GuideError(f"guide.callable: {self.spec} must return a list with one continuation per prefix "
                             f"({len(prefixes)}), got {got}")
        result = []
        for prefix, item in zip(prefixes, out):
            if isinstance(item, str):
                ids = self.tokenizer(item, add_special_tokens=False)["input_ids"] if item.strip() else [self.eos_id]
            elif isinstance(item, (list, tuple)) and item and all(isinstance(t, (int, np.integer)) for t in item):
                ids = [int(t) for t in item]
            else:
                raise GuideError(f"guide.callable: {self.spec} returned {item!r} for prefix {prefix!r}; expected a "
                                 f"string or a non-empty list of token ids")
            if not ids or any(not 0 <= t < self.vocab_size for t in ids):
                raise GuideError(f"guide.callable: {self.spec} returned {item!r} for prefix {prefix!r}: token ids "
                                 f"must lie in [0, {self.vocab_size}) (the policy's vocabulary)")
            result.append(ids)
        return result

    def next_tokens(self, obs: dict, rows: torch.Tensor, cont=None) -> torch.Tensor:
        """The function runs on the host: the windows come over once per call, wherever the
        rollouts run, and the plans work on host copies."""
        device = obs["input_ids"].device
        ids, mask = obs["input_ids"].cpu().clone(), obs["attention_mask"].cpu().clone()
        cont = rows_that_continue(self.prev_ids, self.prev_mask, ids, mask, cont, host=True)
        last = ids[:, -1].tolist()
        plans = {}
        for r in range(ids.shape[0]):  # a plan stays valid while its row appended the planned token
            plan = self.plans.get(r)
            if plan and cont[r] and last[r] == plan[0] and len(plan) > 1:
                plans[r] = plan[1:]
        rows = rows.tolist()
        ask = [r for r in rows if r not in plans]
        if ask:
            texts = [self.tokenizer.decode(ids[r][mask[r].bool()].tolist(), skip_special_tokens=True) for r in ask]
            for r, plan in zip(ask, self.continuations(texts)):
                plans[r] = plan
        self.plans, self.prev_ids, self.prev_mask = plans, ids, mask
        return torch.tensor([plans[r][0] for r in rows], dtype=torch.long).to(device)


def import_callable(spec: str):
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise GuideError(f"guide.callable: expected 'module:function', got {spec!r}")
    module_name, attr = spec.split(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise GuideError(f"guide.callable: cannot import {spec!r}: {first_line(e)}") from None
    if not callable(fn):
        raise GuideError(f"guide.callable: {spec!r} is not callable")
    return fn


def check_guide_vocabulary(name_or_path: str, tokenizer) -> None:
    """Refuses an LM guide whose tokenizer differs from the policy's: its token ids would mean other text."""
    from agents.models import is_builtin
    from env.tokenization import load_tokenizer

    if is_builtin(name_or_path):
        return  # built with the policy's own tokenizer
    try:
        guide_tok = load_tokenizer(name_or_path)
    except (OSError, ValueError) as e:
        where = "directory" if os.path.isdir(name_or_path) else "model"
        raise GuideError(f"guide.name_or_path: cannot load a tokenizer for {name_or_path!r} ({where}): "
                         f"{first_line(e)}") from None
    if guide_tok.get_vocab() != tokenizer.get_vocab():
        raise GuideError(f"guide.name_or_path: {name_or_path!r} has a different vocabulary "
                         f"({len(guide_tok)} tokens) from the policy's ({len(tokenizer)} tokens); "
                         f"a guide must share the policy's tokenizer")


def build_guide(guide_cfg: dict, tokenizer, *, seed: int = 0, max_positions: int = 1024):
    if guide_cfg.get("callable"):
        return CallableGuide(guide_cfg["callable"], tokenizer)
    if guide_cfg.get("name_or_path"):
        return LMGuide(guide_cfg["name_or_path"], tokenizer, greedy=bool(guide_cfg.get("greedy", False)), seed=seed,
                       max_positions=max_positions)
    raise GuideError("guide: give guide.name_or_path (a causal LM) or guide.callable ('module:function')")


# -- guided roll-ins ---------------------------------------------------------------------

class GuidedRollout:
    """Per-row roll-in plans for the vector env's rows, and the role of every step.

    A row starts a new episode whenever its observation does not continue the previous
    call's (the KV cache's rule); its plan is drawn then, under the current mode:

      ppo_pp      with probability `beta` the guide takes the first k ~ U{1..T-1} steps,
                  then the policy continues from that state; otherwise the policy alone.
      aggrevated  a step d ~ U{0..T-1} is drawn; before it each token is the guide's with
                  probability `mix`, else the policy's (the mixture roll-in); at d the policy
                  acts (DEVIATION); after it the guide completes the text.
      none        the policy alone (plain PPO).

    A mode change (`set_mode`, DLOLS/LOLS between iterations) applies to episodes that start
    after it; the roles stored with each step keep earlier episodes' losses correct.
    """

    MODES = ("none", "ppo_pp", "aggrevated")

    def __init__(self, guide, *, max_new_tokens: int, beta: float, mix: float, seed: int = 0,
                 mode: str = "ppo_pp"):
        self.guide, self.T, self.beta, self.mix = guide, int(max_new_tokens), float(beta), float(mix)
        self.rng = np.random.default_rng(seed)
        self.set_mode(mode)
        self.prev_ids = self.prev_mask = None
        self.t = self.kind = self.limit = None  # per row: steps taken, plan kind, roll-in length / deviation step

    def seed(self, seed: int) -> None:
        """Restarts the plan draws (and an LM guide's sampling) from `seed`; EnvRunners call it
        with a seed of their own (config seed and worker index)."""
        self.rng = np.random.default_rng(seed)
        self.guide.seed(seed)

    def get_state(self) -> dict:
        """Everything the next call depends on: the plan generator, each row's plan and step, the
        previous window (which rows continue) and the guide's own state. An LM guide's KV cache
        is not saved: it is dropped at every weight sync (`CausalLMActorCritic.set_state`), so
        a resumed run re-prefills it exactly where an uninterrupted run does."""
        return {"rng": self.rng.bit_generator.state, "mode": self.mode,
                "prev_ids": cpu_copy(self.prev_ids), "prev_mask": cpu_copy(self.prev_mask),
                "t": self.t, "kind": self.kind, "limit": self.limit, "guide": self.guide.get_state()}

    def set_state(self, state: dict, device=None) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.set_mode(state["mode"])
        self.prev_ids, self.prev_mask = on_device(state["prev_ids"], device), on_device(state["prev_mask"], device)
        self.t, self.kind, self.limit = state["t"], state["kind"], state["limit"]
        self.guide.set_state(state["guide"], device=device)

    def set_mode(self, mode: str) -> None:
        if mode not in self.MODES:
            raise ValueError(f"guided roll-in mode must be one of {self.MODES}, got {mode!r}")
        self.mode = mode

    def _new_plans(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if self.mode == "ppo_pp":
            kind = np.where(self.rng.random(n) < self.beta, 1, 0)
            limit = self.rng.integers(1, max(self.T, 2), size=n)  # at least one guide and one policy step
        elif self.mode == "aggrevated":
            kind = np.full(n, 2)
            limit = self.rng.integers(0, self.T, size=n)
        else:
            kind, limit = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        return kind, limit

    def _continuing(self, ids: torch.Tensor, mask: torch.Tensor, cont) -> torch.Tensor:
        """Which rows continue the previous call's episode, on the host: `cont` where the caller
        knows it (the EnvRunner's, already on the host), else from the windows (one host read)."""
        if self.prev_ids is not None and self.prev_ids.device != ids.device:  # the rollouts moved device
            self.prev_ids, self.prev_mask = self.prev_ids.to(ids.device), self.prev_mask.to(ids.device)
        return rows_that_continue(self.prev_ids, self.prev_mask, ids, mask, cont, host=True)

    def __call__(self, obs: dict, policy_actions: torch.Tensor, cont=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The actions to take (guide tokens where the plan says so) and each row's role.
        `cont`: which rows continue the previous call's episode, when the caller knows."""
        ids, mask = obs["input_ids"], obs["attention_mask"]
        n = ids.shape[0]
        cont_rows = self._continuing(ids, mask, cont)
        cont = cont_rows.numpy()
        t = np.zeros(n, dtype=np.int64)
        kind, limit = self._new_plans(n)
        if cont.any():
            t[cont] = self.t[cont] + 1
            kind[cont], limit[cont] = self.kind[cont], self.limit[cont]
        self.prev_ids, self.prev_mask, self.t, self.kind, self.limit = ids.clone(), mask.clone(), t, kind, limit

        roles = np.full(n, POLICY)
        use_guide = np.zeros(n, dtype=bool)
        rollin = kind == 1
        roles[rollin & (t < limit)] = GUIDE
        use_guide |= rollin & (t < limit)
        agg = kind == 2
        roles[agg & (t != limit)] = GUIDE
        roles[agg & (t == limit)] = DEVIATION
        mixture = self.rng.random(n) < self.mix
        use_guide |= agg & (((t < limit) & mixture) | (t > limit))

        actions = policy_actions.clone()
        rows = torch.as_tensor(np.flatnonzero(use_guide), device=ids.device)
        if len(rows):
            actions[rows] = self.guide.next_tokens(obs, rows, cont_rows).to(actions.dtype)
        elif isinstance(self.guide, LMGuide):
            self.guide.cache.forget_rows()  # no forward this step: its cache no longer continues
        return actions, torch.as_tensor(roles, device=ids.device)


# -- a scripted guide for the synthetic task ------------------------------------------

def noisy_increasing_numbers(prefixes: list[str], *, num_numbers: int = 50, max_step: int = 3,
                             noise: float = 0.1) -> list[str]:
    """Scripted guide for the increasing-numbers task: the next number is the last one plus
    1..max_step; with probability `noise` (or when that would pass the largest number) a
    uniformly random number instead: a good but imperfect policy (reward about 0.93 with the
    defaults, against 0.37 for a uniformly random policy). Draws from Python's global `random`,
    which RLlib seeds per EnvRunner (config seed + worker index) and checkpoints save."""
    out = []
    for text in prefixes:
        numbers = [int(w) for w in text.split() if w.isdigit()]
        nxt = (numbers[-1] if numbers else -1) + random.randint(1, max_step)
        if random.random() < noise or nxt >= num_numbers:
            nxt = random.randrange(num_numbers)
        out.append(str(nxt))
    return out



def combination_lock(prefixes: list[str], *, pattern: str | None = None, noise: float = 0.1,
                     num_numbers: int = 50) -> list[str]:
    """Scripted guide for the combination_lock task (default pattern): it continues the pattern
    from the longest end of the numbers so far that begins it (after "7" it writes "31"),
    starts it when nothing is pending, and writes random numbers once the lock is open; with
    probability `noise` a uniformly random number instead. Draws from Python's global
    `random` (see `noisy_increasing_numbers`). Its own episodes opened the default lock in
    all of 2,000 episodes (20 tokens, noise 0.1; tests/test_combination_lock.py checks >= 90%)."""
    from env.tasks.combination_lock import DEFAULT_PATTERN, parse_pattern

    target = list(parse_pattern(pattern or DEFAULT_PATTERN, num_numbers))
    out = []
    for text in prefixes:
        numbers = [int(w) for w in text.split() if w.isdigit()]
        opened = any(numbers[i:i + len(target)] == target for i in range(len(numbers) - len(target) + 1))
        if opened or random.random() < noise:
            out.append(str(random.randrange(num_numbers)))
            continue
        done = next(k for k in range(len(target) - 1, -1, -1) if k == 0 or numbers[-k:] == target[:k])
        out.append(str(target[done]))
    return out
