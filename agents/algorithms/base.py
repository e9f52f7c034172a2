"""What an algorithm declares to be usable by name from a YAML config.

Each algorithm's module (agents/algorithms/<name>.py) holds its RLlib config class (typed,
documented hyperparameters with defaults, as RLlib's own configs), its learner and loss, and
one `AlgorithmSpec` subclass instance named `SPEC`: the names configs give it, the `training`
keys it reads, its own YAML section, the checks that involve its options, and its part of the
RLlib `AlgorithmConfig`. `agents/algorithms/__init__.py` lists the modules; agents/schema.py
validates the generic sections and asks the spec for the rest; agents/config.py builds RLlib's
config.

Each hyperparameter is declared once, as a `Param` in a spec's table (`training_params`,
`reward_params`): its YAML field (type, range, default) and the RLlib attribute it sets. The YAML
schema's `training` section is the union of the specs' tables (agents/schema.py), the spec passes
the values to RLlib (`AlgorithmSpec.training`), and the RLlib config class takes its attributes,
defaults and `training()` keywords from the same tables (`DeclaredParams`).
"""
from __future__ import annotations

import functools
import inspect
from typing import NamedTuple

from env.validation import Field, is_search_space

# `training` keys every algorithm reads (the learning rate and its schedule, the batch, the discount, clipping).
# And the learner's precision and gradient checkpointing (refused where `scale_refusal` says why).
COMMON_TRAINING = ("lr", "lr_end", "lr_decay_steps", "train_batch_size", "gamma", "grad_clip", "precision",
                   "gradient_checkpointing")


class Param(NamedTuple):
    """One hyperparameter: its YAML field and the RLlib config attribute (and `training()`
    keyword) it sets; `rllib` None: the YAML key itself."""

    field: Field
    rllib: str | None = None


# The per-token KL penalty against the frozen initial policy (the `reward` section): the
# coefficient, and the adaptive controller's target KL per sequence and horizon in sequences
# (kl_adaptive false: the coefficient stays fixed). PPO's family folds it into the rewards before
# GAE (kl_control.py); DQN adds kl_coef * log p_ref to each step's reward.
REFERENCE_KL = {
    "kl_coef": Param(Field(float, 0.0, lo=0.0), "ref_kl_coef"),
    "kl_adaptive": Param(Field(bool, False), "ref_kl_adaptive"),
    "kl_target": Param(Field(float, 6.0, lo=0.0, lo_open=True), "ref_kl_target"),
    "kl_horizon": Param(Field(int, 10000, lo=1), "ref_kl_horizon"),
}


def pick(table: dict, *keys: str) -> dict:
    """The entries of a Param table an algorithm reads (the same Param objects)."""
    return {k: table[k] for k in keys}


def rllib_fields(*tables: dict) -> dict:
    """RLlib attribute -> Field, over Param tables."""
    return {p.rllib or key: p.field for table in tables for key, p in table.items()}


@functools.cache
def _rllib_training_keywords(config_cls) -> frozenset:
    """The keywords RLlib's own `training()` methods (of `config_cls`'s RLlib bases) take."""
    out = set()
    for klass in config_cls.__mro__:
        if klass.__module__.startswith("ray.") and "training" in vars(klass):
            out |= set(inspect.signature(vars(klass)["training"]).parameters) - {"self", "kwargs"}
    return frozenset(out)


class DeclaredParams:
    """Mixed into an RLlib AlgorithmConfig subclass: every attribute `declared_params()` names
    (RLlib attribute -> Field, from the specs' Param tables) starts at its Field's default and is a
    `training()` keyword; RLlib's own keywords still go through RLlib's `training()`."""

    @classmethod
    def declared_params(cls) -> dict:
        return {}

    def __init__(self, algo_class=None):
        super().__init__(algo_class=algo_class)
        for name, field in self.declared_params().items():
            setattr(self, name, field.default)

    def training(self, **kwargs):
        from ray.rllib.algorithms.algorithm_config import NotProvided

        declared, native = self.declared_params(), _rllib_training_keywords(type(self))
        own = {k: kwargs.pop(k) for k in list(kwargs) if k in declared and k not in native}
        super().training(**kwargs)
        for name, value in own.items():
            if value is not NotProvided:
                setattr(self, name, value)
        return self


