"""The vocabulary every input check of the project speaks: `ConfigError` (one line that
names the field), `Field` (a typed leaf with its default and range), `unknown_key` and
`unknown_name` (the "unknown key / reward / task, did you mean" lines) and `check_keywords`
(a config section checked against the constructor or factory it feeds: unknown keys, missing
ones, the values of simply annotated parameters). Experiment configs (agents/config.py), each algorithm's section
(agents/algorithms/), warm-start configs (agents/pretrain.py), reward specs
(env/rewards/base.py) and task options (env/tasks/) use them; it lives in env/, the lower
layer, so that env/ needs nothing from agents/."""
from __future__ import annotations

import difflib
import inspect
import math
import os


class ConfigError(ValueError):
    """A config problem, reported as one line naming the field."""


class Field:
    """A typed config leaf: `kind` (int, float, bool, str, dict, list, or a tuple of them: any one),
    its default, an optional range (`lo`, `hi`, `lo_open`) or `choices`, and whether null is allowed."""

    _NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping",
              list: "a list"}

    def __init__(self, kind, default=None, *, lo=None, hi=None, lo_open=False, choices=None, optional=False):
        self.kind, self.default = kind, default
        self.lo, self.hi, self.lo_open, self.choices, self.optional = lo, hi, lo_open, choices, optional

    def __repr__(self):
        return f"Field({self.describe()}{', or null' if self.optional else ''}, default {self.default!r})"

    def describe(self, finite: bool = False) -> str:
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if isinstance(self.kind, tuple):
            return " or ".join(self._one(k).describe(finite) for k in self.kind)
        name = self._NAMES[self.kind]
        if finite and self.kind is float:
            name = "a finite number"
        if self.lo is not None and self.hi is not None:
            return f"{name} in {'(' if self.lo_open else '['}{self.lo}, {self.hi}]"
        if self.lo is not None:
            return f"{name} {'>' if self.lo_open else '>='} {self.lo}"
        return name

    def check(self, path: str, value, error: type = ConfigError):
        """The value as the field holds it (a float for a number), or `error`:
        `path: expected <describe>, got <value>`."""
        value, problem = self.checked(value)
        if problem:
            raise error(f"{path}: {problem}")
        return value

    def checked(self, value) -> tuple:
        """(the value as the field holds it, None), or (the value, "expected ..., got ...")."""
        if value is None and self.optional:
            return None, None
        if isinstance(self.kind, tuple):
            for kind in self.kind:
                held, problem = self._one(kind).checked(value)
                if problem is None:
                    return held, None
            return value, f"expected {self.describe(_not_finite(value))}, got {value!r}"
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
            return value, f"expected {self.describe(_not_finite(value))}, got {value!r}"
        return value, None

    def _one(self, kind) -> "Field":
        return Field(kind, lo=self.lo, hi=self.hi, lo_open=self.lo_open, choices=self.choices)


def _not_finite(value) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


F = Field
POS_INT, NONNEG_INT = dict(lo=1), dict(lo=0)


def unknown_key(path: str, key: str, known, error: type = ConfigError, what: str = "unknown key") -> Exception:
    """`path.key: unknown key (did you mean 'x'?)`, or the known keys when none is close."""
    hint = difflib.get_close_matches(str(key), [str(k) for k in known], n=1)
    suffix = f" (did you mean {hint[0]!r}?)" if hint else f" (known: {', '.join(sorted(map(str, known))) or 'none'})"
    return error(f"{path + '.' if path else ''}{key}: {what}{suffix}")


def unknown_name(where: str, what: str, name, known, or_else: str = "", error: type = ConfigError) -> Exception:
    """`where: unknown <what> 'x' (did you mean 'y'?)`, or the known names (then `or_else`, another
    way to name one) when none is close: an unknown reward or task name."""
    known = sorted({str(k) for k in known})
    hint = difflib.get_close_matches(str(name), known, n=1)
    suffix = f" (did you mean {hint[0]!r}?)" if hint else \
        f" (known: {', '.join(known) or 'none'}{'; ' + or_else if or_else else ''})"
    return error(f"{where}: unknown {what} {name!r}{suffix}")


_ANNOTATED_KINDS = {"bool": bool, "int": int, "float": float, "str": str, "list": list, "dict": dict}


