"""The reward registry, its config checks and the guard every built reward runs behind.

A reward is `reward(prompts, generations, metas) -> list[float]` (batched, pure).
Rewards that compare with references read them from each example's meta:
`meta["references"]` (a list of strings) or `meta["reference"]` (one string).
Rewards that need a source other than the prompt (MMI) read `meta["source"]`.

`make_reward(spec)` builds one from a config mapping:

    {name: bleu, tokenize: intl}                       one reward and its fields
    {sum: [{name: bleu, weight: 0.5},
           {name: vader, weight: 0.5}]}                a weighted sum (terms may be sums)
    {name: "my_rewards:keyword_reward"}                your own function, by its import path

A name with a colon is `module:function`: the module is imported (it must be on the
Python path of every process that builds the reward) and the function is called as
`function(prompts, generations, metas) -> list[float]`; its keyword-only parameters
become config fields, as for `register_function`. A name without a colon that is not
built in may be registered by an installed package (entry-point group `tokenmdp.rewards`,
see env/plugins.py).

Building checks the spec (names, fields, field types and values) and loads no
model: models load on the first call (or on `.load()`), once per process. The fields are
checked against the factory's signature by env/validation.py's `check_keywords`, as a task's
keys are (unknown and missing keys; values by their annotation's `Field`).
Config mistakes raise `RewardConfigError` (a `ConfigError`), one line naming the field
(`reward.sum[1].weight: missing ...`). A reward that raises, returns the wrong
number of values or a NaN/inf raises `RewardError` naming the reward and the
generation (and prompt) that caused it.
"""
from __future__ import annotations

import inspect
import math
import re

from env.plugins import entry_point_names, import_object, load_entry_point
from env.validation import ConfigError, Field, check_keywords, local_path_problem, unknown_name


class RewardConfigError(ConfigError):
    """A reward config problem, one line naming the field."""


class FieldError(ValueError):
    """Raised by a reward's constructor for a bad value of one of its fields."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


class RewardError(ValueError):
    """A reward failed or returned a non-finite value; the message names the reward and the text."""


REWARDS: dict[str, object] = {}  # name -> factory (a class, or a function returning a reward)


def register(name: str, factory=None):
    """Registers `factory(**fields) -> reward` under `name` (usable as a class decorator)."""
    def add(f):
        old = REWARDS.get(name)
        same = old is not None and (getattr(old, "__module__", None), getattr(old, "__qualname__", None)) == (
            getattr(f, "__module__", None), getattr(f, "__qualname__", None))
        if old is not None and not same:  # the same definition again is a module reload
            raise ValueError(f"reward {name!r} is already registered")
        REWARDS[name] = f
        return f
    return add(factory) if factory is not None else add


def register_function(name: str, fn):
    """Registers a plain reward function; its keyword-only parameters become its config fields."""
    return register(name, _function_factory(name, fn))


def _function_factory(name: str, fn):
    """`factory(**fields) -> reward` for a plain function; its keyword-only parameters are the fields."""
    params = [p for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY]

    def factory(**fields):
        return _BoundFunction(fn, name, fields)

    factory.__signature__ = inspect.Signature(params)
    factory.__doc__ = fn.__doc__
    return factory


def import_reward_function(spec: str, path: str = "reward"):
    """The function named by `module:function`; RewardConfigError (one line naming `path.name`) if it is
    not there or does not take `(prompts, generations, metas)`."""
    fn = import_object(spec, f"{path}.name", RewardConfigError, "function", "a registered reward or 'module:function'")
    if not callable(fn):
        raise RewardConfigError(f"{path}.name: {spec!r} is not callable (it is a {type(fn).__name__})")
    check_reward_signature(fn, spec, f"{path}.name")
    return fn


def check_reward_signature(fn, label: str, where: str) -> None:
    """Refuses a function that cannot be called as `fn(prompts, generations, metas, **fields)`."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    required = [p for p in positional if p.default is p.empty]
    if (len(positional) < 3 and not varargs) or len(required) > 3:
        shown = ", ".join(p.name for p in params) or "nothing"
        raise RewardConfigError(f"{where}: {label!r} must take (prompts, generations, metas) and its config fields "
                                f"as keyword-only parameters; it takes ({shown})")


class _BoundFunction:
    def __init__(self, fn, name, fields):
        self.fn, self.name, self.fields = fn, name, fields
        self.loads_model = getattr(fn, "loads_model", None)  # `fn.loads_model = True`: train does not try it

    def __call__(self, prompts, generations, metas):
        return self.fn(prompts, generations, metas, **self.fields)


# -- helpers for reward implementations ------------------------------------------------

def references_of(meta: dict) -> list[str]:
    """The reference texts of one example: `meta["references"]` (list) or `meta["reference"]` (str)."""
    refs = (meta or {}).get("references", (meta or {}).get("reference"))
    if refs is None:
        raise ValueError("needs references: the example's meta has no 'references' (a list of strings) "
                         "or 'reference' (a string)")
    if isinstance(refs, str):
        refs = [refs]
    refs = list(refs)
    if not refs or not all(isinstance(r, str) for r in refs):
        raise ValueError(f"meta['references'] must be a non-empty list of strings, got {refs!r}")
    return refs


