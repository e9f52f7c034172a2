"""Experiment configs: YAML in, validated dict out, then RLlib/Tune objects.

Validation happens before Ray starts and fails with one line naming the field
(`ConfigError`). Any leaf may be a Tune search space written in YAML:
`{grid_search: [..]}`, `{choice: [..]}`, `{uniform: [lo, hi]}`,
`{loguniform: [lo, hi]}`, `{randint: [lo, hi]}`; each candidate is validated
like a plain value.
"""
from __future__ import annotations

import copy
import difflib
import math
import os

import yaml


class ConfigError(ValueError):
    """A config problem, reported as one line naming the field."""


class Field:
    def __init__(self, kind, default=None, *, lo=None, hi=None, lo_open=False, choices=None, optional=False):
        self.kind, self.default = kind, default
        self.lo, self.hi, self.lo_open, self.choices, self.optional = lo, hi, lo_open, choices, optional

    def describe(self) -> str:
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        name = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping"}[self.kind]
        if self.lo is not None and self.hi is not None:
            return f"{name} in {'(' if self.lo_open else '['}{self.lo}, {self.hi}]"
        if self.lo is not None:
            return f"{name} {'>' if self.lo_open else '>='} {self.lo}"
        return name

    def check(self, path: str, value):
        if value is None and self.optional:
            return None
        if self.kind is float and isinstance(value, str):
            try:  # YAML 1.1 reads "1e-3" (no dot) as a string
                value = float(value)
            except ValueError:
                pass
        ok_type = {
            int: isinstance(value, int) and not isinstance(value, bool),
            float: isinstance(value, (int, float)) and not isinstance(value, bool),
            bool: isinstance(value, bool),
            str: isinstance(value, str),
            dict: isinstance(value, dict),
        }[self.kind]
        if self.kind is float and ok_type:
            value = float(value)
            ok_type = math.isfinite(value)
        bad = not ok_type
        if not bad and self.choices is not None and value not in self.choices:
            bad = True
        if not bad and self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)):
            bad = True
        if not bad and self.hi is not None and value > self.hi:
            bad = True
        if bad:
            raise ConfigError(f"{path}: expected {self.describe()}, got {value!r}")
        return value


F = Field
POS_INT, NONNEG_INT = dict(lo=1), dict(lo=0)

