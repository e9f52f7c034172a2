"""Your own rewards and tasks, by name: `module:attr` import paths and installed entry points.

A config names a plug-in in one of two ways:

    reward: {name: "my_rewards:politeness"}      a function in an importable module
    task: {name: "my_tasks:Reverse"}             a task class in an importable module
    reward: {name: politeness}                   registered by an installed package

An installed package registers rewards and tasks under the entry-point groups
`tokenmdp.rewards` and `tokenmdp.tasks` (in its pyproject.toml):

    [project.entry-points."tokenmdp.rewards"]
    politeness = "my_package.rewards:politeness"
    [project.entry-points."tokenmdp.tasks"]
    reverse = "my_package.tasks:Reverse"

Built-in names win over entry points of the same name. Every failure is one line naming the
config field (`task.name: cannot import module 'my_tasks' (not found on the Python path)`).
"""
from __future__ import annotations

import importlib

from env.validation import first_line

GROUPS = {"reward": "tokenmdp.rewards", "task": "tokenmdp.tasks"}


def import_object(spec: str, where: str, error: type, what: str, expected: str):
    """The object named by `module:attr` (dots allowed in attr), or `error` naming `where`.

    `what` names the attribute in messages ("function", "task class"); `expected` says what
    a malformed name should have been ("a registered reward or 'module:function'")."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr or ":" in attr:
        raise error(f"{where}: expected {expected}, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raises while it runs
        if isinstance(e, ModuleNotFoundError) and e.name and (module_name + ".").startswith(e.name + "."):
            detail = "not found on the Python path"
        else:
            detail = f"{type(e).__name__}: {first_line(e)}"
        raise error(f"{where}: cannot import module {module_name!r} ({detail})") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise error(f"{where}: module {module_name!r} has no {what} {attr!r}")
        obj = getattr(obj, part)
    return obj


def entry_point_names(kind: str) -> list[str]:
    """The names installed packages register for `kind` ('reward' or 'task')."""
    from importlib.metadata import entry_points

    return sorted({ep.name for ep in entry_points(group=GROUPS[kind])})


def load_entry_point(kind: str, name: str, where: str, error: type):
    """The object an installed package registers as `name`, or None if none does."""
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group=GROUPS[kind]) if ep.name == name]
    if not found:
        return None
    if len({ep.value for ep in found}) > 1:
        raise error(f"{where}: {name!r} is registered by several installed packages "
                    f"({', '.join(sorted(ep.value for ep in found))}); name it as 'module:attr' instead")
    try:
        return found[0].load()
    except Exception as e:
        raise error(f"{where}: the installed {kind} {name!r} ({found[0].value}) does not load: "
                    f"{type(e).__name__}: {first_line(e)}") from None
