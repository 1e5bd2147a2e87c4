"""SWE-bench task records for `env.name=swe`: read and check them, lay their repositories out, diff and patch.

A line of the task file (`env.kwargs.tasks`) is SWE-bench's record: `instance_id`, `problem_statement`, `patch`
(the gold fix), `test_patch` (tests the judge adds), `FAIL_TO_PASS` and `PASS_TO_PASS` (pytest node ids: a JSON
list, or a string holding one, as SWE-bench stores them), plus `repo_dir` (a directory or a `.tar.gz` holding the
repository at its base; relative to the task file), optional `test_cmd` and `image`. SWE-bench's other fields
(`repo`, `base_commit`, `version`, ...) are allowed and ignored. A bad line is refused naming its line and field.

Which paths are the tests' (`is_test_path`) and which the judge never takes from the agent (`is_protected`: the
tests, and the files that configure or could replace the test runner) is decided here, for the env and the judge.
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from rollout.envs.base import Task
from rollout.envs.task_file import read_task_file

SETTING = "env.kwargs.tasks"
DEFAULT_TEST_CMD = "python -m pytest -q"
TEST_DIRS = {"tests", "test", "testing"}
# Files that configure pytest or could stand in for it or for the interpreter's start-up: never taken from the agent.
RUNNER_FILES = {"conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "sitecustomize.py",
                "usercustomize.py", "pytest.py", "py.py", "_pytest", "pluggy", "noxfile.py"}
SKIPPED_DIRS = {"__pycache__", ".pytest_cache", ".git", ".hypothesis", ".mypy_cache"}
REQUIRED = ("instance_id", "problem_statement", "patch", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS", "repo_dir")


def is_test_path(path: str) -> bool:
    """`tests/` (or `test/`, `testing/`) anywhere, `test_*.py`, `*_test.py`, `conftest.py`."""
    parts = PurePosixPath(path).parts
    name = parts[-1] if parts else ""
    return (any(p in TEST_DIRS for p in parts[:-1]) or name == "conftest.py"
            or (name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))))


def is_protected(path: str) -> bool:
    """A test file, a runner's configuration or a module that could replace the runner, or a `.pth` file."""
    parts = PurePosixPath(path).parts
    return is_test_path(path) or bool(set(parts) & RUNNER_FILES) or path.endswith(".pth")


@dataclass
class SweTask:
    instance_id: str
    problem_statement: str
    patch: str
    test_patch: str
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    repo_dir: str  # absolute: a directory or a .tar.gz
    test_cmd: str = DEFAULT_TEST_CMD
    image: str | None = None

    @classmethod
    def of(cls, task: Task) -> SweTask:
        return cls(**task.data)


def _node_ids(record: dict, key: str) -> list[str]:
    value = record[key]
    if isinstance(value, str):  # SWE-bench stores these lists as JSON strings
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"{key}: a string that is not a JSON list: {value[:60]!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise ValueError(f"{key}: expected a list of pytest node ids (strings), got {str(value)[:80]}")
    return list(value)


def parse_record(record: dict, number: int, folder: Path) -> Task:
    """One line of a task file as a Task; ValueError naming the field when it is wrong."""
    for key in REQUIRED:
        if key not in record:
            hint = (" (SWE-bench's own lines name a GitHub repo and commit: check it out at its base_commit and "
                    "give the directory)") if key == "repo_dir" else ""
            raise ValueError(f"{key}: missing{hint}")
    for key in ("instance_id", "problem_statement", "patch", "repo_dir"):
        if not isinstance(record[key], str) or not record[key].strip():
            raise ValueError(f"{key}: expected a non-empty string")
    if not isinstance(record["test_patch"], str):
        raise ValueError("test_patch: expected a string (a unified diff, or empty)")
    fail_to_pass, pass_to_pass = _node_ids(record, "FAIL_TO_PASS"), _node_ids(record, "PASS_TO_PASS")
    if not fail_to_pass:
        raise ValueError("FAIL_TO_PASS: empty; a task needs at least one test the fix makes pass")
    repo = Path(record["repo_dir"])
    repo = repo if repo.is_absolute() else folder / repo
    if not (repo.is_dir() or (repo.is_file() and repo.name.endswith((".tar.gz", ".tgz")))):
        raise ValueError(f"repo_dir: {repo} is neither a directory nor a .tar.gz file")
    test_cmd = record.get("test_cmd", DEFAULT_TEST_CMD)
    if not isinstance(test_cmd, str) or not test_cmd.strip():
        raise ValueError("test_cmd: expected a non-empty string (a pytest command line)")
    image = record.get("image")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        raise ValueError("image: expected a container image name")
    task = SweTask(record["instance_id"], record["problem_statement"], record["patch"], record["test_patch"],
                   fail_to_pass, pass_to_pass, str(repo.resolve()), test_cmd, image)
    return Task(task.instance_id, dict(task.__dict__))


def load_tasks(path: str | Path) -> list[Task]:
    folder = Path(path).resolve().parent
    return read_task_file(path, lambda record, number: parse_record(record, number, folder), SETTING)