class RemoteRunnerStates:
    """Mixed into an RLlib Algorithm subclass: its checkpoints also hold each remote EnvRunner's
    rollout state (RLlib saves the local EnvRunner's only) and, with several learners, each
    learner's generators by rank (RLlib saves learner 0's state and gives it to all); a restore
    gives each runner and each learner its own, so a run with `num_env_runners > 0` or
    `num_learners > 1` resumes where every one of them stood. A checkpoint Tune saves ends with
    the list of its files (`agents.whole_files.MANIFEST`): a resume checks the newest one with it."""

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        from agents.whole_files import write_manifest

        super().save_checkpoint(checkpoint_dir)
        write_manifest(checkpoint_dir)

    def get_state(self, components=None, *, not_components=None, **kwargs):
        from agents.core import LEARNER_RNGS, REMOTE_RUNNERS, ROLLOUT_STATE, state_requested

        state = super().get_state(components, not_components=not_components, **kwargs)
        group = getattr(self, "env_runner_group", None)
        if group is not None and group.num_remote_workers() and state_requested(REMOTE_RUNNERS, components,
                                                                                not_components):
            state[REMOTE_RUNNERS] = dict(group.foreach_env_runner(
                lambda r: (r.worker_index, r.get_state(components=ROLLOUT_STATE)), local_env_runner=False))
        learners = getattr(self, "learner_group", None)
        if learners is not None and learners.is_remote and state_requested(LEARNER_RNGS, components, not_components):
            saved = [_value(r) for r in learners.foreach_learner(_learner_generators)]
            state[LEARNER_RNGS] = {s["rank"]: s for s in saved if s is not None}
        return state

    def set_state(self, state) -> None:
        from agents.core import LEARNER_RNGS, REMOTE_RUNNERS

        super().set_state(state)
        saved, group = state.get(REMOTE_RUNNERS), getattr(self, "env_runner_group", None)
        if saved and group is not None and group.num_remote_workers():
            def restore(runner):
                if runner.worker_index in saved:  # a runner added since starts from its seed
                    runner.set_state(saved[runner.worker_index])

            group.foreach_env_runner(restore, local_env_runner=False)
        generators, learners = state.get(LEARNER_RNGS), getattr(self, "learner_group", None)
        if generators and learners is not None and learners.is_remote:
            # after RLlib gave every learner learner 0's state (the subcomponents come first)
            for result in learners.foreach_learner(_restore_learner_generators, generators=generators):
                _value(result)


def _value(result):
    """A learner call's value; its error raised (RLlib's `CallResult.get` returns it)."""
    if not result.ok:
        raise result.get()
    return result.get()


def _learner_generators(learner):
    """A learner's generators with its rank (`TokenLearner._rng_state`), or None for a learner
    without them."""
    get = getattr(learner, "_rng_state", None)
    return None if get is None else get()


def _restore_learner_generators(learner, generators: dict) -> None:
    """Gives a learner the generators saved for its rank (`TokenLearner.restore_generators`)."""
    restore = getattr(learner, "restore_generators", None)
    if restore is not None:
        restore(generators)


def candidates(value) -> list:
    """The values a config leaf may take: a search space's list, or the value itself."""
    return next(iter(value.values())) if is_search_space(value) else [value]


def plain(value):
    """A representative plain value for cross-field checks (first candidate of a search space)."""
    return candidates(value)[0]


def adam(params: list, learner):
    """Adam over `params` as the learners build it: one fused kernel per step where torch has one
    for the parameters' device (CPU, CUDA; on the quickstart's 30 tensors 0.19 ms a step against
    0.75 ms for the per-tensor loop, idle), the multi-tensor loop under fp16's loss scaler (which
    unscales the gradients before the step) and elsewhere. Same update, same state dict; a restored
    optimizer state brings the kernel choice it was saved with (torch keeps the saved group flags).
    With `training.update_clipping`, StableAdamW's update clipping hooks its step."""
    import torch

    fused = (getattr(learner, "_grad_scalers", None) is None
             and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params))
    optimizer = torch.optim.Adam(params, fused=True) if fused else torch.optim.Adam(params, foreach=True)
    if getattr(learner.config, "update_clipping", False):  # training.update_clipping
        from agents.algorithms.gradients import UpdateClipping

        UpdateClipping(optimizer)
    return optimizer