def resolve_device(device: str) -> str:
    """A reward model's device in the process that scores: 'auto' is its GPU if it has one."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"reward device: {device!r}, but the process that scores (an EnvRunner) has no "
                         "CUDA device; set device: auto or cpu, or give the EnvRunners a GPU")
    return device


# A built-in reward's fields naming a model or tokenizer (checked as paths before anything loads).
MODEL_FIELDS = re.compile(r"(.*_)?(model|tokenizer)")


def field_problem(key: str, value) -> str | None:
    """What is wrong with a built-in reward's `device` or model/tokenizer field, found without
    loading anything (a CUDA device is looked for where the reward scores, not here: a driver
    without a GPU may start EnvRunners that have one); None if nothing."""
    if key == "device" and value != "auto":
        import torch

        try:
            torch.device(value)
        except (RuntimeError, TypeError):
            return f"expected 'auto' or a torch device ('cpu', 'cuda', 'cuda:1', 'mps', ...), got {value!r}"
    if MODEL_FIELDS.fullmatch(key):
        return local_path_problem(value)
    return None


def check_field(field: str, value, kind, **bounds):
    """A reward constructor's check of one of its fields by env/validation's `Field(kind, **bounds)`:
    the value as the field holds it, or FieldError naming the field ("expected an integer >= 1, got 0")."""
    value, problem = Field(kind, **bounds).checked(value)
    if problem:
        raise FieldError(field, problem)
    return value


def check_choice(field: str, value, choices) -> None:
    check_field(field, value, type(choices[0]), choices=tuple(choices))


def check_positive(field: str, value) -> None:
    check_field(field, value, float, lo=0, lo_open=True)


# -- the guard ---------------------------------------------------------------------------

class CheckedReward:
    """Runs a reward and refuses what must not reach training: exceptions, wrong counts, NaN/inf.

    Errors name the reward (`label`) and the generation that caused them. When a batch
    raises, each example is scored alone to find the one that fails.
    """

    def __init__(self, reward, label: str):
        self.reward, self.label = reward, label
        self.name = getattr(reward, "name", label)
        self.higher_is_better = getattr(reward, "higher_is_better", True)
        self._loaded = False

    def load(self):
        """Loads the reward's models now (else the first call does)."""
        if not self._loaded:
            loader = getattr(self.reward, "load", None)
            if loader is not None:
                try:
                    loader()
                except RewardError:
                    raise
                except Exception as e:
                    raise RewardError(f"reward {self.label}: could not load its model: "
                                      f"{type(e).__name__}: {e}") from e
            self._loaded = True
        return self

    def __call__(self, prompts, generations, metas=None) -> list[float]:
        prompts, generations = list(prompts), list(generations)
        metas = [{} for _ in generations] if metas is None else [m if m is not None else {} for m in metas]
        if not len(prompts) == len(generations) == len(metas):
            raise RewardError(f"reward {self.label}: got {len(prompts)} prompts, {len(generations)} generations "
                              f"and {len(metas)} metas; they must be equally many")
        if not generations:
            return []
        self.load()
        try:
            values = self.reward(prompts, generations, metas)
            if (values is None or isinstance(values, (str, bytes)) or not hasattr(values, "__iter__")
                    or getattr(values, "ndim", None) == 0):  # a 0-d array or tensor: one number
                raise RewardError(f"reward {self.label}: returned {values!r:.80}; expected a list of one number "
                                  f"per generation ({len(generations)})")  # a missing `return`, one number, ...
            values = list(values)  # a generator runs here: its errors are the reward's
        except RewardError:
            raise  # a term of a sum, already named
        except Exception as e:
            raise self._blame(e, prompts, generations, metas) from e
        if len(values) != len(generations):
            raise RewardError(f"reward {self.label}: returned {len(values)} values for {len(generations)} "
                              f"generations (first: {generations[0]!r})")
        out = []
        for value, prompt, text in zip(values, prompts, generations):
            try:
                if isinstance(value, (str, bytes)):  # float("1") would take it
                    raise TypeError
                value = float(value)
            except (TypeError, ValueError):
                raise RewardError(f"reward {self.label}: returned {value!r}, not a number, for generation "
                                  f"{text!r} (prompt {prompt!r})") from None
            if not math.isfinite(value):
                raise RewardError(f"reward {self.label}: returned {value} for generation {text!r} "
                                  f"(prompt {prompt!r})")
            out.append(value)
        return out

    def _blame(self, error, prompts, generations, metas) -> RewardError:
        for prompt, text, meta in zip(prompts, generations, metas):
            try:
                out = self.reward([prompt], [text], [meta])
                if hasattr(out, "__iter__") and not isinstance(out, (str, bytes)):
                    list(out)  # a generator's errors come as it runs
            except Exception as e:
                return RewardError(f"reward {self.label}: failed on generation {text!r} (prompt {prompt!r}): "
                                   f"{type(e).__name__}: {e}")
        return RewardError(f"reward {self.label}: failed on a batch of {len(generations)} generations, though "
                           f"each scores alone (first: {generations[0]!r}): {type(error).__name__}: {error}")

    def __repr__(self):
        return f"CheckedReward({self.label})"


