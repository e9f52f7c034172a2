"""Train a policy from a YAML experiment config.

    python -m agents.train CONFIG.yaml [--set key=value ...] [--resume]

The config is validated before Ray starts; the run goes through Ray Tune, so
TensorBoard event files, result files and checkpoints land in
`<tune.storage_path>/<tune.name>/`. One progress line is printed per training
iteration, and a summary at the end; with several trials (a sweep) also a
table of the best trial per sampler, written to `summary.csv` there.
W&B logging is on with `tune.wandb: true` or when WANDB_PROJECT is set; with
no WANDB_API_KEY it runs offline (run folders under each trial's directory,
upload later with `wandb sync`). A resumed trial logs to the same W&B run (its
trial id, `resume="allow"`) and skips the iterations that run already holds
(W&B's own step count online; the trial's offline run files offline), so each
iteration appears once.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings

from agents.summary import summarize


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def preflight(cfg: dict) -> None:
    """Builds the env (task, tokenizer, data) and checks the model spec in this process,
    so that bad input fails here with one line instead of inside a Ray worker."""
    from agents.config import algorithm_spec, env_config
    from agents.models import check_lora, check_pretrained
    from env.text_env import TokenGenerationEnv
    from env.tokenization import is_word_level

    guided = cfg.get("guide") and algorithm_spec(cfg).section == "guide"
    check_storage(cfg["tune"]["storage_path"], cfg["tune"]["name"])
    check_pretrained("model.name_or_path", cfg["model"]["name_or_path"])
    check_pretrained("env.tokenizer", cfg["env"]["tokenizer"], tokenizer=True)
    if guided:
        check_pretrained("guide.name_or_path", cfg["guide"].get("name_or_path"))
    env = TokenGenerationEnv(env_config(cfg))
    env.reset(seed=0)
    if is_word_level(env.tokenizer):
        from agents.pretrain import check_known_words  # prompt words a word-level tokenizer lacks: lost whole

        check_known_words(env.tokenizer, [(ex["prompt"], "") for ex in env.examples],
                          "task.dataset" if cfg["task"].get("dataset") else "task")
    check_reward_scores(env)
    check_model_fits(cfg["model"]["name_or_path"], env)
    check_lora(cfg["model"], env.tokenizer)
    if guided:
        preflight_guide(cfg, env)


def check_reward_scores(env) -> None:
    """A text task's reward scores its first training example (the prompt as the generation) here,
    where it loads no model: a reward needing references or meta fields the data lacks fails in
    one line, not inside the trial."""
    from env.rewards import RewardError, loads_models

    reward_for = getattr(env.task, "reward_for", None)
    if reward_for is None or loads_models(reward_for("train")):
        return
    example = env.examples[0]
    try:
        env.task.reward([example["prompt"]], [example["prompt"]], [example["meta"]])
    except RewardError as e:
        raise ValueError(" ".join(str(e).split())) from None


def check_model_fits(name: str, env) -> None:
    """A saved or hub model (a built-in is sized to the env) that the env's episodes fit: its
    config loads, its weights' header reads, it has one output per token of the env's tokenizer
    (a policy drawing a token the tokenizer lacks ends the run mid-way), and a causal LM has a
    position for every token of prompt and generation. One line naming what differs."""
    from agents.models import is_builtin
    from env.validation import first_line

    if is_builtin(name):
        return
    from transformers import AutoConfig

    field = "model.name_or_path"
    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise ValueError(f"{field}: cannot load {name!r}'s config: {first_line(e)}") from None
    weights = os.path.join(os.path.expanduser(name), "model.safetensors")
    if os.path.isfile(weights):
        from safetensors import safe_open

        try:
            with safe_open(weights, "pt"):
                pass
        except Exception as e:  # a file cut short: its header does not parse
            raise ValueError(f"{field}: cannot read {weights}: {first_line(e)}") from None
    vocab, tokens = getattr(config, "vocab_size", None), len(env.tokenizer)
    if vocab is not None and vocab < tokens:
        raise ValueError(f"{field}: {name!r} has {vocab} output tokens but the env's tokenizer (env.tokenizer, "
                         f"else the task's or the model's own) has {tokens}")
    own = _saved_tokenizer_size(name)  # more outputs than tokens is a padded vocabulary (T5's), unless
    if own is not None and own != tokens:  # the model was trained with another tokenizer
        raise ValueError(f"{field}: {name!r} was saved with a {own}-token tokenizer, but the env's (env.tokenizer, "
                         f"else the task's) has {tokens}: its outputs would mean other tokens")
    if not env.encoder_decoder and (error := positions_error(config, env.seq_len, name)):
        raise ValueError(error)


def positions_error(config, length: int, name: str) -> str | None:
    """Why a causal model (its HF `config`) cannot take windows of `length` tokens, or None."""
    positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if positions is not None and positions < length:
        return f"env.max_prompt_len + env.max_new_tokens: {length} tokens, more than the {positions} positions of {name!r}"
    return None


def _saved_tokenizer_size(name: str) -> int | None:
    """The length of the tokenizer saved in a local model directory, None if it holds none."""
    path = os.path.expanduser(name)
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from env.tokenization import load_tokenizer

    try:
        return len(load_tokenizer(path))
    except (OSError, ValueError):
        return None


def check_storage(path: str, name: str | None = None) -> None:
    """Refuses, in one line, a `tune.storage_path` that cannot become a directory (a file stands
    at it or above it), and a `tune.name` that is not one directory's name inside it."""
    from env.validation import directory_error

    error = directory_error("tune.storage_path", path)
    if error:
        raise ValueError(error)
    here = os.path.abspath(os.path.expanduser(path))
    while not os.path.isdir(here):  # the nearest folder there is (directory_error: no file stands in the way)
        here = os.path.dirname(here)
    try:  # a folder made and removed there: one that cannot be (read-only, virtual, no permission) is refused
        import tempfile

        os.rmdir(tempfile.mkdtemp(prefix=".tokenmdp-check-", dir=here))
    except OSError as e:
        raise ValueError(f"tune.storage_path: cannot write the run's results in {os.path.abspath(path)} "
                         f"({e.strerror or e})") from e
    if name is not None and (name in ("", ".", "..") or "/" in name or os.sep in name):
        raise ValueError(f"tune.name: the experiment's directory name inside tune.storage_path (no '/', not '.' "
                         f"or '..'), got {name!r}")


