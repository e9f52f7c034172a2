"""The vocabulary every input check of the project speaks: `ConfigError` (one line that
names the field), `Field` (a typed leaf with its default and range) and `unknown_key`
(the "unknown key, did you mean" line). Experiment configs (agents/config.py), each
algorithm's section (agents/algorithms/), warm-start configs (agents/pretrain.py) and
reward specs (env/rewards/base.py) and task options (env/tasks/) use them; it lives in env/,
the lower layer, so that env/ needs nothing from agents/."""
from __future__ import annotations

import difflib
import math
import os


class ConfigError(ValueError):
    """A config problem, reported as one line naming the field."""


class Field:
    def __init__(self, kind, default=None, *, lo=None, hi=None, lo_open=False, choices=None, optional=False):
        self.kind, self.default = kind, default
        self.lo, self.hi, self.lo_open, self.choices, self.optional = lo, hi, lo_open, choices, optional

    def describe(self) -> str:
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        name = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping",
                list: "a list"}[self.kind]
        if self.lo is not None and self.hi is not None:
            return f"{name} in {'(' if self.lo_open else '['}{self.lo}, {self.hi}]"
        if self.lo is not None:
            return f"{name} {'>' if self.lo_open else '>='} {self.lo}"
        return name

    def check(self, path: str, value):
        if value is None and self.optional:
            return None
        if self.kind is float and isinstance(value, str):
            try:  # YAML 1.1 reads "1e-3" (no dot) as a string
                value = float(value)
            except ValueError:
                pass
        ok_type = {
            int: isinstance(value, int) and not isinstance(value, bool),
            float: isinstance(value, (int, float)) and not isinstance(value, bool),
            bool: isinstance(value, bool),
            str: isinstance(value, str),
            dict: isinstance(value, dict),
            list: isinstance(value, list),
        }[self.kind]
        if self.kind is float and ok_type:
            value = float(value)
            ok_type = math.isfinite(value)
        bad = not ok_type
        if not bad and self.choices is not None and value not in self.choices:
            bad = True
        if not bad and self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)):
            bad = True
        if not bad and self.hi is not None and value > self.hi:
            bad = True
        if bad:
            raise ConfigError(f"{path}: expected {self.describe()}, got {value!r}")
        return value


F = Field
POS_INT, NONNEG_INT = dict(lo=1), dict(lo=0)


def unknown_key(path: str, key: str, known, error: type = ConfigError, what: str = "unknown key") -> Exception:
    """`path.key: unknown key (did you mean 'x'?)`, or the known keys when none is close."""
    hint = difflib.get_close_matches(str(key), [str(k) for k in known], n=1)
    suffix = f" (did you mean {hint[0]!r}?)" if hint else f" (known: {', '.join(sorted(map(str, known))) or 'none'})"
    return error(f"{path + '.' if path else ''}{key}: {what}{suffix}")


SEARCH_SPACES = ("grid_search", "choice", "uniform", "loguniform", "randint")


def is_search_space(value) -> bool:
    """A YAML Tune search space: `{grid_search: [..]}`, `{choice: [..]}`, `{uniform: [lo, hi]}`, ..."""
    return isinstance(value, dict) and len(value) == 1 and next(iter(value)) in SEARCH_SPACES


def first_line(e: BaseException) -> str:
    """An exception's message cut to its first line (its type's name if it has none), for one-line errors."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def written_as_path(name: str) -> bool:
    """Whether a model or data name is written as a local path (`/`, `./`, `../`, `~`, or two or
    more `/`): never a hub name (`org/name`), whether or not it exists."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") >= 2 or "\\" in name


def missing_local_path(name) -> bool:
    """A name written as a local path that does not exist, so the error says "no such directory",
    not the hub's words."""
    return isinstance(name, str) and not os.path.exists(os.path.expanduser(name)) and written_as_path(name)