class WeightedSum:
    """sum_i weight_i * reward_i, each term a `CheckedReward` (so a failing term is named)."""

    name = "sum"

    def __init__(self, terms: list[tuple[float, CheckedReward]]):
        self.terms = terms

    def load(self):
        for _, reward in self.terms:
            reward.load()

    def __call__(self, prompts, generations, metas):
        total = [0.0] * len(generations)
        for weight, reward in self.terms:
            for i, value in enumerate(reward(prompts, generations, metas)):
                total[i] += weight * value
        return total


def loads_models(reward) -> bool:
    """Whether scoring with a built reward (`make_reward`'s) may load a model: a term that says so
    (`loads_model`), or one with a `load` that does not say otherwise."""
    inner = getattr(reward, "reward", reward)  # a CheckedReward's own
    if isinstance(inner, WeightedSum):
        return any(loads_models(term) for _, term in inner.terms)
    says = getattr(inner, "loads_model", None)
    return bool(says) if says is not None else getattr(inner, "load", None) is not None


# -- building from a config -----------------------------------------------------------

def make_reward(spec, path: str = "reward") -> CheckedReward:
    """Builds a reward from its config mapping (see the module docstring). Loads no model."""
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict):
        raise RewardConfigError(f"{path}: expected a mapping like {{name: bleu}} or {{sum: [...]}}, got {spec!r}")
    if "sum" in spec:
        extra = [k for k in spec if k != "sum"]
        if extra:
            raise RewardConfigError(f"{path}.{extra[0]}: a sum takes only 'sum' (put fields on its terms)")
        terms = spec["sum"]
        if not isinstance(terms, list) or not terms:
            raise RewardConfigError(f"{path}.sum: expected a non-empty list of {{name: ..., weight: ...}}, "
                                    f"got {terms!r}")
        built = []
        for i, term in enumerate(terms):
            where = f"{path}.sum[{i}]"
            if not isinstance(term, dict):
                raise RewardConfigError(f"{where}: expected a mapping {{name: ..., weight: ...}}, got {term!r}")
            if "weight" not in term:
                raise RewardConfigError(f"{where}.weight: missing (every term of a sum needs a weight)")
            weight = Field(float).check(f"{where}.weight", term["weight"], RewardConfigError)
            rest = {k: v for k, v in term.items() if k != "weight"}
            built.append((weight, make_reward(rest, where)))
        return CheckedReward(WeightedSum(built), f"'sum' ({path})")
    if "name" not in spec:
        raise RewardConfigError(f"{path}.name: missing (one of {', '.join(sorted(REWARDS))}, 'module:function', "
                                f"or give 'sum')")
    name = spec["name"]
    installed = None
    if isinstance(name, str) and ":" not in name and name not in REWARDS:
        installed = load_entry_point("reward", name, f"{path}.name", RewardConfigError)
    if isinstance(name, str) and ":" in name:
        factory = _function_factory(name, import_reward_function(name, path))
    elif installed is not None:  # registered by an installed package: a reward class (factory) or a function
        if inspect.isclass(installed):
            factory = installed
        elif callable(installed):
            check_reward_signature(installed, name, f"{path}.name")
            factory = _function_factory(name, installed)
        else:
            raise RewardConfigError(f"{path}.name: the installed reward {name!r} is not callable "
                                    f"(it is a {type(installed).__name__})")
    elif name not in REWARDS:
        raise unknown_name(f"{path}.name", "reward", name, {*REWARDS, *entry_point_names("reward")},
                           "or your own function as 'module:function'", RewardConfigError)
    else:
        factory = REWARDS[name]
    aliases = getattr(factory, "FIELD_ALIASES", {})  # YAML key -> parameter (e.g. lambda -> lambda_)
    fields = {k: v for k, v in spec.items() if k != "name"}
    kwargs = check_keywords(factory, fields, path, f"reward {name!r}", error=RewardConfigError, aliases=aliases)
    back = {v: k for k, v in aliases.items()}
    try:
        for key, value in kwargs.items() if factory is REWARDS.get(name) else ():  # a plugin's fields are its own
            problem = field_problem(key, value)
            if problem:
                raise FieldError(key, problem)
        reward = factory(**kwargs)
    except FieldError as e:
        raise RewardConfigError(f"{path}.{back.get(e.field, e.field)}: {e.message}") from None
    return CheckedReward(reward, f"{name!r} ({path})")