def preflight_guide(cfg: dict, env) -> None:
    """Builds the guide here and asks it for the next tokens of two of the env's first states, so
    an unknown guide, a vocabulary mismatch or a callable's malformed answer (one continuation
    whatever the number of prefixes, say) fails in one line."""
    import torch

    from agents.guides import build_guide

    states = [env.reset(seed=seed)[0] for seed in (0, 1)]
    guide = build_guide(cfg["guide"], env.tokenizer, max_positions=env.seq_len)
    batch = {k: torch.stack([torch.as_tensor(s[k]) for s in states]) for k in states[0]}
    guide.next_tokens(batch, torch.tensor([0, 1]))


def population_runs_at_once(cfg: dict, available: dict) -> bool:
    """Whether every trial of the experiment can run at the same time: within
    tune.max_concurrent_trials and within `available` (the Ray cluster's resources)."""
    from agents.schema import population

    n, need = population(cfg), trial_resources(cfg)
    return n <= cfg["tune"]["max_concurrent_trials"] and all(
        n * need[k] <= available.get(k, 0) + 1e-9 for k in ("CPU", "GPU") if need[k])


def trial_resources(cfg: dict) -> dict:
    """CPUs and GPUs one trial reserves (its process, EnvRunners, learners), as RLlib counts them."""
    from agents.config import learner_cpus

    er, lr = cfg["env_runners"], cfg["learners"]
    per_learner = learner_cpus(cfg)
    if per_learner == "auto":
        per_learner = 0.0 if lr["num_gpus_per_learner"] else 1.0
    main = cfg["tune"]["num_cpus_per_trial"] or 1.0
    if lr["num_learners"] == 0:  # the learner lives in the trial's own process
        cpus, gpus = max(main, per_learner), lr["num_gpus_per_learner"]
    else:
        cpus = main + lr["num_learners"] * per_learner
        gpus = lr["num_learners"] * lr["num_gpus_per_learner"]
    cpus += er["num_env_runners"] * er["num_cpus_per_env_runner"]
    gpus += er["num_env_runners"] * er["num_gpus_per_env_runner"]
    return {"CPU": cpus, "GPU": gpus}