SCHEMA: dict[str, dict[str, Field] | Field] = {
    # ppo_pp, aggrevated, lols, dlols: guided RL (agents/algorithms/guided.py, `guide` section);
    # reinforce, self_critical: sequence-level policy gradient (agents/algorithms/reinforce.py).
    "algorithm": F(str, "ppo", choices=["ppo", "a3c", "dqn", "ppo_pp", "aggrevated", "lols", "dlols", "reinforce",
                                        "self_critical"]),
    "seed": F(int, 0, **NONNEG_INT),
    "task": {  # extra keys are passed to the task; its constructor checks them
        "name": F(str, "increasing_numbers"),
    },
    "model": {
        "name_or_path": F(str, "tiny-gpt2"),
        "value_model": F(str, "shared", choices=["shared", "separate"]),
        # causal: AutoModelForCausalLM; seq2seq: AutoModelForSeq2SeqLM (T5, BART), the prompt is the
        # encoder's input; auto: from the built-in's kind or the model's config (is_encoder_decoder).
        "kind": F(str, "auto", choices=["auto", "causal", "seq2seq"]),
        "kv_cache": F(bool, True),
        "overrides": F(dict, {}),
    },
    "env": {
        "max_prompt_len": F(int, 5, **POS_INT),
        "max_new_tokens": F(int, 20, **POS_INT),
        "truncation_side": F(str, "left", choices=["left", "right"]),
        "tokenizer": F(str, None, optional=True),
        # true: every token is rewarded with the change of the task metric over the text so far
        # (the return is still the finished text's metric); false: the metric once, at the end.
        "dense_reward": F(bool, False),
    },
    "sampler": {  # truncation sampler masking the policy (agents/samplers.py)
        "name": F(str, "none", choices=["none", "top_k", "top_p", "typical", "epsilon", "eta", "mirostat"]),
        "k": F(int, None, **POS_INT, optional=True),
        "p": F(float, None, lo=0.0, hi=1.0, lo_open=True, optional=True),
        "epsilon": F(float, None, lo=0.0, hi=1.0, lo_open=True, optional=True),
        "eta": F(float, None, lo=0.0, hi=1.0, lo_open=True, optional=True),
        "tau": F(float, None, lo=0.0, lo_open=True, optional=True),
        "learning_rate": F(float, 0.1, lo=0.0, lo_open=True),
        "min_tokens_to_keep": F(int, 1, **POS_INT),
        "masking": F(str, "current", choices=["current", "learned"]),
        "sync_every": F(int, 100, **POS_INT),
    },
    "reward": {
        "kl_coef": F(float, 0.0, lo=0.0),
        "kl_adaptive": F(bool, False),
        "kl_target": F(float, 6.0, lo=0.0, lo_open=True),
        "kl_horizon": F(int, 10000, **POS_INT),
    },
    "training": {
        "lr": F(float, 1e-4, lo=0.0, lo_open=True),
        # Linear annealing (A3C anneals to 0): lr falls from `lr` to `lr_end` over `lr_decay_steps`
        # sampled env steps, then stays there; both null: constant lr.
        "lr_end": F(float, None, lo=0.0, optional=True),
        "lr_decay_steps": F(int, None, **POS_INT, optional=True),
        "train_batch_size": F(int, 1024, **POS_INT),
        "minibatch_size": F(int, 256, **POS_INT),
        "num_epochs": F(int, 4, **POS_INT),
        "gamma": F(float, 1.0, lo=0.0, hi=1.0),
        "lambda": F(float, 0.95, lo=0.0, hi=1.0),
        "clip_param": F(float, 0.2, lo=0.0, lo_open=True),
        "vf_loss_coeff": F(float, 0.5, lo=0.0),
        "vf_clip_param": F(float, 10.0, lo=0.0, lo_open=True),
        "entropy_coeff": F(float, 0.0, lo=0.0),
        "grad_clip": F(float, 1.0, lo=0.0, lo_open=True, optional=True),
        # Mixed objective: + mle_coef * NLL of the task's reference continuations given their
        # prompts (mle_batch_size pairs per loss computation); 0: pure RL.
        "mle_coef": F(float, 0.0, lo=0.0),
        "mle_batch_size": F(int, 16, **POS_INT),
    },
    "dqn": {  # algorithm: dqn only (agents/algorithms/dqn.py, agents/modules/q_network.py)
        "head": F(str, "logits", choices=["logits", "mlp"]),
        "mlp_hidden": F(int, 64, **POS_INT),
        "dueling": F(bool, False),
        "double_q": F(bool, True),
        "n_step": F(int, 1, **POS_INT),
        # With n_step_max, each replayed step draws n uniformly from n_step..n_step_max; steps closer
        # to the episode's end than n are redrawn (RLlib), so the last steps get short returns.
        "n_step_max": F(int, None, **POS_INT, optional=True),
        # Target network sync period in sampled env steps, and the Polyak factor (1.0: hard copy).
        "target_update_every": F(int, 500, **POS_INT),
        "tau": F(float, 1.0, lo=0.0, hi=1.0, lo_open=True),
        # Epsilon-greedy: linear from epsilon_start to epsilon_end over epsilon_steps env steps.
        "epsilon_start": F(float, 1.0, lo=0.0, hi=1.0),
        "epsilon_end": F(float, 0.05, lo=0.0, hi=1.0),
        "epsilon_steps": F(int, 10000, **POS_INT),
        # sequences: every step of whole stored episodes per update, one forward pass per sequence
        # (uniform over episodes); steps: RLlib's step buffers, one pass per step (prioritized or not).
        "replay": F(str, "sequences", choices=["sequences", "steps"]),
        "replay_capacity": F(int, 50000, **POS_INT),  # stored env steps
        "prioritized": F(bool, False),
        "alpha": F(float, 0.6, lo=0.0),
        "beta": F(float, 0.4, lo=0.0),
        "learning_starts": F(int, 1000, **NONNEG_INT),
        # Replayed / sampled steps; null: one update of train_batch_size per sample() call.
        "training_intensity": F(float, None, lo=0.0, lo_open=True, optional=True),
        "td_loss": F(str, "huber", choices=["huber", "mse"]),
        # A training iteration (one progress line, one result row) samples at least this many env steps.
        "steps_per_iteration": F(int, 1000, **POS_INT),
        # agents.generate without --greedy samples softmax(Q / sample_temperature).
        "sample_temperature": F(float, 1.0, lo=0.0, lo_open=True),
    },
    "guide": {  # guided algorithms only (ppo_pp, aggrevated, lols, dlols); agents/guides.py
        "name_or_path": F(str, None, optional=True),  # a causal LM sharing the policy's vocabulary
        "callable": F(str, None, optional=True),  # 'module:function': prefix texts -> continuations
        "greedy": F(bool, False),  # an LM guide takes its argmax token instead of sampling
        "beta": F(float, 0.2, lo=0.0, hi=1.0),  # PPO++: probability an episode starts with a guide roll-in
        "mix": F(float, 0.8, lo=0.0, hi=1.0),  # AggreVaTeD: probability a roll-in token is the guide's
        "lols_prob": F(float, 0.2, lo=0.0, hi=1.0),  # LOLS: probability an iteration is AggreVaTeD
        # DLOLS: AggreVaTeD for this many iterations, or this fraction of stop.training_iteration; then PPO++.
        "switch_iteration": F(int, None, **NONNEG_INT, optional=True),
        "switch_fraction": F(float, 0.2, lo=0.0, hi=1.0),
    },
    "reinforce": {  # reinforce and self_critical only (agents/algorithms/reinforce.py)
        # reinforce: each prompt is drawn for this many episodes in a row; baseline = their mean reward.
        "num_samples": F(int, 4, lo=2),
    },
    "evaluation": {  # greedy (explore off) evaluation episodes every `interval` iterations; 0: none
        "interval": F(int, 0, **NONNEG_INT),
        "episodes": F(int, 32, **POS_INT),
    },
    "env_runners": {
        "num_env_runners": F(int, 0, **NONNEG_INT),
        "num_envs_per_env_runner": F(int, 16, **POS_INT),
        "num_cpus_per_env_runner": F(float, 1.0, lo=0.0),
        "num_gpus_per_env_runner": F(float, 0.0, lo=0.0),
        "max_restarts": F(int, 3, **NONNEG_INT),
        # fast: whole episodes from the vector env, one module call per token step
        # (agents/env_runner.py); stock: RLlib's SingleAgentEnvRunner. auto: fast, stock for dqn.
        "runner": F(str, "auto", choices=("auto", "fast", "stock")),
    },
    "learners": {
        "num_learners": F(int, 0, **NONNEG_INT),
        # None: 1 without a GPU, 0 with one; with num_learners 0 the learner shares the
        # trial's process and tune.num_cpus_per_trial (when set) is its share.
        "num_cpus_per_learner": F(float, None, lo=0.0, optional=True),
        "num_gpus_per_learner": F(float, 0.0, lo=0.0),
    },
    "stop": {  # the default 100 iterations applies only when no time or env-step budget is given
        "training_iteration": F(int, 100, **POS_INT, optional=True),
        "time_total_s": F(float, None, lo=0.0, lo_open=True, optional=True),
        "num_env_steps_sampled_lifetime": F(int, None, **POS_INT, optional=True),
        "episode_return_mean": F(float, None, optional=True),
    },
    "checkpoint": {
        "frequency": F(int, 10, **NONNEG_INT),
        "at_end": F(bool, True),
        "num_to_keep": F(int, 3, **POS_INT, optional=True),
        # How often (seconds) the experiment's state, the record --resume starts from, is saved.
        # A kill within this long of a checkpoint resumes from the checkpoint before it.
        "state_every_s": F(float, 2.0, lo=0.0, lo_open=True),
    },
    "tune": {
        "name": F(str, None, optional=True),
        "storage_path": F(str, "results"),
        "num_samples": F(int, 1, **POS_INT),
        "max_concurrent_trials": F(int, 1, **POS_INT),
        "num_cpus_per_trial": F(float, None, lo=0.0, lo_open=True, optional=True),
        # Times a failed trial is restarted from its last checkpoint (lost node, killed process).
        "max_failures": F(int, 0, **NONNEG_INT),
        "metric": F(str, "env_runners/episode_return_mean"),
        "mode": F(str, "max", choices=["max", "min"]),
        "scheduler": F(str, "fifo", choices=["fifo", "asha"]),
        "grace_period": F(int, 10, **POS_INT),
        "reduction_factor": F(float, 3.0, lo=1.0, lo_open=True),
        "wandb": F(bool, False),
        "dashboard": F(bool, True),
        "wandb_project": F(str, "rl-token-lm"),
    },
    "generate": {
        "num_samples": F(int, 3, **NONNEG_INT),
    },
}
OPEN_SECTIONS = {"task"}  # sections that accept keys beyond the schema
SEARCH_SPACES = ("grid_search", "choice", "uniform", "loguniform", "randint")


