"""The experiment config's schema and its checks: a YAML mapping in, the validated config out.

`validate` fills in defaults and fails with one line naming the field (`ConfigError`), before
Ray starts. The generic sections are declared here (`GENERIC_SCHEMA`); each algorithm's module
declares its own section and checks (agents/algorithms/), and the scheduler keys are checked in
agents/pbt.py. Any leaf of a searchable section may be a Tune search space written in YAML:
`{grid_search: [..]}`, `{choice: [..]}`, `{uniform: [lo, hi]}`, `{loguniform: [lo, hi]}`,
`{randint: [lo, hi]}`; each candidate is validated like a plain value. `check_section` is the
one section checker: agents/pretrain.py checks its warm-start configs with it too.
"""
from __future__ import annotations

import copy

from agents.algorithms.base import COMMON_TRAINING, REFERENCE_KL, candidates as _candidates, plain as _plain
from agents.pbt import check_scheduler
from agents.saved_policy import MAX_SEED
from env.tasks import check_task
from env.text_env import DEFAULTS as ENV_DEFAULTS
from env.validation import NONNEG_INT, POS_INT, ConfigError, Field, is_search_space as _is_search_space, unknown_key

F = Field
PRECISIONS = ["fp32", "bf16", "fp16"]

# The generic sections. `algorithm` takes the names of agents/algorithms/ (each algorithm's
# module declares its own section, e.g. `dqn`, `guide`, `reinforce`); `schema()` adds them.
GENERIC_SCHEMA: dict[str, dict[str, Field] | Field] = {
    "algorithm": F(str, "ppo"),
    "seed": F(int, 0, lo=0, hi=MAX_SEED),
    "task": {  # extra keys are passed to the task, checked against its constructor (env.tasks.check_task)
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
        # LoRA adapters (PEFT): {r, alpha, dropout, target_modules}; only they and the value head
        # train, and the KL reference is the base model (adapters off), so no copy is kept.
        "lora": F(dict, None, optional=True),
    },
    "env": {
        "max_prompt_len": F(int, ENV_DEFAULTS["max_prompt_len"], **POS_INT),
        "max_new_tokens": F(int, ENV_DEFAULTS["max_new_tokens"], **POS_INT),
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
    # the reference-KL term: agents/algorithms/base.py REFERENCE_KL
    "reward": {key: param.field for key, param in REFERENCE_KL.items()},
    # COMMON_TRAINING, which every algorithm reads; schema() adds each algorithm's `training_params`
    # (agents/algorithms/), and a key the chosen algorithm does not read is refused.
    "training": {
        "lr": F(float, 1e-4, lo=0.0, lo_open=True),
        # Linear annealing (A3C anneals to 0): lr falls from `lr` to `lr_end` over `lr_decay_steps`
        # sampled env steps, then stays there; both null: constant lr.
        "lr_end": F(float, None, lo=0.0, optional=True),
        "lr_decay_steps": F(int, None, **POS_INT, optional=True),
        "train_batch_size": F(int, 1024, **POS_INT),
        "gamma": F(float, 1.0, lo=0.0, hi=1.0),
        "grad_clip": F(float, 1.0, lo=0.0, lo_open=True, optional=True),
        # The learner's passes under autocast (fp16 with a loss scaler); weights and optimizer
        # state stay float32 (LoRA: the frozen base is stored in this precision). Log-probs, the
        # PPO ratio and the KL are computed from float32 logits. auto: bf16 where the learner is on
        # a GPU that has it (TF32 matmuls on), else fp32 (the CPU's passes as in fp32).
        "precision": F(str, "auto", choices=["auto"] + PRECISIONS),
        "gradient_checkpointing": F(bool, False),  # recompute activations in the backward pass
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
        "custom_resources": F(dict, {}),  # per EnvRunner, e.g. {rollout_node: 1}: pins them to nodes that have it
        # fast: whole episodes from the vector env, one module call per decode block
        # (agents/env_runner.py); stock: RLlib's SingleAgentEnvRunner. auto: fast where the
        # algorithm samples whole episodes, else stock.
        "runner": F(str, "auto", choices=("auto", "fast", "stock")),
        # the rollout copy of the LM is stored in it; auto: bf16 where the rollouts run on a GPU
        # that has it, else fp32 (CausalLMActorCritic.settle_rollout_precision)
        "precision": F(str, "auto", choices=["auto"] + PRECISIONS),
        # fast runner: true carries episodes still running at the end of a training call over to
        # the next (no call waits for its slowest rows; their early steps were sampled by the weights
        # before the update); false finishes them in the call, so every batch is sampled by one set
        # of weights, as the stock runner's complete episodes always are (the stock runner ignores it)
        "carry_episodes": F(bool, True),
        # fast runner: module steps per env round trip (exploring or greedy). Above 1, the module runs
        # that many steps on its device, each row appending the token it took (the env's transition),
        # then the env steps through them: fewer host round trips (on a GPU, one device sync per block),
        # at the cost of rows that finish mid-block waiting for the block's end before they restart (a
        # training call, too, ends at a block's end: up to k-1 steps a row past its share). Unset: 4
        # (agents/env_runner.py DEFAULT_DECODE_BLOCK)
        "decode_block": F(int, None, optional=True, **POS_INT),
        # fast runner: its decode engine's step through torch.compile (inductor) before capture:
        # fused kernels, after a compile of tens of seconds at the first step; an experiment
        "compile_step": F(bool, False),
        # rollouts in the learner's process and on its device, each weight sync one in-place device
        # copy (agents/weight_sync.py): unset, wherever it applies (num_env_runners 0 and
        # learners.num_learners 0); true to require it; false for RLlib's sync through the host
        "colocated": F(bool, None, optional=True),
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
        # fifo: every trial runs to its stop criteria; asha: early stopping; pbt: Population Based Training.
        "scheduler": F(str, "fifo", choices=["fifo", "asha", "pbt"]),
        "grace_period": F(int, 10, **POS_INT),  # asha
        "reduction_factor": F(float, 3.0, lo=1.0, lo_open=True),  # asha
        # pbt (PBT_KEYS): every `perturbation_interval` training iterations a trial in the bottom
        # `quantile_fraction` of the population takes the weights of one in the top fraction and
        # that trial's hyperparameters, perturbed (`hyperparam_mutations`: a key path such as
        # training.lr -> a search space or a list of values; see pbt_mutations).
        "perturbation_interval": F(int, 10, **POS_INT),
        "hyperparam_mutations": F(dict, {}),
        "quantile_fraction": F(float, 0.25, lo=0.0, hi=0.5, lo_open=True),
        "resample_probability": F(float, 0.25, lo=0.0, hi=1.0),
        "wandb": F(bool, False),
        "dashboard": F(bool, True),
        "wandb_project": F(str, "rl-token-lm"),
    },
    "generate": {
        "num_samples": F(int, 3, **NONNEG_INT),
    },
}
OPEN_SECTIONS = {"task"}  # sections that accept keys beyond the schema
_SCHEMA: dict = {}


def schema() -> dict:
    """The whole schema: the generic sections and every registered algorithm's own section."""
    if not _SCHEMA:
        from agents.algorithms import specs

        sections, training = {}, dict(GENERIC_SCHEMA["training"])
        for spec in dict.fromkeys(specs().values()):
            if spec.section:
                sections[spec.section] = spec.schema
            for key, param in spec.training_params.items():
                if training.setdefault(key, param.field) is not param.field:
                    raise RuntimeError(f"training.{key}: declared twice ({type(spec).__name__} and another; "
                                       f"a spec picks another's Param instead)")
        _SCHEMA.update(GENERIC_SCHEMA)
        _SCHEMA["training"] = training
        _SCHEMA["algorithm"] = F(str, "ppo", choices=list(specs()))
        for name, section in sections.items():
            _SCHEMA[name] = section
    return _SCHEMA


# Sections whose leaves may be Tune search spaces (others feed values that must agree across
# processes), besides the algorithms' own sections that declare `section_searchable`.
GENERIC_SEARCHABLE = ("training", "reward", "sampler", "seed", "algorithm")


def searchable_sections() -> tuple:
    from agents.algorithms import specs

    return GENERIC_SEARCHABLE + tuple(dict.fromkeys(s.section for s in specs().values()
                                                    if s.section and s.section_searchable))
WHOLE_SECTION_SEARCH = ("sampler",)  # sections that may be one search space over whole mappings
# The parameters each sampler needs (and the only ones it accepts), with their ranges where they
# are narrower than the schema's.
SAMPLER_PARAMS = {
    "none": (), "top_k": ("k",), "top_p": ("p",), "typical": ("p",), "epsilon": ("epsilon",),
    "eta": ("eta",), "mirostat": ("tau", "learning_rate"),
}
SAMPLER_ONLY = ("k", "p", "epsilon", "eta", "tau")


def _check_value(path: str, field: Field, value):
    if _is_search_space(value):
        if path.split(".")[0] not in searchable_sections():
            raise ConfigError(f"{path}: search spaces are supported in the {' and '.join(searchable_sections())} "
                              f"sections only")
        return _check_search_space(path, field, value)
    return field.check(path, value)


def _check_search_space(path: str, field: Field, value: dict) -> dict:
    """A YAML search space with its arguments checked, each candidate like a plain value."""
    (kind, args), = value.items()
    if not isinstance(args, list) or not args:
        raise ConfigError(f"{path}.{kind}: expected a non-empty list")
    if kind in ("uniform", "loguniform", "randint"):
        numbers = all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args)
        if len(args) != 2 or not numbers or not args[0] < args[1]:
            raise ConfigError(f"{path}.{kind}: expected [low, high]: two numbers, low < high; got {args!r}")
        if kind == "loguniform" and args[0] <= 0:
            raise ConfigError(f"{path}.loguniform: bounds must be > 0, got {args!r}")
    return {kind: [field.check(path, v) for v in args]}


