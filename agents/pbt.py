"""Population Based Training from YAML (`tune.scheduler: pbt`), and the scheduler agents.train
hands Tune: the scheduler keys' checks (agents/schema.py's `validate` calls `check_scheduler`),
the mutations as Tune and RLlib take them, ASHA or PBT as a Tune scheduler, and PBT's explore
step and pausing rule.

The schema imports this module, so nothing here imports agents/schema.py or agents/config.py:
`check_scheduler` is handed the schema, its search-space check and the population count. Ray
Tune is imported where it is used (the config checks run before Ray starts)."""
from __future__ import annotations

import json
import os

from agents.algorithms.base import COMMON_TRAINING
from agents.whole_files import write_whole
from env.validation import ConfigError, is_search_space as _is_search_space, unknown_key


PBT_KEYS = ("perturbation_interval", "hyperparam_mutations", "quantile_fraction", "resample_probability")
ASHA_KEYS = ("grace_period", "reduction_factor")
# What PBT may mutate: the YAML key path -> its key in the RLlib config (Tune's param_space).
# Each is read from the config when a trial's Algorithm is built, and none travels in a
# checkpoint: a trial that exploits another gets a new actor built from the perturbed config,
# then restores the other's checkpoint (the learner then steps with the config's lr, not the
# lr saved with the optimizer state: agents.algorithms.base.use_configured_lr).
PBT_MUTABLE = {"training.lr": "lr", "training.entropy_coeff": "entropy_coeff", "training.clip_param": "clip_param",
               "training.vf_loss_coeff": "vf_loss_coeff", "training.vf_clip_param": "vf_clip_param",
               "training.gamma": "gamma", "training.lambda": "lambda"}
PBT_SPACES = ("grid_search", "choice", "uniform", "loguniform")


def _flat_mutations(value: dict) -> dict:
    """`{training: {lr: X}}` (as `--set tune.hyperparam_mutations.training.lr=X` writes it) as
    `{"training.lr": X}`; search spaces and lists are leaves."""
    out = {}
    for key, v in value.items():
        if isinstance(v, dict) and v and not _is_search_space(v):
            out.update({f"{key}.{k}": x for k, x in _flat_mutations(v).items()})
        else:
            out[str(key)] = v
    return out


