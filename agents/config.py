"""Experiment configs: YAML in, validated dict out, then RLlib/Tune objects.

`load` reads a YAML file (with `--set a.b=value` overrides) and validates it against the
schema (agents/schema.py: every field, its default and range, and the checks that fail in one
line naming the field, `ConfigError`); `algorithm_config` builds the RLlib AlgorithmConfig that
Tune runs (search spaces as Tune objects), with the algorithm's own part from its spec
(agents/algorithms/). The schema's and PBT's (agents/pbt.py) public names are importable from
here too.
"""
from __future__ import annotations

import os

import yaml

from agents.algorithms.base import plain as _plain
from agents.pbt import PBT_MUTABLE, pbt_mutations
from agents.schema import (SAMPLER_PARAMS, ConfigError, Field, algorithm_spec, check_model_kind, env_runner_kind,
                           population, schema, searchable_sections, validate)
from env.validation import is_search_space as _is_search_space

__all__ = ["ConfigError", "Field", "PBT_MUTABLE", "SAMPLER_PARAMS", "algorithm_config", "algorithm_spec",
           "env_config", "env_runner_kind", "learner_cpus", "load", "parse_override", "pbt_mutations", "population",
           "read_yaml", "rollout_precision", "schema", "searchable_sections", "to_tune", "validate",
           "with_absolute_paths"]


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
    except IsADirectoryError:
        raise ConfigError(f"{path}: a directory, not a config file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); a config is a YAML file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} not valid YAML ({getattr(e, 'problem', e)})") from None
    if raw is None:  # an empty file would silently run every default: an experiment nobody wrote
        raise ConfigError(f"{path}: the file is empty (or only comments); write the experiment in it, "
                          f"e.g. starting from tune_configs/quickstart.yaml")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the YAML file must hold a mapping at the top level, "
                          f"not a {type(raw).__name__}")
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


def env_config(cfg: dict) -> dict:
    from agents.models import model_kind

    try:
        kind = model_kind(cfg["model"])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_model_kind(cfg, kind)
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


def _absolute_if_local(value):
    if isinstance(value, str) and os.path.exists(os.path.expanduser(value)):
        return os.path.abspath(os.path.expanduser(value))
    return value


# A built-in reward's local paths: model and tokenizer directories (MMI's forward and backward
# ones too) and BERTScore's baseline file.
REWARD_PATH_FIELDS = ("model", "tokenizer", "forward_model", "backward_model", "forward_tokenizer",
                      "backward_tokenizer", "baseline_path")


def _reward_with_absolute_paths(spec):
    """A reward spec (a term, or a sum of terms) with its local model directories and files absolute."""
    if isinstance(spec, dict) and isinstance(spec.get("sum"), list):
        return {**spec, "sum": [_reward_with_absolute_paths(term) for term in spec["sum"]]}
    if isinstance(spec, dict) and not _is_search_space(spec):
        return {k: _absolute_if_local(v) if k in REWARD_PATH_FIELDS else v for k, v in spec.items()}
    return spec


def with_absolute_paths(cfg: dict) -> dict:
    """The config with its local model directory, tokenizer, task data files and reward models as
    absolute paths: Tune trials run in their own directory, where a relative path finds nothing."""
    model = {**cfg["model"], "name_or_path": _absolute_if_local(cfg["model"]["name_or_path"])}
    task, data = dict(cfg["task"]), cfg["task"].get("dataset")
    if isinstance(data, dict) and not _is_search_space(data):
        task["dataset"] = {split: _absolute_if_local(path) for split, path in data.items()}
    elif data is not None:
        task["dataset"] = _absolute_if_local(data)
    if "reward" in task:
        task["reward"] = _reward_with_absolute_paths(task["reward"])
    env = {**cfg["env"], "tokenizer": _absolute_if_local(cfg["env"].get("tokenizer"))} if "env" in cfg else None
    return {**cfg, "model": model, "task": task, **({"env": env} if env is not None else {})}


def rollout_precision(cfg: dict) -> str:
    """`env_runners.precision` as the EnvRunners' modules get it: as configured, and fp32 for
    algorithms that refuse reduced precision (DQN). `auto` (the default) is settled by each
    rollout module once it is on its device (`CausalLMActorCritic.settle_rollout_precision`): bf16
    on a GPU that has it, fp32 elsewhere."""
    if cfg["env_runners"]["precision"] == "auto" and algorithm_spec(cfg).scale_refusal is not None:
        return "fp32"
    return cfg["env_runners"]["precision"]