def _unknown(path: str, key: str, known) -> ConfigError:
    hint = difflib.get_close_matches(key, list(known), n=1)
    suffix = f" (did you mean {hint[0]!r}?)" if hint else f" (known: {', '.join(sorted(known))})"
    return ConfigError(f"{path + '.' if path else ''}{key}: unknown key{suffix}")


SEARCHABLE_SECTIONS = ("training", "reward", "sampler", "seed", "dqn", "guide", "algorithm")  # others feed values that must agree across processes
WHOLE_SECTION_SEARCH = ("sampler",)  # sections that may be one search space over whole mappings
# The parameters each sampler needs (and the only ones it accepts), with their ranges where they
# are narrower than the schema's.
SAMPLER_PARAMS = {
    "none": (), "top_k": ("k",), "top_p": ("p",), "typical": ("p",), "epsilon": ("epsilon",),
    "eta": ("eta",), "mirostat": ("tau", "learning_rate"),
}
SAMPLER_ONLY = ("k", "p", "epsilon", "eta", "tau")


def _is_search_space(value) -> bool:
    return isinstance(value, dict) and len(value) == 1 and next(iter(value)) in SEARCH_SPACES


def _check_value(path: str, field: Field, value):
    if _is_search_space(value):
        if path.split(".")[0] not in SEARCHABLE_SECTIONS:
            raise ConfigError(f"{path}: search spaces are supported in the {' and '.join(SEARCHABLE_SECTIONS)} sections only")
        (kind, args), = value.items()
        if not isinstance(args, list) or not args:
            raise ConfigError(f"{path}.{kind}: expected a non-empty list")
        if kind in ("uniform", "loguniform", "randint"):
            if len(args) != 2 or not args[0] < args[1]:
                raise ConfigError(f"{path}.{kind}: expected [low, high] with low < high, got {args!r}")
            if kind == "loguniform" and args[0] <= 0:
                raise ConfigError(f"{path}.loguniform: bounds must be > 0, got {args!r}")
        return {kind: [field.check(path, v) for v in args]}
    return field.check(path, value)