def validate(raw: dict) -> dict:
    """Returns the config with defaults filled in, or raises ConfigError."""
    full = schema()
    check_sections_known(raw, full)
    out = {}
    for key, spec in full.items():
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
    spec = algorithm_spec(out)
    check_model_kind(out, None)  # first: an unsupported policy kind makes the other checks moot
    _check_algorithm_fields(raw, out, spec)
    spec.check(raw, out)
    _check_cross_fields(out, spec)
    check_task(out["task"])  # its keys against the task's constructor, without building it
    _check_scale(raw, out, spec)
    check_scheduler(raw, out, spec, full=schema(), check_space=_check_search_space, population=population)
    return out


def algorithm_spec(cfg: dict):
    """The `AlgorithmSpec` serving the config's algorithm (a search over algorithm names must stay
    within one spec and the names it may be searched with)."""
    from agents.algorithms import specs

    algo, known = cfg["algorithm"], specs()
    if not _is_search_space(algo):
        return known[algo]
    if next(iter(algo)) not in ("grid_search", "choice"):
        raise ConfigError("algorithm: search over algorithm names with grid_search or choice")
    names = _candidates(algo)
    for spec in dict.fromkeys(known[a] for a in names):  # only a spec with search_with reads a searched name
        if spec.search_with and all(a in spec.names + spec.search_with for a in names):
            return spec
    groups = sorted({", ".join(s.search_with + s.names) for s in known.values() if s.search_with})
    raise ConfigError(f"algorithm: a search over algorithms may list the algorithms of one family only "
                      f"({'; '.join(groups)}), got {names}; run others as separate experiments")


