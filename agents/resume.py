"""What `--resume` continues: the experiment's own config. Tune restores a run with the
settings it started with (its search space, schedulers), whatever the YAML given to `--resume`
says; so a fresh run saves its validated config beside the experiment (`run_config.json`), and
`--resume` refuses, in one line before Ray starts, a config that differs from it anywhere but in
what the resuming process itself applies, where the experiment is stored, or its stop criteria
(APPLIED_ON_RESUME): other stop criteria train the run longer (`resume_stop`)."""
from __future__ import annotations

import json
import os

from agents.saved_policy import TOKEN_FILES

RUN_CONFIG = "run_config.json"
# Read by the resuming process, not restored by Tune: the closing samples, the ranking metric
# of the summary, W&B and the dashboard, state saves; and where the experiment is (its storage
# may have been moved or copied, e.g. to another machine, before the resume).
APPLIED_ON_RESUME = ("generate.", "tune.metric", "tune.mode", "tune.wandb", "tune.dashboard",
                     "checkpoint.state_every_s", "tune.storage_path", "stop.")
RESUME_STOP = "stop.json"  # the stop criteria the run goes on with, where a --resume changed them


def experiment_dir(cfg: dict) -> str:
    """A named run's experiment directory (as agents.train makes it)."""
    return os.path.join(os.path.abspath(cfg["tune"]["storage_path"]), cfg["tune"]["name"])


def _as_json(cfg: dict) -> dict:
    return json.loads(json.dumps(cfg, default=str, sort_keys=True))


def save_run_config(cfg: dict, experiment: str) -> None:
    """Writes the run's validated config, and what code made the run (`code_versions`), into its
    experiment directory (each whole, then renamed into place)."""
    from agents.pbt import write_json

    os.makedirs(experiment, exist_ok=True)
    if os.path.exists(os.path.join(experiment, RESUME_STOP)):  # a finished run's of the same name
        os.remove(os.path.join(experiment, RESUME_STOP))
    write_json(os.path.join(experiment, RUN_CONFIG), _as_json(cfg), indent=1, sort_keys=True)
    write_json(os.path.join(experiment, VERSIONS), code_versions(), indent=1, sort_keys=True)


VERSIONS = "versions.json"
LIBRARIES = ("ray", "torch", "transformers", "gymnasium", "peft")


def code_versions() -> dict:
    """What code makes a run: the project's version and, run from a git checkout, its commit
    (with "+changes" where tracked files differ from it); Python's and the main libraries' versions."""
    import importlib.metadata
    import platform
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = None
    if os.path.exists(os.path.join(root, ".git")):  # not an installed copy inside someone else's repository
        def git(*args):
            # no optional locks: `git status` would otherwise take the index's lock and rewrite it,
            # and a user's `git add` at that moment would fail on index.lock
            return subprocess.run(["git", "--no-optional-locks", "-C", root, *args], capture_output=True, text=True,
                                  timeout=10)
        try:
            head = git("rev-parse", "HEAD")
            if head.returncode == 0:
                changed = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
                commit = head.stdout.strip() + ("+changes" if changed else "")
        except (OSError, subprocess.SubprocessError):  # no git on this machine
            pass
    versions = {"tokenmdp": None, "commit": commit, "python": platform.python_version()}
    for name in ("tokenmdp", *LIBRARIES):  # tokenmdp: None where the code runs from a checkout not installed
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def unsaved_state_note(cfg: dict) -> str | None:
    """The --resume line for a run whose checkpoints leave out state it trains on (None for one
    that resumes whole): DQN's replay buffer without `dqn.checkpoint_buffer`."""
    if cfg["algorithm"] == "dqn" and not cfg["dqn"]["checkpoint_buffer"]:
        return ("--resume: DQN's replay buffer starts empty (dqn.checkpoint_buffer: false saves none), so the "
                "resumed run does not go on exactly as the interrupted one would have")
    return None


def version_changes(cfg: dict) -> list[str]:
    """What code differs from the code that started the run being resumed, as "name then -> now"
    ([] where nothing does, or the run saved no versions)."""
    path = os.path.join(experiment_dir(cfg), VERSIONS)
    try:
        with open(path, encoding="utf-8") as f:
            then = json.load(f)
    except (OSError, ValueError):
        return []
    now = code_versions()
    return [f"{name} {then.get(name)} -> {now[name]}" for name in now if then.get(name) != now[name]]


def _leaves(node, prefix: str = "") -> dict:
    if isinstance(node, dict) and node:
        return {k: v for key, value in node.items() for k, v in _leaves(value, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): node}


