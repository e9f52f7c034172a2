"""The summary `agents.train` prints when a run ends: each trial's first, last and best reward
(from the trials' result.json on the storage path: each iteration once, those before a resume
too), greedy evaluations, a sweep's best setting per
sampler and its summary.csv, samples from the best checkpoint, and the exit code."""
from __future__ import annotations

import csv
import json
import math
import os


def summarize(cfg: dict, grid, progress, experiment: str, wall: float, resumed: bool = False) -> int:
    from agents.generate import generate, load_policy

    metric, mode = cfg["tune"]["metric"], cfg["tune"]["mode"]
    # `wall`: the seconds Tune's fit took in this process (Ray's start and the samples below are not in it)
    took = f"{wall:.0f}s of training" + (" since the resume" if resumed else "")
    print(f"\nSummary ({len(grid)} trial{'s' if len(grid) != 1 else ''}, {took}): {experiment}")
    failed = 0
    for result in grid:
        trial_id = (result.metrics or {}).get("trial_id", "?")
        if result.path:  # the stored curve: before a resume too, each iteration once
            progress.replay(trial_id, result.path, getattr(result, "filesystem", None))
        if result.error:
            failed += 1
            print(f"  trial {trial_id}: FAILED: {str(result.error).strip().splitlines()[-1]}")
            continue
        first = progress.first.get(trial_id)
        last = progress.last.get(trial_id)
        if first and last:
            what = "policy-alone episode reward" if trial_id in progress.guided else "mean episode reward"
            print(f"  trial {trial_id}: {what} {first[1]:.3f} (iteration {first[0]}) -> "
                  f"{last[1]:.3f} (iteration {last[0]}), best {progress.best[trial_id]:.3f}")
        evals = progress.evals.get(trial_id)
        if evals:
            it, best_eval = max(evals, key=lambda e: e[1])
            print(f"  trial {trial_id}: greedy evaluation reward {evals[-1][1]:.3f} (iteration {evals[-1][0]}), "
                  f"best {best_eval:.3f} (iteration {it})")
        if result.checkpoint and len(grid) == 1:
            print(f"  checkpoint: {result.checkpoint.path}")
    best, which = None, ""
    if len(grid) > 1:
        _, top = sweep_table(cfg, grid, progress, experiment)
        if top is not None and (metric, mode) == (REWARD_METRIC, "max"):  # the table ranks by the reward
            best, which = top, f"trial {top.metrics['trial_id']} (the best setting above), "
    if best is None:
        try:
            best = grid.get_best_result(metric=metric, mode=mode, filter_nan_and_inf=True)
        except RuntimeError:
            best = None
    n = cfg["generate"]["num_samples"]
    if best is not None and best.checkpoint and n:
        from agents.core import no_transformers_bars

        no_transformers_bars()  # no "Loading weights" bar above the samples
        try:
            module = load_policy(best.checkpoint.path)
        except (ValueError, OSError) as e:  # a checkpoint that cannot be loaded: the figures above stand
            print(f"  no samples: {str(e).removeprefix('--checkpoint: ')}")
        else:
            seed = cfg["seed"] if isinstance(cfg["seed"], int) else 0  # a searched seed: any fixed one
            samples = generate(module, module.model_config["env"], [None] * n, seed=seed)
            print(f"  samples from {which}{os.path.basename(best.checkpoint.path)} (sampling):")
            for s in samples:
                print(f"    [reward {s['reward']:.3f}] {s['generation']}")
            print(f"  more: python -m agents.generate --checkpoint {best.checkpoint.path}")
    from agents.workarounds import tune_interrupted

    if tune_interrupted():  # Ctrl-C (or SIGUSR1): Tune saved the experiment's state and returned
        name = os.path.basename(experiment)
        how = f"--resume (tune.name {name})" if cfg["tune"]["name"] else f"--resume --set tune.name={name}"
        print(f"  interrupted before its stop criteria: go on with the same command and {how}")
        return INTERRUPTED
    if failed:
        print(f"  {failed} of {len(grid)} trial{'s' if len(grid) != 1 else ''} failed" +
              (" (the others' results above stand)" if failed < len(grid) else ""))
    return 1 if failed else 0


INTERRUPTED = 130  # the exit code of a run stopped by Ctrl-C, as a shell gives one
REWARD_METRIC = "env_runners/episode_return_mean"  # what the sweep table ranks settings by (tune.metric's default)