def check_trial_fits(cfg: dict, available: dict) -> None:
    """Raises ValueError, naming the fields to change, when one trial needs more than `available`."""
    need = trial_resources(cfg)
    if need["CPU"] > available.get("CPU", 0) + 1e-9:
        raise ValueError(
            f"one trial needs {need['CPU']:g} CPUs (the trial's process, env_runners.num_env_runners x "
            f"num_cpus_per_env_runner, learners.num_learners x num_cpus_per_learner) but this Ray instance has "
            f"{available.get('CPU', 0):g}: lower env_runners.num_cpus_per_env_runner, learners.num_cpus_per_learner "
            f"or tune.num_cpus_per_trial (fractions such as 0.25 are fine), or run on a cluster (RAY_ADDRESS)")
    if need["GPU"] > available.get("GPU", 0) + 1e-9:
        raise ValueError(
            f"one trial needs {need['GPU']:g} GPUs (env_runners.num_gpus_per_env_runner, learners.num_gpus_per_learner)"
            f" but this Ray instance has {available.get('GPU', 0):g}")
    runners = cfg["env_runners"]["num_env_runners"]
    for name, amount in cfg["env_runners"]["custom_resources"].items():
        if runners and runners * amount > available.get(name, 0) + 1e-9:
            raise ValueError(
                f"env_runners.custom_resources: {runners} EnvRunners x {amount:g} {name!r} need {runners * amount:g} but "
                f"this Ray instance has {available.get(name, 0):g} (custom resources come from the nodes' "
                f"`ray start --resources`; run on such a cluster with RAY_ADDRESS)")


def check_custom_resources(cfg: dict) -> None:
    """Raises ValueError naming the field when env_runners.custom_resources is not {name: amount >= 0}."""
    for name, amount in cfg["env_runners"]["custom_resources"].items():
        if not isinstance(name, str) or not name or name in ("CPU", "GPU", "memory", "object_store_memory"):
            raise ValueError(f"env_runners.custom_resources: {name!r} is not a custom resource name "
                             f"(CPUs and GPUs have their own fields: num_cpus_per_env_runner, num_gpus_per_env_runner)")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount >= 0:
            raise ValueError(f"env_runners.custom_resources.{name}: expected a number >= 0, got {amount!r}")


def run(cfg: dict, *, resume: bool = False, verbose: bool = False, quiet: bool = False):
    """Trains the experiment (or goes on with it: `resume`); returns (the ResultGrid, the progress
    callback, the experiment's directory, seconds). It holds the experiment's driver lock from
    before anything is written there until the run ends: one driver per experiment."""
    from agents.driver_lock import DrivingExperiment

    name = cfg["tune"]["name"] or "run-" + time.strftime("%Y%m%d-%H%M%S")
    with DrivingExperiment(os.path.join(os.path.abspath(cfg["tune"]["storage_path"]), name)):
        return _run(cfg, name, resume=resume, verbose=verbose, quiet=quiet)