def _schema_defaults(cfg: dict) -> dict:
    """Every key the schema knows for `cfg`'s algorithm, with its default ({} where that cannot be
    worked out: then nothing is excused)."""
    from agents.schema import validate
    from env.validation import ConfigError

    try:
        given = cfg.get("guide") or {}
        guide = {"guide": {k: given[k] for k in ("name_or_path", "callable") if given.get(k)}}
        guide = guide if guide["guide"] else {}  # a guided algorithm needs its guide; others refuse one
        return _leaves(_as_json(validate({"algorithm": cfg["algorithm"], **guide})))
    except (ConfigError, ValueError, TypeError):
        return {}


def resume_differences(cfg: dict) -> list[str]:
    """The keys where `cfg` differs from the config the experiment started with, as
    "key (then -> now)"; [] when they agree or the experiment saved none (made before it did).
    A run started by an earlier version of the project lacks the keys added since: one at its
    default is no difference (the run had that behaviour), nor is a saved key the schema has dropped."""
    path = os.path.join(experiment_dir(cfg), RUN_CONFIG)
    if not os.path.isfile(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            then = _leaves(json.load(f))
    except (OSError, ValueError) as e:
        raise ValueError(f"--resume: the run's saved config {path} cannot be read ({e}); remove it to resume "
                         "without checking the config against the run's own") from None
    now = _leaves(_as_json(cfg))
    defaults = _schema_defaults(cfg) if set(then) != set(now) else {}

    def excused(key):
        if key not in then:  # added since the run started, left at its default
            return key in defaults and now[key] == defaults[key]
        parts = key.split(".")
        inside = parts[0] == "task" or any(".".join(parts[:i]) in defaults for i in range(1, len(parts)))
        # a field the schema no longer has (not a key inside a free-form value: task options, overrides)
        return key not in now and bool(defaults) and key not in defaults and not inside
    return [f"{key} ({then.get(key, '(unset)')!r} -> {now.get(key, '(unset)')!r})"
            for key in sorted(set(then) | set(now))
            if then.get(key) != now.get(key) and not key.startswith(APPLIED_ON_RESUME) and not excused(key)]


def _stops(cfg: dict) -> tuple[dict, dict, dict] | None:
    """The run's first stop criteria, the ones it last went on with, and the ones a `--resume`
    with `cfg` goes on with: the config's where they differ from the first ones (train longer, or
    less), else the last ones (a later plain `--resume` keeps a change). None: the run saved no
    config (made by an older version: the config's are taken as they are)."""
    experiment = experiment_dir(cfg)
    try:
        with open(os.path.join(experiment, RUN_CONFIG), encoding="utf-8") as f:
            first = _as_json(json.load(f)["stop"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    last = first
    try:
        with open(os.path.join(experiment, RESUME_STOP), encoding="utf-8") as f:
            last = {**first, **json.load(f)}
    except (OSError, ValueError, TypeError):
        pass
    now = _as_json(cfg["stop"])
    return first, last, (last if now == first else now)


def resume_stop(cfg: dict) -> tuple[dict, bool, str | None]:
    """The stop criteria a `--resume` goes on with (`_stops`), whether they differ from the run's
    first ones, and a line saying what changed from the last ones (None where nothing did). Kept
    in `RESUME_STOP` beside the run's config where they differ from its first ones."""
    from agents.pbt import write_json

    stops = _stops(cfg)
    if stops is None:  # nothing to compare with: each trial takes the config's (the same ones change nothing)
        return cfg["stop"], True, None
    if cfg["tune"]["scheduler"] == "asha":  # its own stop, always (check_resume_config)
        return cfg["stop"], False, None
    first, last, now = stops
    path = os.path.join(experiment_dir(cfg), RESUME_STOP)
    try:
        if now != first:
            write_json(path, now, indent=1, sort_keys=True)
        elif os.path.exists(path):
            os.remove(path)
    except OSError as e:
        raise ValueError(f"--resume: cannot write {path} ({e.strerror or e})") from None
    changed = [f"stop.{k} {last.get(k)} -> {now.get(k)}" for k in sorted(set(last) | set(now)) if last.get(k) != now.get(k)]
    line = f"--resume: the run goes on with other stop criteria: {', '.join(changed)}" if changed else None
    return {**cfg["stop"], **now}, now != first, line


def check_resume_config(cfg: dict) -> None:
    """Refuses a `--resume` of a run a live driver is training, or whose config differs from the
    run's own, naming the keys."""
    from agents.driver_lock import check_no_live_driver
    from agents.experiment_store import newest_experiment_state, placing_pending

    check_no_live_driver(experiment_dir(cfg))
    changed = resume_differences(cfg)
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        raise ValueError(f"--resume: the run goes on with the config it started with, and this one differs: "
                         f"{', '.join(changed[:3])}{more}; give the run's own config (or a new tune.name for a new run)")
    stops = _stops(cfg)
    if stops and _as_json(cfg["stop"]) != stops[0] and cfg["tune"]["scheduler"] == "asha":
        raise ValueError("--resume: an ASHA run (tune.scheduler: asha) goes on with its own stop criteria (its "
                         "rungs end at its first stop.training_iteration); give the run's own stop, or start a new "
                         "run from a checkpoint")
    # said before Ray starts (a killed copy's unfinished renames may place one: agents.train's resume)
    if newest_experiment_state(experiment_dir(cfg)) is None and not placing_pending(experiment_dir(cfg)):
        raise ValueError(f"--resume: no experiment to resume at {experiment_dir(cfg)}")


def unfinished_trials(experiment: str) -> int:
    """How many trials of the experiment's newest saved state had not ended (an interrupted or killed
    run's: PENDING, RUNNING or PAUSED); 0 where there is no readable state."""
    from agents.experiment_store import newest_experiment_state

    newest = newest_experiment_state(experiment)
    try:
        with open(newest, encoding="utf-8") as f:
            trials = json.load(f)["trial_data"]
        return sum(json.loads(t[0])["status"] not in ("TERMINATED", "ERROR") for t in trials)
    except (ValueError, OSError, KeyError, IndexError, TypeError):
        return 0


def check_fresh_run(cfg: dict) -> None:
    """Refuses, in one line, a fresh run (no --resume) under the name of a live or an interrupted
    one: it would take over the experiment (its saved config and state), and the interrupted run
    could not resume."""
    from agents.driver_lock import check_no_live_driver
    from agents.experiment_store import placing_pending

    experiment = experiment_dir(cfg) if cfg["tune"]["name"] else None
    if experiment:
        check_no_live_driver(experiment)
    # a killed copy's unfinished renames may hold its state: interrupted too
    if experiment and (unfinished_trials(experiment) or placing_pending(experiment)):
        raise ValueError(f"tune.name: {experiment} holds an interrupted run; go on with it with --resume, or give "
                         "a new tune.name (or remove that directory) to start another")


# What a saved Hugging Face model and tokenizer leave in a directory: a warm start written again over
# one replaces only these (a policy trained from the old one refuses to load if its tokenizer changed).
SAVED_MODEL_FILES = (*TOKEN_FILES, "generation_config.json", "model.safetensors", "pytorch_model.bin",
                     "chat_template.jinja")


def check_writable_model_dir(path: str) -> None:
    """Refuses (one line) an output_dir holding anything but a saved model's files: a warm start
    would write over another run's files (an RL checkpoint, a project folder)."""
    from agents.whole_files import PARTIAL_NAME

    others = sorted(n for n in (os.listdir(path) if os.path.isdir(path) else ())  # a killed writer's partial files go
                    if n not in SAVED_MODEL_FILES and not PARTIAL_NAME.search(n))
    if others:
        raise ValueError(f"output_dir: {path} holds other files than a saved model's ({', '.join(others[:3])}"
                         f"{', ...' if len(others) > 3 else ''}); give an empty or new directory, or one a warm "
                         "start wrote")


def warm_start_state(cfg: dict, resume: bool, name: str, may_change: tuple = ()) -> dict | None:
    """The checkpoint (`name` in output_dir) an `agents.pretrain --resume` goes on from (None for a
    fresh run); refuses, in one line, a fresh run over an interrupted one, a resume with nothing to
    resume, or one whose config differs but in the keys `may_change` (what leaves the weights as
    they would be: how often to log or save)."""
    import torch

    from env.validation import first_line

    path = os.path.join(os.path.abspath(os.path.expanduser(cfg["output_dir"])), name)
    if not os.path.isfile(path):
        if resume:
            raise ValueError(f"--resume: no interrupted warm start in output_dir ({path} does not exist)")
        check_writable_model_dir(os.path.dirname(path))
        return None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 (a file cut short or not ours: say which)
        raise ValueError(f"output_dir: the checkpoint {path} cannot be read ({first_line(e)})") from None
    if not resume:
        raise ValueError(f"output_dir: {os.path.dirname(path)} holds an interrupted warm start (step "
                         f"{saved['step']} of {saved['cfg']['training']['steps']}): go on with --resume, or "
                         f"remove {name} there to start over")
    then, now = _leaves(_as_json(saved["cfg"])), _leaves(_as_json(cfg))
    changed = sorted(k for k in set(then) | set(now) if then.get(k) != now.get(k) and k not in may_change)
    if changed:
        raise ValueError(f"--resume: the warm start goes on with the config it started with, and this one differs: "
                         f"{', '.join(changed[:3])}")
    return saved