def use_configured_lr(learner) -> None:
    """Sets each optimizer of `learner` to its module's configured lr, when that is a constant.
    A restored optimizer state carries the lr it was saved with, and RLlib applies the config's
    lr only after the next update: a trial restored with another lr (PBT's exploit) would take
    its first iteration at the checkpoint's. A schedule keeps the restored (scheduled) value."""
    for module_id in learner.module.keys():
        lr = learner.config.get_config_for_module(module_id).lr
        if isinstance(lr, bool) or not isinstance(lr, (int, float)):
            continue
        for _name, optimizer in learner.get_optimizers_for_module(module_id):
            for group in optimizer.param_groups:
                group["lr"] = float(lr)


def _same_seed(spec) -> int:
    return spec.config["seed"]


def module_seed(cfg: dict, c: dict):
    """The seed of the module's initialisation (and of the guided algorithms' LOLS coin): the
    config's; a searched seed is drawn once (the algorithm's) and this one follows it."""
    if is_search_space(cfg["seed"]):
        from ray import tune

        return tune.sample_from(_same_seed)
    return c["seed"]


class AlgorithmSpec:
    names: tuple[str, ...] = ()  # the values of `algorithm:` this spec serves
    summary: str = ""  # one line: what it is
    # Algorithm names a Tune search over `algorithm` may mix with these (they run as this spec's
    # RLlib algorithm, e.g. plain PPO inside a sweep over the guided algorithms).
    search_with: tuple[str, ...] = ()
    training_params: dict[str, Param] = {}  # the `training` keys it reads beyond COMMON_TRAINING
    reward_params: dict[str, Param] = {}  # the `reward` keys it passes to RLlib
    section: str | None = None  # its own YAML section (e.g. `dqn`), refused with other algorithms
    schema: dict[str, Field] = {}  # that section's fields
    section_searchable: bool = True  # its fields may be Tune search spaces
    seq2seq: bool = False  # an encoder-decoder version of its module exists
    # True: samples whole episodes (the fast EnvRunner can serve it); False: n-step fragments.
    whole_episodes: bool = True
    # Why truncation samplers (the `sampler` section) do not apply to it; None: they do.
    sampler_refusal: str | None = None
    kl_adaptive: bool = True  # reward.kl_adaptive applies
    # Why LoRA, reduced precision and gradient checkpointing do not apply to it; None: they do.
    scale_refusal: str | None = None

    @property
    def training_keys(self) -> tuple[str, ...]:
        return tuple(self.training_params)

    def config_class(self):
        """The RLlib AlgorithmConfig subclass (imported on use)."""
        raise NotImplementedError

    def module_class(self, encoder_decoder: bool):
        from agents.modules import CausalLMActorCritic
        from agents.modules.seq2seq import Seq2SeqActorCritic

        return Seq2SeqActorCritic if encoder_decoder else CausalLMActorCritic

    def check(self, raw: dict, cfg: dict) -> None:
        """Cross-field checks of its options (raise ConfigError naming the field)."""

    def env_config(self, cfg: dict, c: dict, env_cfg: dict) -> dict:
        """The EnvRunners' env config (e.g. prompts repeated for a per-prompt baseline)."""
        return env_cfg

    def module_config(self, cfg: dict, c: dict) -> dict:
        """Entries of the RLModule's model_config beyond the generic ones."""
        return {}

    def training(self, cfg: dict, c: dict) -> dict:
        """Keyword arguments of its config class's `training()` beyond COMMON_TRAINING: its
        `training_params` and `reward_params` under their RLlib names (c: the config with search
        spaces as Tune objects)."""
        return {**{p.rllib or k: c["training"][k] for k, p in self.training_params.items()},
                **{p.rllib or k: c["reward"][k] for k, p in self.reward_params.items()}}

    def configure(self, config, cfg: dict, c: dict) -> None:
        """Anything else on the RLlib config (callbacks, reporting)."""