def check_scheduler(raw: dict, cfg: dict, spec, *, full: dict, check_space, population) -> None:
    """Refuses one scheduler's keys with another, and checks the PBT set-up (setting the starting
    values and checkpoint defaults it implies). `full` is the whole schema (agents.schema.schema()),
    `check_space(path, field, space)` its check of a search space, `population(cfg)` the number of
    trials the config runs."""
    t = cfg["tune"]
    given = raw.get("tune") if isinstance(raw.get("tune"), dict) else {}
    scheduler = t["scheduler"]
    for keys, owner in ((PBT_KEYS, "pbt"), (ASHA_KEYS, "asha")):
        for key in keys:
            if given.get(key) is not None and scheduler != owner:
                raise ConfigError(f"tune.{key}: only used by tune.scheduler {owner} (this config's scheduler is "
                                  f"{scheduler!r})")
    max_t = cfg["stop"]["training_iteration"]
    if scheduler == "asha" and isinstance(max_t, int) and t["grace_period"] > max_t:
        raise ConfigError(f"tune.grace_period: {t['grace_period']} is more than stop.training_iteration ({max_t}); "
                          "ASHA's first rung must come before the trials stop (set tune.grace_period <= "
                          f"{max_t})")
    if scheduler != "pbt":
        return
    path = "tune.hyperparam_mutations"
    mutations = _flat_mutations(t["hyperparam_mutations"])
    if not mutations:
        raise ConfigError(f"{path}: PBT needs at least one hyperparameter to mutate, e.g. "
                          "{training.lr: {loguniform: [1.0e-4, 1.0e-2]}}")
    leaves = [f"{sec}.{k}" for sec, fields in full.items() if isinstance(fields, dict) for k in fields]
    reads = COMMON_TRAINING + spec.training_keys
    checked = {}
    for key, space in mutations.items():
        where = f"{path}.{key}"
        section, _, leaf = key.partition(".")
        if key not in leaves:
            if key in full and not leaf:
                raise ConfigError(f"{where}: name one hyperparameter by its key path, e.g. training.lr")
            raise unknown_key(path, key, leaves, what="not a hyperparameter of the run")
        if key not in PBT_MUTABLE:
            why = (" (its KL controller's coefficient is restored with the cloned trial's checkpoint)"
                   if key == "reward.kl_coef" else "")
            raise ConfigError(f"{where}: not mutable by PBT{why}; it mutates {', '.join(PBT_MUTABLE)}")
        if section == "training" and leaf not in reads:
            raise ConfigError(f"{where}: not used by algorithm {cfg['algorithm']!r}")
        if key == "training.lr" and cfg["training"]["lr_decay_steps"] is not None:
            raise ConfigError(f"{where}: PBT mutates a constant lr; training.lr_end and training.lr_decay_steps "
                              "make it a schedule")
        field = full[section][leaf]
        if isinstance(space, list) and space:
            checked[key] = [field.check(where, v) for v in space]
        elif _is_search_space(space) and next(iter(space)) in PBT_SPACES:
            checked[key] = check_space(where, field, space)
        elif _is_search_space(space):
            raise ConfigError(f"{where}: {next(iter(space))} is not a PBT mutation; use {', '.join(PBT_SPACES)} "
                              "or a list of values")
        else:
            raise ConfigError(f"{where}: expected a search space ({{loguniform: [low, high]}}, {{uniform: ..}}, "
                              f"{{choice: [..]}}, {{grid_search: [..]}}) or a list of values, got {space!r}")
        if (given_section := raw.get(section)) is None or leaf not in given_section:
            # Not set in the YAML: each trial starts from a draw of the mutation's space (as Tune does).
            cfg[section][leaf] = _initial_space(checked[key])
    t["hyperparam_mutations"] = checked
    if (n := population(cfg)) < 2:
        raise ConfigError(f"tune.num_samples: PBT needs a population of at least 2 trials (tune.num_samples x the "
                          f"grid_search values), got {n}")
    ck, given_ck = cfg["checkpoint"], raw.get("checkpoint") or {}
    if "frequency" not in given_ck:
        # PBT has each trial it may clone save at the perturbation itself; periodic checkpoints
        # on top would save those iterations twice. Set checkpoint.frequency for --resume/max_failures.
        ck["frequency"] = 0
    if "num_to_keep" not in given_ck:
        # A top trial saves at every perturbation, and the checkpoint a trial clones must still be
        # there when its new actor restores it: keep them all unless the YAML says otherwise.
        ck["num_to_keep"] = None
    elif ck["num_to_keep"] is not None and ck["num_to_keep"] <= 2:
        raise ConfigError(f"checkpoint.num_to_keep: PBT restores trials from other trials' checkpoints, which must "
                          f"outlive the restore: keep 3 or more (or null: all), got {ck['num_to_keep']}")


def _initial_space(mutation):
    """The search space a trial's starting value is drawn from: one of the listed values, or the range."""
    if isinstance(mutation, list):
        return {"choice": mutation}
    (kind, args), = mutation.items()
    return {"choice": args} if kind == "grid_search" else mutation


def pbt_mutations(cfg: dict) -> tuple[dict, dict]:
    """`tune.hyperparam_mutations` as PopulationBasedTraining takes them, keyed by the RLlib
    config's names: a list (grid_search, choice, or a plain list: PBT moves to a neighbouring
    value, or resamples) or a Tune domain (uniform, loguniform: PBT multiplies the value by 0.8
    or 1.2, or resamples). Also returns each domain's (low, high), which KeepInBounds (below)
    holds perturbed values to."""
    from ray import tune

    mutations, bounds = {}, {}
    for key, space in cfg["tune"]["hyperparam_mutations"].items():
        name = PBT_MUTABLE[key]
        if isinstance(space, list):
            mutations[name] = list(space)
            continue
        (kind, args), = space.items()
        if kind in ("grid_search", "choice"):
            mutations[name] = list(args)
        else:
            mutations[name] = getattr(tune, kind)(*args)
            bounds[name] = (args[0], args[1])
    return mutations, bounds


def make_scheduler(cfg: dict, *, keep_running: bool = False):
    """ASHA early stopping or Population Based Training on the run's metric, or None (FIFO:
    every trial runs to its stop criteria). keep_running: see make_pbt."""
    t = cfg["tune"]
    if t["scheduler"] == "pbt":
        return make_pbt(cfg, keep_running=keep_running)
    if t["scheduler"] != "asha":
        return None
    return resumable_asha_class()(
        time_attr="training_iteration", metric=t["metric"], mode=t["mode"],
        max_t=cfg["stop"]["training_iteration"] or 10**6, grace_period=t["grace_period"],
        reduction_factor=t["reduction_factor"],
    )


