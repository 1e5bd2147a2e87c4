"""Task files: read a JSONL file of task records (`env.kwargs.tasks_file`), with errors that name file and line.

One JSON object a line (blank lines skipped); each env turns a record into a `Task` with its own parser (the
`tasks` env: question and answer, rollout/envs/tasks.py; the `coding` env: prompt, entry point and tests,
rollout/envs/coding.py). Anything wrong with a line, its JSON, its fields (what the parser raises as ValueError) or
an id given twice, is an EnvError naming the setting, the file and the line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from rollout.envs.base import EnvError, Task

SETTING = "env.kwargs.tasks_file"


def read_task_file(path: str | Path, parse: Callable[[dict, int], Task], setting: str = SETTING) -> list[Task]:
    """The tasks of `path`: `parse(record, line_number)` makes each line's JSON object a Task, or raises ValueError
    saying what is wrong with it; task ids must be unique. Errors name `setting` (the env's key for the file)."""
    tasks: list[Task] = []
    ids: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{setting}: {path} line {number}"
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise EnvError(f"{where}: not JSON: {exc}") from None
            if not isinstance(record, dict):
                raise EnvError(f"{where}: expected a JSON object, got {type(record).__name__}")
            try:
                task = parse(record, number)
            except ValueError as exc:
                raise EnvError(f"{where}: {exc}") from None
            if task.id in ids:
                raise EnvError(f"{where}: id {task.id!r} given twice")
            ids.add(task.id)
            tasks.append(task)
    return tasks