def annotation_field(annotation, default=inspect.Parameter.empty) -> Field | None:
    """The Field a parameter's annotation describes: a Field itself, or a simple type or union of
    them ('float', 'int | None', 'str | int | None', 'list | None', or the types). Null passes
    where the annotation includes None or the default is None. None (no check) for any other
    annotation (`list[str]`, `Optional[int]`, a class) or none."""
    if isinstance(annotation, Field):
        return annotation
    if annotation is inspect.Parameter.empty:
        return None
    if not isinstance(annotation, str):
        annotation = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    parts = [p.strip() for p in annotation.split("|")]
    kinds = [p for p in parts if p != "None"]
    if not kinds or not all(k in _ANNOTATED_KINDS for k in kinds):
        return None
    kind = _ANNOTATED_KINDS[kinds[0]] if len(kinds) == 1 else tuple(_ANNOTATED_KINDS[k] for k in kinds)
    return Field(kind, optional="None" in parts or default is None)


def check_keywords(fn, options: dict, path: str, owner: str, *, error: type = ConfigError,
                   aliases: dict | None = None, supplied: dict | None = None) -> dict:
    """The keyword arguments to call `fn` (the constructor or factory a config section feeds, or
    its `inspect.Signature`) with, from the section's keys `options`, each checked against fn's
    signature:

        path.key: unknown key for <owner> (did you mean 'x'?)     fn has no such parameter
        path.key: expected a number, got 'big'                    the parameter's annotation (Field)
        path.key: missing (<owner> needs it)                      no default, and not given

    `owner` names what the section builds ("reward 'bleu'", "task 'imdb'"). `aliases` maps config
    keys to parameter names (`lambda` -> `lambda_`); `supplied` holds values the caller passes
    to parameters the section leaves out (a task's `max_new_tokens`), only where fn names them.
    A function taking **kwargs gets its other keys unchecked; one without a signature gets the
    section as it is. Annotations are checked by `annotation_field` (others pass through)."""
    aliases = aliases or {}
    try:
        params = (fn if isinstance(fn, inspect.Signature) else inspect.signature(fn)).parameters
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return dict(options)
    named = {k: p for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    back = {param: key for key, param in aliases.items()}
    known = [back.get(k, k) for k in named]
    kwargs = {}
    for key, value in options.items():
        param = aliases.get(key, key)
        if param not in named or back.get(key, key) != key:  # `lambda_` is written `lambda`
            if not takes_any:
                raise unknown_key(path, key, known, error, f"unknown key for {owner}")
            kwargs[param] = value
            continue
        field = annotation_field(named[param].annotation, named[param].default)
        kwargs[param] = value if field is None else field.check(f"{path}.{key}", value, error)
    for param, value in (supplied or {}).items():
        if param in named and param not in kwargs:
            kwargs[param] = value
    for param, p in named.items():
        if p.default is p.empty and param not in kwargs:
            raise error(f"{path}.{back.get(param, param)}: missing ({owner} needs it)")
    return kwargs


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


def local_path_problem(name) -> str | None:
    """What is wrong with a model or tokenizer name written as a local path: a file where a
    `save_pretrained` directory is meant, or a path that does not exist; None otherwise."""
    if isinstance(name, str) and os.path.isfile(os.path.expanduser(name)):
        return f"{name!r} is a file; expected a save_pretrained directory or a hub name"
    if missing_local_path(name):
        return f"no such directory {name!r}"
    return None


def missing_local_path(name) -> bool:
    """A name written as a local path that does not exist, so the error says "no such directory",
    not the hub's words."""
    return isinstance(name, str) and not os.path.exists(os.path.expanduser(name)) and written_as_path(name)


def directory_error(field: str, path: str) -> str | None:
    """Why `path` cannot be (or become) a directory, naming `field` (a file stands at it or above
    it, or it is a URI such as s3://: Tune's copies here are to a file system), or None."""
    if "://" in path:
        return (f"{field}: {path} is a URI; give a directory (on a cluster, one on a file system every "
                "node mounts)")
    here = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(here) and not os.path.isdir(here):
        return f"{field}: {here} is a file, not a directory"
    while not os.path.exists(here):
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        return f"{field}: {here} is a file, so {path} cannot be a directory"
    return None