def resumable_asha_class():
    from ray.tune.schedulers import AsyncHyperBandScheduler

    class ResumableASHA(AsyncHyperBandScheduler):
        """Tune's ASHA, whose rungs (the metric each trial had at each milestone) and trials'
        brackets are saved with the experiment's state and restored on --resume (Tune saves no
        scheduler: a resumed run's rungs started empty, so a trial the run would have stopped at
        a rung ran to the end). `agents.experiment_store` calls save and restore."""

        saves_with_experiment = True

        def save(self, checkpoint_path: str) -> None:
            write_json(checkpoint_path, {
                "rungs": [[{t: float(v) for t, v in recorded.items()} for _, recorded in bracket._rungs]
                          for bracket in self._brackets],
                "trials": {t: self._brackets.index(b) for t, b in self._trial_info.items()}})

        def restore(self, checkpoint_path: str) -> None:
            with open(checkpoint_path, encoding="utf-8") as f:
                state = json.load(f)
            for bracket, rungs in zip(self._brackets, state["rungs"]):
                for (_, recorded), saved in zip(bracket._rungs, rungs):
                    recorded.clear()
                    recorded.update(saved)
            for trial_id, index in state["trials"].items():
                self._trial_info[trial_id] = self._brackets[index]

    return ResumableASHA


def write_json(path: str, state: dict, **dump_options) -> None:
    """Writes `state` whole, then renames it into place (a kill leaves the previous one)."""
    write_whole(path, lambda f: f.write(json.dumps(state, **dump_options).encode("utf-8")))


def _json_value(value):
    """A result's value JSON has no type for: numpy's (and torch's) numbers and arrays as lists,
    anything else as its text."""
    try:
        return value.tolist()
    except AttributeError:
        return str(value)


def make_pbt(cfg: dict, *, keep_running: bool = False):
    """Tune's PopulationBasedTraining over `tune.hyperparam_mutations`, every
    `tune.perturbation_interval` training iterations. A trial that gets there is ranked against
    the others' latest scores: in the top quantile PBT has it save a checkpoint; in the bottom
    one it is paused, given a top trial's config with the mutated keys perturbed, and restarted
    in a new actor (RLlib's Algorithm has no reset_config, so Tune does not reuse actors) that
    restores that trial's last PBT checkpoint.

    Asynchronous only: in Tune's synch mode a trial paused to wait for the others was once saved
    twice at the perturbation (by the pause, it seems, then by PBT), and its next checkpoint went into
    the second save's directory, which PBT had handed to the exploiting trial: that trial
    restored later weights than PBT logged (docs/results/pbt.md).

    keep_running: the whole population runs at once, so a trial that reaches a perturbation
    while another waits to restart goes on instead of being paused (KeepRunningPBT)."""
    t = cfg["tune"]
    mutations, bounds = pbt_mutations(cfg)
    return keep_running_pbt_class()(
        time_attr="training_iteration", metric=t["metric"], mode=t["mode"],
        perturbation_interval=t["perturbation_interval"], hyperparam_mutations=mutations,
        quantile_fraction=t["quantile_fraction"], resample_probability=t["resample_probability"],
        custom_explore_fn=KeepInBounds(bounds) if bounds else None, synch=False, keep_running=keep_running,
    )


class KeepInBounds:
    """PBT's explore step (Tune's `custom_explore_fn`): a value multiplied by 0.8 or 1.2 past its
    search space's bounds is clipped back to them (Tune itself lets it drift out)."""

    def __init__(self, bounds: dict):
        self.bounds = bounds

    def __call__(self, config: dict) -> dict:
        for name, (low, high) in self.bounds.items():
            config[name] = min(max(config[name], low), high)
        return config