def _run(cfg: dict, name: str, *, resume: bool, verbose: bool, quiet: bool):
    import ray
    from ray import tune

    from agents.config import algorithm_config, population
    from agents.pbt import make_scheduler
    from agents.progress import make_progress_callback, metric_error
    from agents.experiment_store import (apply_resume_stop, check_experiment_state, hook_experiment_saves,
                                         store_experiments_safely)
    from agents.workarounds import (drop_restored_trial_decisions, make_curve_logger, make_log_once_pruner,
                                    make_progress_csv_logger, make_wandb_callback, note_tune_interrupts,
                                    release_resolved_task_futures, replace_restored_callbacks)

    tune_cfg = cfg["tune"]
    storage = os.path.abspath(tune_cfg["storage_path"])
    if not ray.is_initialized():
        runtime_env, local = None, {}
        if not os.environ.get("RAY_ADDRESS"):
            local = {"include_dashboard": tune_cfg["dashboard"]}
            # Local cluster: workers import the installed package, and (as Ray does for every
            # driver) modules from the directory the run starts in, like your own rewards and tasks.
            runtime_env = {"env_vars": {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0")}}
            # Ray starts here: a watcher stops its processes should this one be killed (agents/reaper.py).
            from agents.reaper import watch_this_process

            watch_this_process()
        context = ray.init(runtime_env=runtime_env, logging_level="ERROR", log_to_driver=verbose, **local)
        if context.dashboard_url:
            print(f"Ray dashboard: http://{context.dashboard_url}", flush=True)
        if local:  # a cluster this process started cannot grow: a trial that does not fit would wait forever
            check_trial_fits(cfg, ray.cluster_resources())

    stop, stop_cfg, other_stop = {}, cfg["stop"], False
    if resume:  # the run's stop criteria, or others given to this --resume (train longer)
        from agents.resume import resume_stop

        # first: it finishes a killed copy's renames of the top folder's files (stop.json among them)
        check_experiment_state(os.path.join(storage, name))
        stop_cfg, other_stop, line = resume_stop(cfg)
        if line and not quiet:
            print(line, flush=True)
    stop_keys = {
        "training_iteration": "training_iteration",
        "time_total_s": "time_total_s",
        "num_env_steps_sampled_lifetime": "env_runners/num_env_steps_sampled_lifetime",
        "episode_return_mean": "env_runners/episode_return_mean",
    }
    for key, result_key in stop_keys.items():
        if stop_cfg[key] is not None:
            stop[result_key] = stop_cfg[key]

    release_resolved_task_futures()
    store_experiments_safely()
    hook_experiment_saves()
    apply_resume_stop(stop if other_stop else None, say=None if quiet else lambda line: print(line, flush=True))
    note_tune_interrupts()
    progress = make_progress_callback(cfg["evaluation"]["interval"], quiet=quiet, metric=tune_cfg["metric"],
                                      trials=population(cfg))
    callbacks = [progress, make_curve_logger(), make_progress_csv_logger(), make_log_once_pruner()]
    if tune_cfg["wandb"] or os.environ.get("WANDB_PROJECT"):
        callbacks.append(make_wandb_callback(cfg, name))
    ck = cfg["checkpoint"]
    # Tune saves its experiment state (which checkpoint each trial has) every 10 s or more by
    # default; a driver killed inside that window would resume from stale state.
    os.environ["TUNE_GLOBAL_CHECKPOINT_S"] = str(ck["state_every_s"])
    run_config = tune.RunConfig(
        name=name,
        storage_path=storage,
        stop=stop,
        verbose=0,
        callbacks=callbacks,
        failure_config=tune.FailureConfig(max_failures=tune_cfg["max_failures"]),
        checkpoint_config=tune.CheckpointConfig(
            checkpoint_frequency=ck["frequency"], checkpoint_at_end=ck["at_end"], num_to_keep=ck["num_to_keep"]
        ),
    )
    experiment = os.path.join(storage, name)
    param_space = algorithm_config(cfg)
    trainable = param_space.algo_class  # LMPPO, A3C or LMDQN: Tune gets the class, not a registered name
    if resume:
        if not tune.Tuner.can_restore(experiment):
            raise ValueError(f"--resume: no experiment to resume at {experiment}")
        drop_restored_trial_decisions()
        tuner = tune.Tuner.restore(experiment, trainable=trainable, resume_errored=True, param_space=param_space)
        # The restored run config carries the callbacks pickled at the start; print through this
        # process's instead, so progress lines and the summary cover the resumed iterations.
        replace_restored_callbacks(tuner, callbacks)
    else:
        from agents.resume import save_run_config

        # what --resume checks its config against, with the name the run got (--set tune.name=NAME resumes it)
        save_run_config({**cfg, "tune": {**tune_cfg, "name": name}}, experiment)
        tuner = tune.Tuner(
            trainable,
            param_space=param_space,
            tune_config=tune.TuneConfig(
                num_samples=tune_cfg["num_samples"], max_concurrent_trials=tune_cfg["max_concurrent_trials"],
                scheduler=make_scheduler(cfg, keep_running=population_runs_at_once(cfg, ray.cluster_resources())),
            ),
            run_config=run_config,
        )
    algo = cfg["algorithm"] if isinstance(cfg["algorithm"], str) else "/".join(next(iter(cfg["algorithm"].values())))
    if not quiet:
        print(f"Training {algo.upper()} on task {cfg['task']['name']!r} with model "
              f"{cfg['model']['name_or_path']!r}; results in {experiment}"
              + ("" if tune_cfg["name"] else f" (resume it with --resume --set tune.name={name})"), flush=True)
    start = time.time()
    with warnings.catch_warnings():
        # Tune suggests reuse_actors for PBT; RLlib's Algorithm has no reset_config, so an
        # exploiting trial gets a new actor built from its new config (see agents.pbt.make_pbt).
        warnings.filterwarnings("ignore", message="Consider boosting PBT performance")
        try:
            grid = tuner.fit()
        except Exception as e:  # Tune wraps a callback's error in a TuneError
            raise metric_error(e, cfg["tune"]["metric"]) or e
    return grid, progress, experiment, time.time() - start


def main(argv=None, prog: str = "python -m agents.train") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="YAML experiment file, e.g. tune_configs/quickstart.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set training.lr=3e-4 (repeatable)")
    parser.add_argument("--resume", action="store_true", help="continue the interrupted experiment tune.name")
    parser.add_argument("--verbose", action="store_true", help="show Ray worker logs")
    args = parser.parse_args(argv)

    from agents.config import ConfigError, load
    from agents.core import DropLogLines

    # RLlib's note, once per algorithm, that it runs on the new API stack (the project always does)
    logging.getLogger("ray.rllib.algorithms.algorithm_config").addFilter(DropLogLines("on the new API stack!"))
    try:
        cfg = load(args.config, args.overrides)
    except ConfigError as e:
        return _fail(str(e))
    if args.resume and not cfg["tune"]["name"]:
        return _fail("--resume: set tune.name in the config (or --set tune.name=...) to name the run to resume")
    try:
        check_storage(cfg["tune"]["storage_path"], cfg["tune"]["name"])  # before --resume looks there
        from agents.resume import check_fresh_run, check_resume_config, unsaved_state_note, version_changes

        check_resume_config(cfg) if args.resume else check_fresh_run(cfg)
        if args.resume and (changes := version_changes(cfg)):
            print(f"--resume: the run goes on with other code than it started with: {'; '.join(changes)}", flush=True)
        if args.resume and (note := unsaved_state_note(cfg)):
            print(note, flush=True)
        check_custom_resources(cfg)
        preflight(cfg)
    except (ValueError, OSError, TypeError) as e:
        return _fail(str(e))
    try:
        grid, progress, experiment, wall = run(cfg, resume=args.resume, verbose=args.verbose)
    except ValueError as e:
        return _fail(str(e))
    return summarize(cfg, grid, progress, experiment, wall, resumed=args.resume)


if __name__ == "__main__":
    from agents import exit_with

    exit_with(main())