def check_sections_known(raw, full: dict) -> None:
    """Refuses, in one line, a config that is not a mapping or that names a section `full` lacks."""
    if not isinstance(raw, dict):
        raise ConfigError("config: the YAML file must hold a mapping at the top level")
    for key in raw:
        if key not in full:
            raise unknown_key("", key, full)


def _field_check(path: str, field: Field, value):
    return field.check(path, value)


def check_section(path: str, fields: dict, value, *, check_value=_field_check, extra: dict | None = None,
                  open_keys: bool = False) -> dict:
    """One section of a config (a mapping, or None for all defaults): each key of `fields` checked
    with `check_value(path, field, value)` (by default the field's own check) or given its default;
    a key not in `fields` is refused in one line naming it, unless it is one of `extra` (keys taken
    as given, their defaults filled in) or the section is open (`open_keys`: kept as given)."""
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a mapping, got {value!r}")
    extra = extra or {}
    for sub in value:
        if sub not in fields and sub not in extra and not open_keys:
            raise unknown_key(path, sub, {**fields, **extra})
    section = {}
    for sub, field in fields.items():
        v = value.get(sub, copy.deepcopy(field.default))
        section[sub] = check_value(f"{path}.{sub}", field, v) if sub in value else v
    section.update({sub: value.get(sub, default) for sub, default in extra.items()})
    for sub in value:
        if sub not in section:
            section[sub] = value[sub]
    return section