def keep_running_pbt_class():
    """KeepRunningPBT (below), defined on first use: it subclasses Tune's PopulationBasedTraining,
    and importing this module (the config checks do) must not import Ray Tune. It is this module's
    `KeepRunningPBT` from then on, so a pickled scheduler names it as agents.pbt.KeepRunningPBT."""
    cls = globals().get("KeepRunningPBT")
    if cls is not None:
        return cls
    from ray.tune.experiment import Trial
    from ray.tune.schedulers import PopulationBasedTraining, TrialScheduler

    class KeepRunningPBT(PopulationBasedTraining):
        """Tune's PopulationBasedTraining, without pausing trials that need not wait.

        Tune pauses a trial that reaches a perturbation while another trial is paused or pending,
        so that a population larger than the cluster takes turns. A paused RLlib trial is a stopped
        actor: it saves a checkpoint and comes back in a new process that builds the model, env and
        learner again and restores it. With `keep_running` (agents.train.run: the whole population
        fits at once, in tune.max_concurrent_trials and in the cluster) the trial waiting is one that
        PBT paused to clone another, and it has a slot of its own: the others go on."""

        saves_with_experiment = True  # agents.experiment_store saves it with the experiment's state

        def __init__(self, *args, keep_running: bool = False, **kwargs):
            super().__init__(*args, **kwargs)
            self.keep_running = keep_running

        def save(self, checkpoint_path: str) -> None:
            """Each trial's last score, last PBT checkpoint (the one an exploiting trial clones) with
            the result it was saved at, and last perturbation, which Tune does not save: a resumed
            run ranked its trials afresh, and a trial cloning a checkpoint saved before the resume
            got no result with it (its restore failed)."""
            import ray
            from ray.train import Checkpoint

            for s in self._trial_state.values():
                # a save PBT scheduled (a top trial's, cloned by no one yet): once it is done, kept as a
                # clone takes it, or none where it failed (said once); one under way is saved as none
                # (its trial's next perturbation saves again)
                future = getattr(s.last_checkpoint, "future", None)
                if future is not None and ray.wait([future], timeout=0)[0]:
                    done = s.last_checkpoint.resolve(block=False)
                    s.last_checkpoint, s.last_result = ((done.checkpoint, done.metrics) if done is not None
                                                        and done.checkpoint is not None else (None, s.last_result))
            write_json(checkpoint_path, {
                "trials": {trial.trial_id: {
                    "last_score": None if s.last_score is None else float(s.last_score),
                    "last_checkpoint": s.last_checkpoint.path if isinstance(s.last_checkpoint, Checkpoint) else None,
                    # the clone's iteration, time and steps go on from it (the trial's config: its own)
                    "last_result": {k: v for k, v in (s.last_result or {}).items()
                                    if k != "config" and not str(k).startswith("config/")} or None,
                    "last_perturbation_time": s.last_perturbation_time, "last_train_time": s.last_train_time,
                } for trial, s in self._trial_state.items()},
                "perturbations": self._num_perturbations, "checkpoints": self._num_checkpoints},
                default=_json_value, skipkeys=True)  # (a result key JSON cannot hold is left out)

        def restore(self, checkpoint_path: str) -> None:
            from ray.train import Checkpoint

            with open(checkpoint_path, encoding="utf-8") as f:
                state = json.load(f)
            for trial, s in self._trial_state.items():  # the trials --resume added again
                # a clone of a checkpoint saved before an earlier resume, by a version that kept no
                # result with it, failed on reading none: the checkpoint's state has its iteration
                cloned = getattr(trial, "latest_checkpoint_result", None)
                if cloned is not None and cloned.metrics is None:
                    cloned.metrics = {}
                saved = state["trials"].get(trial.trial_id)
                if saved:
                    # one deleted since, or saved without its result (an older state), cannot be cloned: none
                    path = saved["last_checkpoint"] if saved.get("last_result") else None
                    s.last_score, s.last_result = saved["last_score"], saved.get("last_result")
                    s.last_checkpoint = Checkpoint(path) if path and os.path.isdir(path) else None
                    s.last_perturbation_time, s.last_train_time = (saved["last_perturbation_time"],
                                                                  saved["last_train_time"])
            self._num_perturbations, self._num_checkpoints = state["perturbations"], state["checkpoints"]

        def on_trial_result(self, tune_controller, trial, result):
            decision = super().on_trial_result(tune_controller, trial, result)
            if self.keep_running and decision == TrialScheduler.PAUSE and trial.status == Trial.RUNNING:
                return TrialScheduler.CONTINUE
            return decision

    KeepRunningPBT.__qualname__ = "KeepRunningPBT"
    globals()["KeepRunningPBT"] = KeepRunningPBT
    return KeepRunningPBT


def __getattr__(name: str):
    if name == "KeepRunningPBT":  # `from agents.pbt import KeepRunningPBT`, and unpickling a scheduler
        return keep_running_pbt_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
