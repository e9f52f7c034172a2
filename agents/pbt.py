"""Tune's Population Based Training as agents.train runs it (`tune.scheduler: pbt`; the YAML
keys are checked and turned into Tune's mutations in agents/config.py)."""
from __future__ import annotations

from ray.tune.experiment import Trial
from ray.tune.schedulers import PopulationBasedTraining, TrialScheduler


class KeepInBounds:
    """PBT's explore step (Tune's `custom_explore_fn`): a value multiplied by 0.8 or 1.2 past its
    search space's bounds is clipped back to them (Tune itself lets it drift out)."""

    def __init__(self, bounds: dict):
        self.bounds = bounds

    def __call__(self, config: dict) -> dict:
        for name, (low, high) in self.bounds.items():
            config[name] = min(max(config[name], low), high)
        return config


class KeepRunningPBT(PopulationBasedTraining):
    """Tune's PopulationBasedTraining, without pausing trials that need not wait.

    Tune pauses a trial that reaches a perturbation while another trial is paused or pending,
    so that a population larger than the cluster takes turns. A paused RLlib trial is a stopped
    actor: it saves a checkpoint and comes back in a new process that builds the model, env and
    learner again and restores it. With `keep_running` (agents.train.run: the whole population
    fits at once, in tune.max_concurrent_trials and in the cluster) the trial waiting is one that
    PBT paused to clone another, and it has a slot of its own: the others go on."""

    def __init__(self, *args, keep_running: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.keep_running = keep_running

    def on_trial_result(self, tune_controller, trial, result):
        decision = super().on_trial_result(tune_controller, trial, result)
        if self.keep_running and decision == TrialScheduler.PAUSE and trial.status == Trial.RUNNING:
            return TrialScheduler.CONTINUE
        return decision