def validate(raw: dict) -> dict:
    """Returns the config with defaults filled in, or raises ConfigError."""
    if not isinstance(raw, dict):
        raise ConfigError("config: the YAML file must hold a mapping at the top level")
    out = {}
    for key in raw:
        if key not in SCHEMA:
            raise _unknown("", key, SCHEMA)
    for key, spec in SCHEMA.items():
        value = raw.get(key)
        if isinstance(spec, Field):
            out[key] = spec.default if value is None else _check_value(key, spec, value)
            continue
        if key in WHOLE_SECTION_SEARCH and _is_search_space(value):
            (kind, candidates), = value.items()
            if kind not in ("grid_search", "choice") or not isinstance(candidates, list) or not candidates:
                raise ConfigError(f"{key}.{kind}: a whole section can only be searched with grid_search or "
                                  "choice over a non-empty list of mappings")
            out[key] = {kind: [_check_section(f"{key}[{i}]", key, spec, c) for i, c in enumerate(candidates)]}
            continue
        out[key] = _check_section(key, key, spec, value)
    raw_stop = raw.get("stop") if isinstance(raw.get("stop"), dict) else {}
    if "training_iteration" not in raw_stop and any(
            raw_stop.get(k) is not None for k in ("time_total_s", "num_env_steps_sampled_lifetime")):
        out["stop"]["training_iteration"] = None  # a budget given in time or steps is not cut at 100 iterations
    _check_model_kind(out, None)  # first: an unsupported policy kind makes the other checks moot
    _check_algorithm_fields(raw, out)
    _check_guided_fields(raw, out)
    _check_cross_fields(out)
    return out


def _check_section(path: str, key: str, spec: dict, value) -> dict:
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a mapping, got {value!r}")
    section = {}
    for sub in value:
        if sub not in spec and key not in OPEN_SECTIONS:
            raise _unknown(path, sub, spec)
    for sub, field in spec.items():
        v = value.get(sub, copy.deepcopy(field.default))
        section[sub] = _check_value(f"{path}.{sub}", field, v) if sub in value else v
    for sub in value:
        if sub not in spec:
            section[sub] = value[sub]
    if key == "sampler":
        _check_sampler(path, section)
    return section


def _candidates(value) -> list:
    return next(iter(value.values())) if _is_search_space(value) else [value]


def _check_sampler(path: str, s: dict) -> None:
    if _is_search_space(s["name"]):
        raise ConfigError(f"{path}.name: search over whole sampler mappings instead "
                          f"(sampler: {{grid_search: [{{name: top_p, p: 0.9}}, ...]}})")
    name, needs = s["name"], SAMPLER_PARAMS[s["name"]]
    for param in SAMPLER_ONLY:
        if s[param] is not None and param not in needs:
            takes = f"takes {', '.join(needs)}" if needs else "takes no parameters"
            raise ConfigError(f"{path}.{param}: not a parameter of the {name!r} sampler (it {takes})")
    for param in needs:
        if s[param] is None:
            raise ConfigError(f"{path}.{param}: the {name!r} sampler needs it")
    if name == "typical":
        for v in _candidates(s["p"]):
            if v >= 1.0:
                raise ConfigError(f"{path}.p: typical sampling needs p < 1, got {v!r}")
    for param in ("epsilon", "eta"):
        for v in _candidates(s[param]) if s[param] is not None else []:
            if v >= 1.0:
                raise ConfigError(f"{path}.{param}: expected a number in (0, 1), got {v!r}")


def _plain(value):
    """A representative plain value for cross-field checks (first candidate of a search space)."""
    if _is_search_space(value):
        return next(iter(value.values()))[0]
    return value


# Training keys only the actor-critic algorithms read (DQN takes lr, train_batch_size, gamma, grad_clip).
ACTOR_CRITIC_ONLY = ("minibatch_size", "num_epochs", "lambda", "clip_param", "vf_loss_coeff", "vf_clip_param",
                     "entropy_coeff", "mle_coef", "mle_batch_size")


