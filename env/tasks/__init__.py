"""Tasks: where prompts (and references) come from, and which reward scores them.

A task has `name`, `examples(split) -> [{"prompt": str, "meta": dict}]`,
`reward(prompts, generations, metas) -> [float]`, and `tokenizer()` (its own
tokenizer, or None to use the model's).
"""
from __future__ import annotations

from env.tasks.increasing_numbers import IncreasingNumbersTask
from env.tasks.sort_numbers import SortNumbersTask
from env.tasks.text_tasks import TEXT_TASKS  # imdb, commongen, dialogue, summarization, text (data sets)

TASKS = {IncreasingNumbersTask.name: IncreasingNumbersTask, SortNumbersTask.name: SortNumbersTask, **TEXT_TASKS}


def make_task(spec: dict, *, max_new_tokens: int):
    """Builds a task from its config section (`{"name": ..., **kwargs}`)."""
    spec = dict(spec)
    name = spec.pop("name", None)
    if name not in TASKS:
        raise ValueError(f"task.name: unknown task {name!r} (known: {', '.join(sorted(TASKS))})")
    cls = TASKS[name]
    if cls is IncreasingNumbersTask:
        spec.setdefault("max_new_tokens", max_new_tokens)
    return cls(**spec)