# -- repositories on disk


def unpack(archive: str, into: Path) -> Path:
    """A .tar.gz's repository under `into` (only regular files and directories; links and devices refused by the
    `data` filter); its single top-level directory when it has one."""
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    entries = [p for p in into.iterdir()]
    return entries[0] if len(entries) == 1 and entries[0].is_dir() else into


def copy_repo(source: Path, target: Path) -> None:
    shutil.copytree(source, target, symlinks=True, ignore=shutil.ignore_patterns(*SKIPPED_DIRS))


def files_of(root: Path) -> dict[str, Path]:
    """Every regular file and symlink under `root` by its relative path (caches skipped; symlinks not followed)."""
    found = {}
    for directory, dirs, files in os.walk(root):
        keep = []
        for name in dirs:
            full = Path(directory) / name
            if full.is_symlink():  # a link to a directory is an entry, never entered
                found[full.relative_to(root).as_posix()] = full
            elif name not in SKIPPED_DIRS:
                keep.append(name)
        dirs[:] = keep
        for name in files:
            if not name.endswith(".pyc"):
                full = Path(directory) / name
                found[full.relative_to(root).as_posix()] = full
    return found


@dataclass
class Changes:
    written: dict[str, bytes]  # relative path -> new content (changed or added regular files)
    deleted: list[str]
    dropped: list[str]  # changes the judge does not take: tests, runner files, links, special files


def agent_changes(base: Path, copy: Path, max_bytes: int) -> Changes:
    """What the agent changed in `copy` against `base`, split into what the judge takes and what it drops. Nothing
    in `copy` is followed or opened unless it is a regular file (a FIFO would block, a link could point anywhere)."""
    before, after = files_of(base), files_of(copy)
    written, dropped, total = {}, [], 0
    for rel, path in sorted(after.items()):
        st = path.lstat()
        old = before.get(rel)
        if not path.is_file() or path.is_symlink():
            dropped.append(rel)
            continue
        if old is not None and st.st_size == old.stat().st_size and path.read_bytes() == old.read_bytes():
            continue
        if is_protected(rel):
            dropped.append(rel)
            continue
        total += st.st_size
        if total > max_bytes:
            dropped.append(rel)
            continue
        written[rel] = path.read_bytes()
    deleted = []
    for rel in sorted(set(before) - set(after)):
        (dropped if is_protected(rel) else deleted).append(rel)
    return Changes(written, deleted, dropped)


def apply_changes(root: Path, changes: Changes) -> None:
    for rel, content in changes.written.items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink():
            target.unlink()
        target.write_bytes(content)
    for rel in changes.deleted:
        (root / rel).unlink(missing_ok=True)


def apply_patch(root: Path, diff: str) -> str:
    """Apply a unified diff (paths a/... b/...) under `root`; "" or why it did not apply."""
    if not diff.strip():
        return ""
    if shutil.which("patch") is not None:
        argv = ["patch", "-p1", "--batch", "--forward", "--no-backup-if-mismatch", "-s", "-d", str(root)]
        env = None
    elif shutil.which("git") is not None:  # outside any repository: no ancestor's .git is looked for
        argv = ["git", "-C", str(root), "apply", "-p1", "--whitespace=nowarn", "-"]
        env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(Path(root).resolve().parent)}
    else:
        return "neither `patch` nor `git` is installed (apt-get install patch)"
    done = subprocess.run(argv, input=diff, capture_output=True, text=True, timeout=60, env=env)
    return "" if done.returncode == 0 else (done.stdout + done.stderr).strip()[-500:] or "the patch did not apply"


def unified_diff(path: str, before: str | None, after: str) -> str:
    """One file's unified diff with git's a/ b/ prefixes ("" when equal); `before` None: a new file."""
    old = "/dev/null" if before is None else f"a/{path}"
    lines = difflib.unified_diff((before or "").splitlines(True), after.splitlines(True), old, f"b/{path}")
    text = "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)
    created = "new file mode 100644\n" if before is None else ""
    return f"diff --git a/{path} b/{path}\n{created}{text}" if text else ""


def hunks(diff: str) -> list[tuple[str, str, str]]:
    """(path, old text, new text) of each hunk of a unified diff: what a `str_replace` per hunk needs."""
    out: list[tuple[str, str, str]] = []
    path = ""
    old: list[str] | None = None
    new: list[str] = []
    for line in diff.splitlines(True):
        if line.startswith("+++ "):
            path = line[4:].strip().removeprefix("b/")
            continue
        if line.startswith(("--- ", "diff ", "\\")):
            continue
        if line.startswith("@@"):
            if old is not None:
                out.append((path, "".join(old), "".join(new)))
            old, new = [], []
            continue
        if old is None:
            continue
        if line.startswith("-"):
            old.append(line[1:])
        elif line.startswith("+"):
            new.append(line[1:])
        elif line.startswith(" ") or line == "\n":
            old.append(line[1:] if line.startswith(" ") else line)
            new.append(line[1:] if line.startswith(" ") else line)
    if old is not None:
        out.append((path, "".join(old), "".join(new)))
    return out