def _check_algorithm_fields(raw: dict, cfg: dict) -> None:
    """Refuses options the chosen algorithm cannot use, naming the option."""
    algo = cfg["algorithm"]
    if algo != "dqn":
        if raw.get("dqn") is not None:
            raise ConfigError(f"dqn: only used with algorithm: dqn (this config's algorithm is {algo!r})")
        return
    for key in ACTOR_CRITIC_ONLY:
        if key in (raw.get("training") or {}):
            raise ConfigError(f"training.{key}: not used by DQN (a PPO/A3C option); remove it")
    sampler = cfg["sampler"]
    names = [c["name"] for c in _candidates(sampler)] if _is_search_space(sampler) else [sampler["name"]]
    if any(n != "none" for n in names):
        raise ConfigError("sampler.name: DQN acts epsilon-greedy on its Q-values; truncation samplers and their "
                          "masking (current or learned) apply to ppo and a3c only")
    rw, dqn = cfg["reward"], cfg["dqn"]
    if rw["kl_adaptive"]:
        raise ConfigError("reward.kl_adaptive: DQN's per-token reference term has a fixed coefficient")
    if dqn["replay"] == "sequences" and dqn["prioritized"]:
        raise ConfigError("dqn.prioritized: prioritized replay draws single steps; set dqn.replay: steps with it")
    if dqn["n_step_max"] is not None and _plain(dqn["n_step_max"]) < _plain(dqn["n_step"]):
        raise ConfigError(f"dqn.n_step_max: {_plain(dqn['n_step_max'])} is smaller than dqn.n_step={_plain(dqn['n_step'])}")
    if _plain(rw["kl_coef"]) > 0 and (max(_candidates(dqn["n_step"])) > 1 or dqn["n_step_max"] not in (None, 1)):
        raise ConfigError("reward.kl_coef: DQN's per-token reference term needs dqn.n_step: 1 (n-step returns "
                          "are summed in the replay buffer, before the learner adds the term)")


GUIDED_ALGORITHMS = ("ppo_pp", "aggrevated", "lols", "dlols")
SEQUENCE_PG_ALGORITHMS = ("reinforce", "self_critical")


def algorithm_family(cfg: dict) -> str:
    """'guided' for the guided algorithms (and any search over algorithms, which may only mix ppo
    with them: they are one RLlib algorithm), 'reinforce' for sequence-level policy gradient, else the name."""
    algo = cfg["algorithm"]
    if _is_search_space(algo) or algo in GUIDED_ALGORITHMS:
        return "guided"
    return "reinforce" if algo in SEQUENCE_PG_ALGORITHMS else algo


def dlols_switch_iteration(cfg: dict) -> int | None:
    g = cfg["guide"]
    if g["switch_iteration"] is not None:
        return g["switch_iteration"]
    total = cfg["stop"]["training_iteration"]
    return None if total is None else int(round(_plain(g["switch_fraction"]) * total))


def _check_guided_fields(raw: dict, cfg: dict) -> None:
    """Guide and REINFORCE options: only with the algorithms that read them, and complete."""
    algos = _candidates(cfg["algorithm"])
    if _is_search_space(cfg["algorithm"]):
        if next(iter(cfg["algorithm"])) not in ("grid_search", "choice"):
            raise ConfigError("algorithm: search over algorithm names with grid_search or choice")
        if any(a not in GUIDED_ALGORITHMS + ("ppo",) for a in algos):
            raise ConfigError(f"algorithm: a search over algorithms may list ppo and the guided ones "
                              f"({', '.join(GUIDED_ALGORITHMS)}) only, got {algos}; run others as separate experiments")
    guided = any(a in GUIDED_ALGORITHMS for a in algos)
    if raw.get("guide") is not None and not guided:
        raise ConfigError(f"guide: only used by the guided algorithms ({', '.join(GUIDED_ALGORITHMS)}); this "
                          f"config's algorithm is {cfg['algorithm']!r}")
    if raw.get("reinforce") is not None and not any(a in SEQUENCE_PG_ALGORITHMS for a in algos):
        raise ConfigError(f"reinforce: only used by algorithm reinforce or self_critical (this config's algorithm "
                          f"is {cfg['algorithm']!r})")
    if not guided:
        return
    g = cfg["guide"]
    if _is_search_space(g["name_or_path"]) or _is_search_space(g["callable"]):
        raise ConfigError("guide.name_or_path: the guide itself cannot be searched; sweep beta, mix, lols_prob or "
                          "switch_fraction")
    if bool(g["name_or_path"]) == bool(g["callable"]):
        raise ConfigError("guide: give exactly one of guide.name_or_path (a causal LM with the policy's vocabulary) "
                          "and guide.callable ('module:function')")
    spec = g["callable"]
    if spec and (spec.count(":") != 1 or not all(spec.split(":"))):
        raise ConfigError(f"guide.callable: expected 'module:function', got {spec!r}")
    if "dlols" in algos and dlols_switch_iteration(cfg) is None:
        raise ConfigError("guide.switch_fraction: DLOLS takes it of stop.training_iteration, which is not set; "
                          "set stop.training_iteration or guide.switch_iteration")