def _searched_training_keys(cfg: dict) -> list[tuple[str, str]]:
    """(section, key) of the training/reward values the config searches over (or PBT mutates)."""
    from env.validation import is_search_space as _is_search_space

    keys = [(sec, k) for sec in ("training", "reward") for k, v in cfg[sec].items() if _is_search_space(v)]
    if cfg["tune"]["scheduler"] == "pbt":  # PBT changes these as it goes: the table shows each trial's last value
        mutated = (tuple(path.split(".", 1)) for path in cfg["tune"]["hyperparam_mutations"])
        keys += [key for key in mutated if key not in keys]
    return keys


def _leaves(node, path: tuple = ()):
    """(path, canonical text) of each leaf of a trial's config: JSON with tuples as lists and enums as
    their values, as a config restored by `--resume` (JSON round-tripped) holds them."""
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _leaves(value, (*path, str(key)))
    else:
        yield path, _canonical(node)


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, default=_json_leaf)


def _json_leaf(value):
    import enum

    if isinstance(value, enum.Enum):
        return value.value
    if hasattr(value, "item"):  # a numpy scalar
        return value.item()
    return repr(value)


# config paths shown by columns of their own (sampler, masking, params, algorithm) or grouped over (seeds)
_SHOWN = (("_model_config", "sampler"), ("guided_algorithm",))


_LR_KEYS = ("lr", "lr_end", "lr_decay_steps")  # the training keys RLlib's lr schedule holds


def _rllib_path(cfg: dict, sec: str, key: str) -> tuple:
    """Where a trial's RLlib config holds the YAML key `sec.key`: under its RLlib name (the
    algorithm's `Param`; reward.kl_coef is ref_kl_coef), the lr schedule for training.lr, lr_end
    and lr_decay_steps."""
    from agents.config import algorithm_spec

    if sec == "training" and key in _LR_KEYS:
        return ("lr",)
    spec = algorithm_spec(cfg)
    param = (spec.training_params if sec == "training" else spec.reward_params).get(key)
    return (param.rllib if param and param.rllib else key,)


def searched_value(cfg: dict, config: dict, sec: str, key: str):
    """The value of the YAML key `sec.key` in a trial's RLlib config (the lr schedule's ends for
    training.lr, lr_end and lr_decay_steps)."""
    value = config.get(_rllib_path(cfg, sec, key)[0])
    if sec == "training" and key in _LR_KEYS:
        if isinstance(value, (list, tuple)) and value:  # [[0, lr], [lr_decay_steps, lr_end]]
            return {"lr": value[0][1], "lr_end": value[-1][1], "lr_decay_steps": value[-1][0]}[key]
        return value if key == "lr" else None
    return value


def other_searched(cfg: dict, results: list) -> dict[str, tuple]:
    """Column name -> config path of each value the trials differ in that no other column shows (a
    searched value of another section, e.g. guide.beta or dqn.*, wherever the algorithm puts it):
    read from the trials' own configs, so that trials differing in it are not taken for seeds. What
    a shown searched value sets in RLlib's config (its RLlib name, the lr schedule, the reference
    model of reward.kl_coef) adds no column, nor does one key written again elsewhere with the
    same values; two searched keys whose values happen to agree keep a column each."""
    flats = [dict(_leaves(r.config or {})) for r in results]
    searched = _searched_training_keys(cfg)
    derived = {_rllib_path(cfg, sec, key) for sec, key in searched}
    if ("reward", "kl_coef") in searched:
        derived.add(("_model_config", "reference_model"))  # kl_coef > 0
    # (name, values) of each column so far: a path holding the same values under a name made from it adds none
    again = [(name, tuple(_canonical(searched_value(cfg, r.config or {}, sec, key)) for r in results))
             for sec, key in searched for name in {key, _rllib_path(cfg, sec, key)[0]}]
    found: dict[tuple, tuple] = {}
    for path in sorted(set().union(*flats)) if flats else ():
        values = tuple(f.get(path) for f in flats)
        if (len(set(values)) > 1 and "seed" not in path[-1] and not any(path[:len(p)] == p for p in _SHOWN)
                and path not in derived and not any(v == values and name in path[-1] for name, v in again)):
            found[path] = values
            again.append((path[-1], values))
    names = [p[-1] for p in found]
    return {(".".join(p[1:] if p[0] == "_model_config" else p) if names.count(p[-1]) > 1 or p[0] == "_model_config"
             else p[-1]): p for p in found}