def _check_section(path: str, key: str, spec: dict, value) -> dict:
    section = check_section(path, spec, value, check_value=_check_value, open_keys=key in OPEN_SECTIONS)
    if key == "sampler":
        _check_sampler(path, section)
    return section
def _check_sampler(path: str, s: dict) -> None:
    from agents.samplers import sampler_value_error

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
    for param in needs:
        for v in _candidates(s[param]):
            error = sampler_value_error(name, param, v)
            if error:
                raise ConfigError(f"{path}.{error}")


def _or(names) -> str:
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _check_algorithm_fields(raw: dict, cfg: dict, spec) -> None:
    """Refuses options the chosen algorithm does not read, naming the option."""
    from agents.algorithms import specs

    algo = cfg["algorithm"]
    for other in dict.fromkeys(specs().values()):
        if other.section and other is not spec and raw.get(other.section) is not None:
            raise ConfigError(f"{other.section}: only used by algorithm {_or(other.names)} (this config's "
                              f"algorithm is {algo!r})")
    reads = COMMON_TRAINING + spec.training_keys
    for key in raw.get("training") or {}:
        if key in schema()["training"] and key not in reads:
            raise ConfigError(f"training.{key}: not used by algorithm {algo!r} (it reads "
                              f"{', '.join(k for k in schema()['training'] if k in reads)}); remove it")
    sampler = cfg["sampler"]
    names = [c["name"] for c in _candidates(sampler)] if _is_search_space(sampler) else [sampler["name"]]
    if spec.sampler_refusal and any(n != "none" for n in names):
        raise ConfigError(f"sampler.name: {spec.sampler_refusal}")
    if not spec.kl_adaptive and cfg["reward"]["kl_adaptive"]:
        raise ConfigError(f"reward.kl_adaptive: {algo!r}'s per-token reference term has a fixed coefficient")


def env_runner_kind(cfg: dict) -> str:
    """'fast' or 'stock' (agents/env_runner.py): `env_runners.runner`, where auto is fast for the
    algorithms that sample whole episodes."""
    kind = cfg["env_runners"]["runner"]
    if kind == "auto":
        return "fast" if algorithm_spec(cfg).whole_episodes else "stock"
    return kind


def _check_cross_fields(cfg: dict, spec):
    t = cfg["training"]
    if (t["lr_end"] is None) != (t["lr_decay_steps"] is None):
        given, missing = ("lr_end", "lr_decay_steps") if t["lr_end"] is not None else ("lr_decay_steps", "lr_end")
        raise ConfigError(f"training.{given}: needs training.{missing} too (lr falls linearly from training.lr to "
                          f"training.lr_end over training.lr_decay_steps env steps)")
    if cfg["reward"]["kl_adaptive"] and _plain(cfg["reward"]["kl_coef"]) == 0.0:
        raise ConfigError("reward.kl_adaptive: needs reward.kl_coef > 0 to adapt from")
    if "mle_coef" in spec.training_keys and max(_candidates(t["mle_coef"])) > 0:
        task = cfg["task"]
        if task.get("name") == "increasing_numbers" or (task.get("name") == "text" and not task.get("reference_field")):
            raise ConfigError(f"training.mle_coef: task {task.get('name')!r} has no reference texts to learn from "
                              f"(imdb, commongen, dialogue, summarization, or text with reference_field have them)")
    if not spec.whole_episodes and cfg["env_runners"]["runner"] == "fast":
        raise ConfigError(f"env_runners.runner: 'fast' samples whole episodes; {cfg['algorithm']!r} samples n-step "
                          "fragments (batch_mode truncate_episodes) for its replay buffer: use 'stock' or 'auto'")
    er = cfg["env_runners"]
    if (er["decode_block"] or 1) > 1 and env_runner_kind(cfg) == "stock":
        raise ConfigError(f"env_runners.decode_block: only the fast runner steps in blocks (this config's runner is "
                          f"{'stock' if er['runner'] == 'stock' else 'auto, stock for ' + repr(cfg['algorithm'])}); "
                          "leave it at 1")
    if er["colocated"]:
        from agents.weight_sync import colocation_refusal

        why = colocation_refusal(_plain(er["num_env_runners"]), _plain(cfg["learners"]["num_learners"]))
        if why:
            raise ConfigError(f"env_runners.colocated: true needs rollouts in the learner's process, but {why}")
    stop = cfg["stop"]
    if all(v is None for v in stop.values()):
        raise ConfigError("stop: give at least one of " + ", ".join(stop))