def _check_cross_fields(cfg: dict):
    t = cfg["training"]
    if cfg["algorithm"] != "dqn" and _plain(t["minibatch_size"]) > _plain(t["train_batch_size"]):
        raise ConfigError(
            f"training.minibatch_size: {_plain(t['minibatch_size'])} is larger than "
            f"training.train_batch_size={_plain(t['train_batch_size'])}"
        )
    if (t["lr_end"] is None) != (t["lr_decay_steps"] is None):
        given, missing = ("lr_end", "lr_decay_steps") if t["lr_end"] is not None else ("lr_decay_steps", "lr_end")
        raise ConfigError(f"training.{given}: needs training.{missing} too (lr falls linearly from training.lr to "
                          f"training.lr_end over training.lr_decay_steps env steps)")
    if cfg["reward"]["kl_adaptive"] and _plain(cfg["reward"]["kl_coef"]) == 0.0:
        raise ConfigError("reward.kl_adaptive: needs reward.kl_coef > 0 to adapt from")
    if max(_candidates(t["mle_coef"])) > 0:
        task = cfg["task"]
        if task.get("name") == "increasing_numbers" or (task.get("name") == "text" and not task.get("reference_field")):
            raise ConfigError(f"training.mle_coef: task {task.get('name')!r} has no reference texts to learn from "
                              f"(imdb, commongen, dialogue, summarization, or text with reference_field have them)")
    if cfg["algorithm"] == "dqn" and cfg["env_runners"]["runner"] == "fast":
        raise ConfigError("env_runners.runner: 'fast' samples whole episodes; DQN samples n-step fragments "
                          "(batch_mode truncate_episodes) for its replay buffer: use 'stock' or 'auto'")
    stop = cfg["stop"]
    if all(v is None for v in stop.values()):
        raise ConfigError("stop: give at least one of " + ", ".join(stop))


def parse_override(text: str) -> tuple[list[str], object]:
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key=value, e.g. training.lr=3e-4")
    key, value = text.split("=", 1)
    if not key:
        raise ConfigError(f"--set {text!r}: empty key")
    try:
        parsed = yaml.safe_load(value) if value else None
    except yaml.YAMLError:
        parsed = value
    return key.split("."), parsed


def load(path: str, overrides: list[str] = ()) -> dict:
    """Reads a YAML file, applies `--set a.b=value` overrides, validates."""
    return validate(read_yaml(path, overrides))


