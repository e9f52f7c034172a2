"""Train a policy from a YAML experiment config.

    python -m agents.train CONFIG.yaml [--set key=value ...] [--resume]

The config is validated before Ray starts; the run goes through Ray Tune, so
TensorBoard event files, result files and checkpoints land in
`<tune.storage_path>/<tune.name>/`. One progress line is printed per training
iteration, and a summary at the end.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def preflight(cfg: dict) -> None:
    """Builds the env (task, tokenizer, data) and checks the model spec in this process,
    so that bad input fails here with one line instead of inside a Ray worker."""
    from agents.config import env_config
    from agents.models import is_builtin
    from env.text_env import TokenGenerationEnv

    env = TokenGenerationEnv(env_config(cfg))
    env.reset(seed=0)
    name = cfg["model"]["name_or_path"]
    if not is_builtin(name):
        from transformers import AutoConfig

        try:
            AutoConfig.from_pretrained(name)
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"model.name_or_path: cannot load {name!r}: {first}") from None


def _metric(result: dict, path: str):
    node = result
    for part in path.split("/"):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    try:
        value = float(node)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def make_progress_callback():
    from ray.tune import Callback

    class ProgressPrinter(Callback):
        """One line per training iteration; remembers each trial's first and last reward."""

        def __init__(self):
            self.first, self.last, self.best = {}, {}, {}

        def on_trial_result(self, iteration, trials, trial, result, **info):
            reward = _metric(result, "env_runners/episode_return_mean")
            if reward is not None:
                self.first.setdefault(trial.trial_id, (result["training_iteration"], reward))
                self.last[trial.trial_id] = (result["training_iteration"], reward)
                self.best[trial.trial_id] = max(reward, self.best.get(trial.trial_id, -math.inf))
            fields = [
                f"iter {result['training_iteration']:4d}",
                f"steps {int(_metric(result, 'env_runners/num_env_steps_sampled_lifetime') or 0):>9,}",
                f"reward {reward:.3f}" if reward is not None else "reward   n/a",
            ]
            for key, label in (("ref_kl", "kl"), ("entropy", "entropy")):
                value = _metric(result, f"learners/default_policy/{key}")
                if value is not None:
                    fields.append(f"{label} {value:.3f}")
            fields.append(f"{result.get('time_total_s', 0):.0f}s")
            prefix = f"[{trial.trial_id}] " if len(trials) > 1 else ""
            print(prefix + "  ".join(fields), flush=True)

    return ProgressPrinter()