def algorithm_config(cfg: dict):
    """The RLlib AlgorithmConfig for a validated config (search spaces as Tune objects): the
    generic sections here, the algorithm's own part from its spec (agents/algorithms/)."""
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec
    from ray.tune.registry import register_env

    from agents.algorithms.base import module_seed
    from agents.core import EPISODES_PER_RESULT
    from agents.saved_policy import BASE_FILES, base_record
    from agents.env_runner import CARRY_EPISODES, COMPILE_STEP, DECODE_BLOCK, TOKEN_ENV, FastTokenEnvRunner, StockTokenEnvRunner, make_token_env
    from agents.weight_sync import COLOCATED

    cfg = with_absolute_paths(cfg)
    spec = algorithm_spec(cfg)
    c = to_tune(cfg)
    t, er, lr = c["training"], c["env_runners"], c["learners"]
    env_cfg = to_tune(env_config(cfg))
    # The module's config goes in the AlgorithmConfig's own model_config (not inside the
    # RLModuleSpec object), so that Tune resolves search spaces in it (the sampler section).
    model_config = {"model": c["model"], "env": env_cfg, "seed": module_seed(cfg, c),
                    "reference_model": _plain(cfg["reward"]["kl_coef"]) > 0, "sampler": c["sampler"],
                    "train_precision": c["training"]["precision"], "rollout_precision": rollout_precision(cfg),
                    "gradient_checkpointing": c["training"]["gradient_checkpointing"],
                    # the local model and tokenizer directories a checkpoint is rebuilt with, as they are now
                    BASE_FILES: base_record(c["model"]["name_or_path"], env_cfg.get("tokenizer")),
                    **spec.module_config(cfg, c)}
    runner_env_cfg = spec.env_config(cfg, c, env_cfg)
    register_env(TOKEN_ENV, make_token_env)  # RLlib builds one row, or the vector env through its entry point
    fast = env_runner_kind(cfg) == "fast"
    if fast:  # the vector env, built through RLlib's vector entry point; the runner resets its rows
        runner_env_cfg = {**runner_env_cfg, "autoreset_mode": "Disabled", CARRY_EPISODES: er["carry_episodes"],
                          DECODE_BLOCK: er["decode_block"], COMPILE_STEP: er["compile_step"]}
    runner_env_cfg = {**runner_env_cfg, COLOCATED: er["colocated"]}
    config = (
        spec.config_class()()
        .environment(TOKEN_ENV, env_config=runner_env_cfg)
        .env_runners(
            num_env_runners=er["num_env_runners"],
            num_envs_per_env_runner=er["num_envs_per_env_runner"],
            num_cpus_per_env_runner=er["num_cpus_per_env_runner"],
            num_gpus_per_env_runner=er["num_gpus_per_env_runner"],
            custom_resources_per_env_runner=er["custom_resources"],
            # Whole generations (exact per-sequence KL, one forward per sequence), or n-step fragments
            # for a replay buffer.
            batch_mode="complete_episodes" if spec.whole_episodes else "truncate_episodes",
            env_runner_cls=FastTokenEnvRunner if fast else StockTokenEnvRunner,
            gym_env_vectorize_mode="vector_entry_point" if fast else "sync",
        )
        .fault_tolerance(restart_failed_env_runners=True, max_num_env_runner_restarts=er["max_restarts"])
        .learners(
            num_learners=lr["num_learners"],
            num_cpus_per_learner=learner_cpus(cfg),
            num_gpus_per_learner=lr["num_gpus_per_learner"],
        )
        .rl_module(rl_module_spec=RLModuleSpec(module_class=spec.module_class(env_cfg["encoder_decoder"])),
                   model_config=model_config)
        .debugging(seed=c["seed"])
        .reporting(metrics_num_episodes_for_smoothing=EPISODES_PER_RESULT)
    )
    # RLlib's lr schedule: [[env steps, lr], ...], linear in between, the last value after.
    lr = t["lr"] if t["lr_decay_steps"] is None else [[0, t["lr"]], [t["lr_decay_steps"], t["lr_end"]]]
    config.training(lr=lr, train_batch_size=t["train_batch_size"], gamma=t["gamma"], grad_clip=t["grad_clip"],
                    **spec.training(cfg, c))
    spec.configure(config, cfg, c)
    if cfg["training"]["precision"] == "fp16":  # loss scaling (the learner unscales before clipping)
        from agents.algorithms.token_learner import LossScaler

        config.experimental(_torch_grad_scaler_class=LossScaler)
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