def read_yaml(path: str, overrides=()) -> dict:
    """A YAML config file as a dict, with `--set a.b=value` overrides applied (not validated)."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} not valid YAML ({getattr(e, 'problem', e)})") from None
    raw = raw or {}
    for text in overrides:
        keys, value = parse_override(text)
        node = raw
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {text!r}: {k} is not a section")
        node[keys[-1]] = value
    return raw


# -- to Tune / RLlib ------------------------------------------------------------------

def to_tune(value):
    """Replaces YAML search spaces (anywhere in a nested structure) with Tune objects."""
    from ray import tune

    if _is_search_space(value):
        (kind, args), = value.items()
        if kind == "grid_search":
            return tune.grid_search(args)
        if kind == "choice":
            return tune.choice(args)
        return getattr(tune, kind)(*args)
    if isinstance(value, dict):
        return {k: to_tune(v) for k, v in value.items()}
    return value


SEQ2SEQ_ALGORITHMS = ("ppo", "a3c")  # algorithms whose modules have an encoder-decoder version


def _check_model_kind(cfg: dict, kind: str | None) -> str | None:
    """Refuses what encoder-decoder policies do not support yet, in one line; returns the kind
    (None when it cannot be known without loading the model's config)."""
    from agents.models import declared_kind

    if kind is None:
        try:
            kind = declared_kind(cfg["model"])
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if kind != "seq2seq":
        return kind
    algo = cfg["algorithm"]
    if algo not in SEQ2SEQ_ALGORITHMS:
        raise ConfigError(f"model.kind: seq2seq policies are not supported by algorithm {algo!r} yet (supported: "
                          f"{', '.join(SEQ2SEQ_ALGORITHMS)}; its module wraps causal LMs only)")
    if max(_candidates(cfg["training"]["mle_coef"])) > 0:
        raise ConfigError("training.mle_coef: the supervised term is implemented for causal LMs only; "
                          "warm-start a seq2seq policy with agents.pretrain instead")
    return kind


def env_config(cfg: dict) -> dict:
    from agents.models import model_kind

    try:
        kind = model_kind(cfg["model"])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_model_kind(cfg, kind)
    return {
        "task": cfg["task"],
        "tokenizer": cfg["env"]["tokenizer"] or (
            None if cfg["model"]["name_or_path"] in _builtin_names() else cfg["model"]["name_or_path"]
        ),
        "max_prompt_len": cfg["env"]["max_prompt_len"],
        "max_new_tokens": cfg["env"]["max_new_tokens"],
        "truncation_side": cfg["env"]["truncation_side"],
        "dense_reward": cfg["env"]["dense_reward"],
        "encoder_decoder": kind == "seq2seq",
    }


def _builtin_names():
    from agents.models import BUILTIN_CONFIGS, SEQ2SEQ_CONFIGS
    return {**BUILTIN_CONFIGS, **SEQ2SEQ_CONFIGS}


def _same_seed(spec) -> int:
    return spec.config["seed"]


def learner_cpus(cfg: dict):
    """RLlib's num_cpus_per_learner. RLlib reserves max(this, the main process's CPUs) for a
    trial whose learner runs in its own process (num_learners 0), so there the trial's share
    (tune.num_cpus_per_trial) must be this too, or fractional trials would take a whole CPU."""
    lr = cfg["learners"]
    if lr["num_cpus_per_learner"] is not None:
        return lr["num_cpus_per_learner"]
    if lr["num_learners"] == 0 and cfg["tune"]["num_cpus_per_trial"] is not None:
        return cfg["tune"]["num_cpus_per_trial"]
    return "auto"


def _config_class(family: str):
    from agents.algorithms.a3c import A3CConfig
    from agents.algorithms.dqn import LMDQNConfig
    from agents.algorithms.ppo import LMPPOConfig

    if family == "guided":
        from agents.algorithms.guided import GuidedPPOConfig
        return GuidedPPOConfig
    if family == "reinforce":
        from agents.algorithms.reinforce import ReinforceConfig
        return ReinforceConfig
    return {"ppo": LMPPOConfig, "a3c": A3CConfig, "dqn": LMDQNConfig}[family]


def env_runner_kind(cfg: dict) -> str:
    """'fast' or 'stock' (agents/env_runner.py): `env_runners.runner`, where auto is fast except for DQN."""
    kind = cfg["env_runners"]["runner"]
    if kind == "auto":
        return "stock" if cfg["algorithm"] == "dqn" else "fast"
    return kind


def algorithm_config(cfg: dict):
    """The RLlib AlgorithmConfig for a validated config (search spaces as Tune objects)."""
    from ray import tune
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec

    from agents.env_runner import TOKEN_ENV, FastTokenEnvRunner, StockTokenEnvRunner, make_token_env
    from agents.modules import CausalLMActorCritic
    from agents.modules.q_network import CausalLMQNetwork as QNetwork
    from agents.modules.seq2seq import Seq2SeqActorCritic

    if os.path.isdir(cfg["model"]["name_or_path"]):  # trials run in their own directory: a local model goes absolute
        cfg = {**cfg, "model": {**cfg["model"], "name_or_path": os.path.abspath(cfg["model"]["name_or_path"])}}
    c = to_tune(cfg)
    t, er, lr, rw = c["training"], c["env_runners"], c["learners"], c["reward"]
    env_cfg = to_tune(env_config(cfg))
    use_ref = _plain(cfg["reward"]["kl_coef"]) > 0
    # The module's config goes in the AlgorithmConfig's own model_config (not inside the
    # RLModuleSpec object), so that Tune resolves search spaces in it (the sampler section).
    # A searched seed is drawn once (the algorithm's) and the module's init seed follows it.
    module_seed = tune.sample_from(_same_seed) if _is_search_space(cfg["seed"]) else c["seed"]
    model_config = {"model": c["model"], "env": env_cfg, "seed": module_seed, "reference_model": use_ref,
                    "sampler": c["sampler"]}
    algo = cfg["algorithm"]
    dqn = c["dqn"]
    if algo == "dqn":
        model_config["dqn"] = {k: dqn[k] for k in ("head", "mlp_hidden", "sample_temperature")}
    family = algorithm_family(cfg)
    env_runner_env_cfg = env_cfg
    if family == "guided":  # the guide acts on the EnvRunners; GuidedPPO sets each iteration's roll-in mode
        model_config["guide"] = {**{k: c["guide"][k] for k in ("name_or_path", "callable", "greedy", "beta", "mix")},
                                 "mode": "none"}
        path = cfg["guide"]["name_or_path"]
        if path and os.path.isdir(path):  # a Tune trial does not run in this directory
            model_config["guide"]["name_or_path"] = os.path.abspath(path)
    elif family == "reinforce":  # each prompt num_samples times in a row, for the per-prompt baseline
        env_runner_env_cfg = {**env_cfg, "repeat_prompt": c["reinforce"]["num_samples"] if algo == "reinforce" else 1}
    from ray.tune.registry import register_env

    register_env(TOKEN_ENV, make_token_env)  # RLlib builds one row, or the vector env through its entry point
    fast = env_runner_kind(cfg) == "fast"
    if fast:  # the vector env, built through RLlib's vector entry point; the runner resets its rows
        env_runner_env_cfg = {**env_runner_env_cfg, "autoreset_mode": "Disabled"}
    config = (
        _config_class(family)()
        .environment(TOKEN_ENV, env_config=env_runner_env_cfg)
        .env_runners(
            num_env_runners=er["num_env_runners"],
            num_envs_per_env_runner=er["num_envs_per_env_runner"],
            num_cpus_per_env_runner=er["num_cpus_per_env_runner"],
            num_gpus_per_env_runner=er["num_gpus_per_env_runner"],
            # Actor-critic losses take whole generations (exact per-sequence KL, one forward per
            # sequence); DQN stores steps in its replay buffer and samples n_step steps per env per call.
            batch_mode="truncate_episodes" if algo == "dqn" else "complete_episodes",
            env_runner_cls=FastTokenEnvRunner if fast else StockTokenEnvRunner,
            gym_env_vectorize_mode="vector_entry_point" if fast else "sync",
        )
        .fault_tolerance(
            restart_failed_env_runners=True, max_num_env_runner_restarts=er["max_restarts"]
        )
        .learners(
            num_learners=lr["num_learners"],
            num_cpus_per_learner=learner_cpus(cfg),
            num_gpus_per_learner=lr["num_gpus_per_learner"],
            learner_config_dict={"kl": {
                "coef": rw["kl_coef"], "adaptive": rw["kl_adaptive"],
                "target": rw["kl_target"], "horizon": rw["kl_horizon"],
            }, **({"mle": {"coef": t["mle_coef"], "batch_size": t["mle_batch_size"], "env": env_cfg}}
                  if algo != "dqn" else {})},
        )
        .rl_module(rl_module_spec=RLModuleSpec(module_class=QNetwork if algo == "dqn" else
                                               Seq2SeqActorCritic if env_cfg["encoder_decoder"] else CausalLMActorCritic),
                   model_config=model_config)
        .debugging(seed=c["seed"])
    )
    if family == "guided":
        from agents.algorithms.guided import log_policy_return

        config.callbacks(on_episode_end=log_policy_return)
        config.learner_config_dict["guided"] = {
            "algorithm": c["algorithm"], "switch_iteration": dlols_switch_iteration(cfg),
            "lols_prob": c["guide"]["lols_prob"], "seed": module_seed}
    elif family == "reinforce":
        config.learner_config_dict["reinforce"] = {"baseline": "greedy" if algo == "self_critical" else "mean",
                                                   "num_samples": c["reinforce"]["num_samples"]}
    # RLlib's lr schedule: [[env steps, lr], ...], linear in between, the last value after.
    lr = t["lr"] if t["lr_decay_steps"] is None else [[0, t["lr"]], [t["lr_decay_steps"], t["lr_end"]]]
    common = dict(lr=lr, train_batch_size=t["train_batch_size"], gamma=t["gamma"], grad_clip=t["grad_clip"])
    if algo == "dqn":
        eps = [[0, dqn["epsilon_start"]], [dqn["epsilon_steps"], dqn["epsilon_end"]]]
        config.training(
            **common,
            double_q=dqn["double_q"],
            dueling=dqn["dueling"],
            n_step=dqn["n_step"] if dqn["n_step_max"] is None else (dqn["n_step"], dqn["n_step_max"] + 1),
            target_network_update_freq=dqn["target_update_every"],
            tau=dqn["tau"],
            epsilon=eps,
            num_steps_sampled_before_learning_starts=dqn["learning_starts"],
            training_intensity=dqn["training_intensity"],
            td_error_loss_fn=dqn["td_loss"],
            replay_buffer_config={
                "type": "WholeEpisodeReplayBuffer" if cfg["dqn"]["replay"] == "sequences" else
                "PrioritizedEpisodeReplayBuffer" if cfg["dqn"]["prioritized"] else "EpisodeReplayBuffer",
                "capacity": dqn["replay_capacity"],
                **({"alpha": dqn["alpha"], "beta": dqn["beta"]} if cfg["dqn"]["prioritized"] else {}),
            },
        )
        config.reporting(min_sample_timesteps_per_iteration=dqn["steps_per_iteration"])
    else:
        config.training(
            **common,
            minibatch_size=t["minibatch_size"],
            num_epochs=t["num_epochs"],
            lambda_=t["lambda"],
            clip_param=t["clip_param"],
            vf_loss_coeff=t["vf_loss_coeff"],
            vf_clip_param=t["vf_clip_param"],
            entropy_coeff=t["entropy_coeff"],
            use_kl_loss=False,
        )
    ev = cfg["evaluation"]
    if ev["interval"]:
        config.evaluation(
            evaluation_interval=ev["interval"],
            evaluation_duration=ev["episodes"],
            evaluation_duration_unit="episodes",
            evaluation_num_env_runners=0,
            evaluation_config={"explore": False},
        )
    if cfg["tune"]["num_cpus_per_trial"] is not None:  # fractional CPUs let several trials share a core
        config.resources(num_cpus_for_main_process=cfg["tune"]["num_cpus_per_trial"])
    return config