def run(cfg: dict, *, resume: bool = False, verbose: bool = False):
    import ray
    from ray import tune

    from agents.algorithms.ppo import LMPPO
    from agents.config import algorithm_config

    tune_cfg = cfg["tune"]
    storage = os.path.abspath(tune_cfg["storage_path"])
    name = tune_cfg["name"] or "run-" + time.strftime("%Y%m%d-%H%M%S")
    if not ray.is_initialized():
        runtime_env = None
        if not os.environ.get("RAY_ADDRESS"):
            # Local cluster: workers import `env` and `agents` from this checkout.
            path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
            runtime_env = {"env_vars": {"PYTHONPATH": path, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0")}}
        ray.init(runtime_env=runtime_env, include_dashboard=False, logging_level="ERROR",
                 log_to_driver=verbose)

    stop = {}
    stop_keys = {
        "training_iteration": "training_iteration",
        "time_total_s": "time_total_s",
        "num_env_steps_sampled_lifetime": "env_runners/num_env_steps_sampled_lifetime",
        "episode_return_mean": "env_runners/episode_return_mean",
    }
    for key, result_key in stop_keys.items():
        if cfg["stop"][key] is not None:
            stop[result_key] = cfg["stop"][key]

    progress = make_progress_callback()
    ck = cfg["checkpoint"]
    run_config = tune.RunConfig(
        name=name,
        storage_path=storage,
        stop=stop,
        verbose=0,
        callbacks=[progress],
        checkpoint_config=tune.CheckpointConfig(
            checkpoint_frequency=ck["frequency"], checkpoint_at_end=ck["at_end"], num_to_keep=ck["num_to_keep"]
        ),
    )
    experiment = os.path.join(storage, name)
    if resume:
        if not tune.Tuner.can_restore(experiment):
            raise ValueError(f"--resume: no experiment to resume at {experiment}")
        tuner = tune.Tuner.restore(experiment, trainable=LMPPO, resume_errored=True)
    else:
        tuner = tune.Tuner(
            LMPPO,
            param_space=algorithm_config(cfg),
            tune_config=tune.TuneConfig(
                num_samples=tune_cfg["num_samples"], max_concurrent_trials=tune_cfg["max_concurrent_trials"]
            ),
            run_config=run_config,
        )
    print(f"Training {cfg['algorithm'].upper()} on task {cfg['task']['name']!r} with model "
          f"{cfg['model']['name_or_path']!r}; results in {experiment}", flush=True)
    start = time.time()
    grid = tuner.fit()
    return grid, progress, experiment, time.time() - start


def summarize(cfg: dict, grid, progress, experiment: str, wall: float) -> int:
    from agents.generate import generate, load_policy

    metric, mode = cfg["tune"]["metric"], cfg["tune"]["mode"]
    print(f"\nSummary ({len(grid)} trial{'s' if len(grid) != 1 else ''}, {wall:.0f}s wall): {experiment}")
    failed = 0
    for result in grid:
        trial_id = (result.metrics or {}).get("trial_id", "?")
        if result.error:
            failed += 1
            print(f"  trial {trial_id}: FAILED: {str(result.error).strip().splitlines()[-1]}")
            continue
        first = progress.first.get(trial_id)
        last = progress.last.get(trial_id)
        if first and last:
            print(f"  trial {trial_id}: mean episode reward {first[1]:.3f} (iteration {first[0]}) -> "
                  f"{last[1]:.3f} (iteration {last[0]}), best {progress.best[trial_id]:.3f}")
        if result.checkpoint:
            print(f"  checkpoint: {result.checkpoint.path}")
    try:
        best = grid.get_best_result(metric=metric, mode=mode, filter_nan_and_inf=True)
    except RuntimeError:
        best = None
    n = cfg["generate"]["num_samples"]
    if best is not None and best.checkpoint and n:
        module = load_policy(best.checkpoint.path)
        samples = generate(module, module.model_config["env"], [None] * n, seed=cfg["seed"])
        print(f"  samples from {os.path.basename(best.checkpoint.path)} (sampling):")
        for s in samples:
            print(f"    [reward {s['reward']:.3f}] {s['generation']}")
        print(f"  more: python -m agents.generate --checkpoint {best.checkpoint.path}")
    return 1 if failed == len(grid) else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agents.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="YAML experiment file, e.g. tune_configs/quickstart.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set training.lr=3e-4 (repeatable)")
    parser.add_argument("--resume", action="store_true", help="continue the interrupted experiment tune.name")
    parser.add_argument("--verbose", action="store_true", help="show Ray worker logs")
    args = parser.parse_args(argv)

    from agents.config import ConfigError, load

    try:
        cfg = load(args.config, args.overrides)
    except ConfigError as e:
        return _fail(str(e))
    if args.resume and not cfg["tune"]["name"]:
        return _fail("--resume: set tune.name in the config (or --set tune.name=...) to name the run to resume")
    try:
        preflight(cfg)
    except (ValueError, OSError, TypeError) as e:
        return _fail(str(e))
    try:
        grid, progress, experiment, wall = run(cfg, resume=args.resume, verbose=args.verbose)
    except ValueError as e:
        return _fail(str(e))
    return summarize(cfg, grid, progress, experiment, wall)


if __name__ == "__main__":
    sys.exit(main())