def _trial_row(cfg: dict, result, progress, others: dict | None = None) -> dict:
    config = result.config or {}
    sampler = (config.get("_model_config") or {}).get("sampler") or {"name": "none"}
    from agents.schema import SAMPLER_PARAMS

    params = {k: sampler.get(k) for k in SAMPLER_PARAMS.get(sampler.get("name"), ())}
    row = {
        "trial": (result.metrics or {}).get("trial_id", "?"),
        "seed": config.get("seed"),
        "sampler": sampler.get("name", "none"),
        "params": " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()),
        "masking": sampler.get("masking", "-") if sampler.get("name", "none") != "none" else "-",
    }
    if config.get("guided_algorithm"):  # guided runs (possibly a sweep over algorithm names): one setting each
        row = {"algorithm": config["guided_algorithm"], **row}
    for sec, key in _searched_training_keys(cfg):
        row[key] = searched_value(cfg, config, sec, key)
    for name, path in (others or {}).items():
        value = config
        for part in path:
            value = value.get(part) if isinstance(value, dict) else None
        # a value that is not a number or a name shows (and groups) as its canonical text
        row[name] = value if value is None or isinstance(value, (bool, int, float, str)) else _canonical(value)
    trial_id = row["trial"]
    last = progress.last.get(trial_id)
    masks = progress.mask.get(trial_id)
    row.update({
        "iterations": last[0] if last else None,
        "final_reward": round(last[1], 4) if last else None,
        "best_reward": round(progress.best[trial_id], 4) if trial_id in progress.best else None,
        "mean_mask_size": round(sum(masks) / len(masks), 2) if masks else None,
        "status": "error" if result.error else "ok",
        "checkpoint": result.checkpoint.path if result.checkpoint else None,
    })
    return row


def sweep_table(cfg: dict, grid, progress, experiment: str) -> tuple:
    """Writes every trial to summary.csv and prints the best setting per (sampler, masking); returns
    the CSV's path and the result of the best setting's trial with the best reward and a checkpoint
    (None if none has one).

    Trials that differ only in their seed form one setting: its rewards are
    averaged over seeds, and the spread of the final reward across seeds is shown.
    """
    results = list(grid)
    others = other_searched(cfg, results)
    rows = [_trial_row(cfg, r, progress, others) for r in results]
    path = os.path.join(experiment, "summary.csv")
    os.makedirs(experiment, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    searched = [k for _, k in _searched_training_keys(cfg)] + list(others)
    settings: dict[tuple, list] = {}
    for row in rows:
        if row["best_reward"] is not None:
            key = (row["sampler"], row["masking"], row["params"], *(row.get(k) for k in searched))
            settings.setdefault(key, []).append(row)
    best: dict[tuple, tuple] = {}
    for key, group in settings.items():
        score = sum(r["best_reward"] for r in group) / len(group)
        which = key[:2] + ((group[0]["algorithm"],) if "algorithm" in group[0] else ())
        if which not in best or score > best[which][0]:
            best[which] = (score, key, group)
    if rows and "algorithm" in rows[0]:
        searched = ["algorithm", *searched]
        best = {w: (score, (*key[:3], group[0]["algorithm"], *key[3:]), group) for w, (score, key, group) in best.items()}
    header = ["sampler", "masking", "params", *searched, "seeds", "best_reward", "final_reward", "final_std",
              "mean_mask_size"]
    table = [header]
    for score, key, group in sorted(best.values(), key=lambda b: -b[0]):
        finals = [r["final_reward"] for r in group]
        masks = [r["mean_mask_size"] for r in group if r["mean_mask_size"] is not None]
        mean = sum(finals) / len(finals)
        std = math.sqrt(sum((x - mean) ** 2 for x in finals) / (len(finals) - 1)) if len(finals) > 1 else None
        table.append([_fmt(v) for v in (*key, len(group), score, mean, std, sum(masks) / len(masks) if masks else None)])
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    print("\n  best setting per sampler (rewards averaged over seeds):")
    for r in table:
        print("    " + "  ".join(c.ljust(w) for c, w in zip(r, widths)))
    print(f"  all trials: {path}")
    top = None
    if best:
        group = max(best.values(), key=lambda b: b[0])[2]
        with_checkpoint = [r for r in group if r["checkpoint"]]
        if with_checkpoint:
            trial = max(with_checkpoint, key=lambda r: r["best_reward"])["trial"]
            top = next(r for r in results if (r.metrics or {}).get("trial_id") == trial)
    return path, top


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