def _check_scale(raw: dict, cfg: dict, spec) -> None:
    """LoRA, precision and gradient checkpointing: the `model.lora` section's keys, and a one-line
    refusal for an algorithm they do not apply to."""
    if _is_search_space(cfg["training"]["precision"]):
        raise ConfigError("training.precision: not searchable (it sets the learner's loss scaling); run one "
                          "experiment per precision")
    from agents.models import LORA_FIELDS

    lora = cfg["model"]["lora"]
    if lora is not None:
        checked = {}
        for key in lora:
            if key not in LORA_FIELDS:
                raise unknown_key("model.lora", key, LORA_FIELDS)
        for key, field in LORA_FIELDS.items():
            checked[key] = field.check(f"model.lora.{key}", lora[key]) if key in lora else field.default
        for key in ("target_modules", "modules_to_save"):
            names = checked[key]
            if names is not None and (not names or not all(isinstance(t, str) and t for t in names)):
                raise ConfigError(f"model.lora.{key}: expected a non-empty list of module names, got {names!r}")
        cfg["model"]["lora"] = checked
    if spec.scale_refusal is None:
        return
    given = (["model.lora"] if lora is not None else []) + [
        f"{section}.{k}" for section, keys in (("training", ("precision", "gradient_checkpointing")),
                                               ("env_runners", ("precision",)))
        for k in keys if k in (raw.get(section) or {})]
    if given:
        raise ConfigError(f"{given[0]}: not supported by algorithm {cfg['algorithm']!r}: {spec.scale_refusal}")


def population(cfg: dict) -> int:
    """How many trials the experiment runs: tune.num_samples times the grid searches' product."""
    return cfg["tune"]["num_samples"] * _grid_size({k: cfg[k] for k in searchable_sections()})


def _grid_size(value) -> int:
    """How many trials the grid searches in `value` make (their cross product)."""
    if _is_search_space(value):
        kind, args = next(iter(value.items()))
        return len(args) if kind == "grid_search" else 1
    if isinstance(value, dict):
        n = 1
        for v in value.values():
            n *= _grid_size(v)
        return n
    return 1


def check_model_kind(cfg: dict, kind: str | None) -> str | None:
    """Refuses what encoder-decoder policies do not support yet, in one line; returns the kind
    (None when it cannot be known without loading the model's config)."""
    from agents.algorithms import specs
    from agents.models import check_overrides, declared_kind

    if kind is None:
        try:
            check_overrides(cfg["model"])
            kind = declared_kind(cfg["model"])
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if kind != "seq2seq":
        return kind
    algo = cfg["algorithm"]
    if not algorithm_spec(cfg).seq2seq:
        supported = ", ".join(a for a, s in specs().items() if s.seq2seq)
        raise ConfigError(f"model.kind: seq2seq policies are not supported by algorithm {algo!r} yet (supported: "
                          f"{supported}; its module wraps causal LMs only)")
    if max(_candidates(cfg["training"]["mle_coef"])) > 0:
        raise ConfigError("training.mle_coef: the supervised term is implemented for causal LMs only; "
                          "warm-start a seq2seq policy with agents.pretrain instead")
    return kind


