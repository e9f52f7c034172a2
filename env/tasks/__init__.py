"""Tasks: where prompts (and references) come from, and which reward scores them.

A task has `name`, `examples(split) -> [{"prompt": str, "meta": dict}]`,
`reward(prompts, generations, metas) -> [float]`, and `tokenizer()` (its own
tokenizer, or None to use the model's); optionally `targets(example) -> [str]` (the
reference continuations the MLE term learns from) and `metrics` (names, for evaluation).

`task.name` is a built-in task, your own class as `module:Class` (the module must import in
every process, like a reward's), or a name an installed package registers under the
entry-point group `tokenmdp.tasks` (env/plugins.py).

Every task, built-in or not, takes the section's other keys as its constructor's keyword
arguments, checked first by env/validation.py's `check_keywords` (as a reward's fields are):
an unknown key, a missing one or a value of the wrong type is one line naming `task.<key>`.
`check_task` makes those checks without building the task (no data read, no model loaded).
"""
from __future__ import annotations

import inspect
import warnings

from env.tasks.combination_lock import CombinationLockTask
from env.tasks.increasing_numbers import IncreasingNumbersTask
from env.tasks.sort_numbers import SortNumbersTask
from env.tasks.text_tasks import TEXT_TASKS  # imdb, commongen, dialogue, summarization, text (data sets)
from env.validation import ConfigError, check_keywords, first_line, unknown_name

# `python -m env.tasks.sort_numbers OUT_DIR` (its data files) runs a module this package imports:
# runpy's warning about that (given once the package has imported) is harmless here, since the
# second copy only writes the files
warnings.filterwarnings("ignore", message=r"'env\.tasks\.\w+' found in sys\.modules after import of package",
                        category=RuntimeWarning)

TASKS = {IncreasingNumbersTask.name: IncreasingNumbersTask, CombinationLockTask.name: CombinationLockTask,
         SortNumbersTask.name: SortNumbersTask, **TEXT_TASKS}


TASK_METHODS = ("examples", "reward", "tokenizer")  # what every task has (see the module docstring)


def task_class(name, where: str = "task.name"):
    """The task class a config names: a built-in name, 'module:Class', or an installed package's
    entry point (group `tokenmdp.tasks`). ConfigError (a ValueError) naming `where` otherwise."""
    from env.plugins import entry_point_names, import_object, load_entry_point

    if isinstance(name, str) and ":" in name:
        cls = import_object(name, where, ConfigError, "task class", "a known task or 'module:Class'")
    elif isinstance(name, str) and name in TASKS:
        return TASKS[name]
    else:
        cls = load_entry_point("task", name, where, ConfigError) if isinstance(name, str) else None
        if cls is None:
            raise unknown_name(where, "task", name, {*TASKS, *entry_point_names("task")},
                               "or your own class as 'module:Class'")
    if not callable(cls):
        raise ConfigError(f"{where}: {name!r} is not a task class (it is a {type(cls).__name__})")
    if inspect.isclass(cls):  # a factory function is checked on what it returns
        require_task_methods(cls, name, where)
    return cls


def require_task_methods(obj, name: str, where: str = "task.name") -> None:
    """ConfigError naming the task methods `obj` (a task class or instance) lacks."""
    missing = [m for m in TASK_METHODS if not callable(getattr(obj, m, None))]
    if missing:
        raise ConfigError(f"{where}: {name!r} is not a task: it has no {', '.join(m + '()' for m in missing)} "
                         f"(a task has examples(split), reward(prompts, generations, metas) and tokenizer())")


def task_options(cls, name, options: dict, *, max_new_tokens: int, path: str = "task") -> dict:
    """The keyword arguments for the task's constructor `cls`: the section's keys (`options`, all
    but `name`) checked against its signature (`check_keywords`: an unknown key, a missing one, a
    value of the wrong type is ConfigError naming `task.<key>`), plus the env's `max_new_tokens`
    where the constructor takes it and the section does not set it."""
    return check_keywords(cls, options, path, f"task {name!r}", supplied={"max_new_tokens": max_new_tokens})


def check_task(section: dict, path: str = "task") -> None:
    """Checks a config's task section without building the task (no data read, no model loaded):
    its name, and its keys against the task's constructor (unknown, missing, values of the wrong
    type). ConfigError, one line naming the key; what only the constructor checks (ranges, data
    sets) waits for `make_task`."""
    options = dict(section)
    name = options.pop("name", None)
    task_options(task_class(name, f"{path}.name"), name, options, max_new_tokens=1, path=path)


def make_task(spec: dict, *, max_new_tokens: int):
    """Builds a task from its config section (`{"name": ..., **kwargs}`).

    A task's constructor takes the section's other keys (see `task_options`); one that has a
    `max_new_tokens` parameter the section does not set gets the env's."""
    options = dict(spec)
    name = options.pop("name", None)
    cls = task_class(name)
    kwargs = task_options(cls, name, options, max_new_tokens=max_new_tokens)
    if cls in TASKS.values():
        return cls(**kwargs)
    return _plugin_task(cls, name, kwargs)


def _plugin_task(cls, name: str, kwargs: dict):
    """A user's task, built from its checked keyword arguments; what its constructor raises
    besides a ValueError (its own one-line config check) is one line naming the task."""
    try:
        task = cls(**kwargs)
    except ValueError:
        raise
    except Exception as e:  # a user's constructor: one line, its own words
        raise ConfigError(f"task {name!r}: could not be built: {type(e).__name__}: {first_line(e)}") from None
    require_task_methods(task, name)
    return PluginTask(task, name)


class PluginTask:
    """A user's task behind the checks the built-in tasks make themselves: its examples are
    checked when a split is first read (a list of {"prompt": str, "meta": dict}, not empty) and
    its reward runs behind the reward guard (an exception, a wrong count or a NaN names the
    task and the text). Everything else is the task's own."""

    def __init__(self, task, label: str):
        from env.rewards import CheckedReward

        self.task, self.label = task, label
        own = getattr(task, "name", None)
        self.name = own if isinstance(own, str) else label
        self.reward = CheckedReward(task.reward, f"task {self.name!r}")
        self._checked: set = set()

    def __getattr__(self, attr):  # targets(), metrics, the task's own fields
        if attr.startswith("__") or attr == "task":  # copy/pickle probe before __init__ ran
            raise AttributeError(attr)
        return getattr(self.task, attr)

    def tokenizer(self):
        return self.task.tokenizer()

    def examples(self, split: str = "train") -> list[dict]:
        examples = self.task.examples(split)
        if split not in self._checked:
            where = f"task {self.name!r}: examples({split!r})"
            if not isinstance(examples, (list, tuple)):
                raise ValueError(f"{where} returned a {type(examples).__name__}; expected a list of "
                                 f"{{'prompt': str, 'meta': dict}}")
            for i, ex in enumerate(examples):
                if not isinstance(ex, dict) or not isinstance(ex.get("prompt"), str):
                    raise ValueError(f"{where}[{i}]: expected {{'prompt': str, 'meta': dict}}, got {ex!r:.80}")
                if not isinstance(ex.get("meta", {}), dict):
                    raise ValueError(f"{where}[{i}].meta: expected a dict, got {ex['meta']!r:.80}")
            self._checked.add(split)
        return [ex if "meta" in ex else {**ex, "meta": {}} for ex in examples]
