"""`env.name=swe`: fix a bug in a real repository with a shell and file tools; judged by SWE-bench's rule.

Tasks are SWE-bench records (rollout/envs/swe_tasks.py; `async-rl swe make` writes them from PyPI packages,
rollout/envs/swe_make.py). Each trajectory gets its own copy of the task's repository at its base. Tools:
`bash(command)` (a shell in the copy: no network, limits on CPU, memory, processes and disk, nothing written
outside the copy), `read_file(path)`, `write_file(path, content)`, `str_replace(path, old_str, new_str)`,
`run_tests(tests)` (its report is the observation and the fraction passing the stage reward) and `submit()`.
Every tool's output is cut to `max_observation_chars` and every call has a time limit. `judge()` runs the hidden
tests in a fresh sandbox (rollout/envs/swe_judge.py). docs/environments.md, "swe", says the rest.
"""

from __future__ import annotations

import json
import random
import tempfile
import threading
from pathlib import Path
from typing import Any, Literal

import msgspec

from async_rl.env_types import Action, Judgement, StepResult, Task, ToolCall, ToolResult
from rollout.envs.base import EnvError, settings_from_kwargs
from rollout.envs.swe_judge import Runtime, TestRun, judge, remove_tree, run_pytest
from rollout.envs.swe_tasks import SETTING, SweTask, copy_repo, files_of, hunks, is_protected, load_tasks, unpack
from rollout.sandbox import SandboxError
from rollout.sandbox.shell import ShellLimits, ShellSandbox


class SweSettings(msgspec.Struct, forbid_unknown_fields=True):
    tasks: str  # a JSONL file of SWE-bench records (rollout/envs/swe_tasks.py)
    eval_fraction: float = 0.2  # the share of tasks in the eval split (0: none)
    split_seed: int = 0  # the seed of the split's shuffle
    max_turns: int = 20  # turns per episode; the episode ends after this many or at submit()
    max_observation_chars: int = 4000  # every tool's output is cut to this
    bash_timeout_s: float = 30.0  # the wall-clock limit of one bash call
    tests_timeout_s: float = 120.0  # of one run_tests call
    judge_timeout_s: float = 300.0  # of the judge's test run
    memory_mb: int = 2048  # RLIMIT_AS of each process a call starts
    nproc: int = 64  # processes and threads a call may have at once (as root: its own uid's)
    disk_mb: int = 256  # the copy's size limit; a call that leaves it larger ends the episode
    max_concurrent: int = 4  # sandbox calls at once across the factory's trajectories
    # Fail closed: no network and mount namespaces, no command runs. false: the explicit, unsafe opt-out (commands
    # then run with rlimits and, as root, a uid of their own only: no security boundary).
    require_namespaces: bool = True
    runtime: Literal["auto", "namespace", "podman"] = "auto"  # auto: podman for a task with an image, else namespace
    python: str | None = None  # the interpreter commands find as `python` (default: the worker's)
    work_dir: str | None = None  # where trajectories' copies live (default: a temporary directory)

    def __post_init__(self) -> None:
        if not 0 <= self.eval_fraction < 1:
            raise ValueError(f"eval_fraction: expected 0 <= f < 1, got {self.eval_fraction}")
        if self.max_turns < 1:
            raise ValueError(f"max_turns: expected >= 1, got {self.max_turns}")
        if self.max_observation_chars < 200:
            raise ValueError(f"max_observation_chars: expected >= 200, got {self.max_observation_chars}")
        for key in ("bash_timeout_s", "tests_timeout_s", "judge_timeout_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key}: expected > 0, got {getattr(self, key)}")
        for key in ("memory_mb", "nproc", "disk_mb", "max_concurrent"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}: expected >= 1, got {getattr(self, key)}")


def _spec(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


_PATH = {"type": "string", "description": "a path relative to the repository's root"}
TOOLS = [
    _spec("bash", "Run a shell command in the repository (no network; output cut; time-limited).",
          {"command": {"type": "string"}}, ["command"]),
    _spec("read_file", "Read a file of the repository.", {"path": _PATH}, ["path"]),
    _spec("write_file", "Write a file of the repository (created or replaced).",
          {"path": _PATH, "content": {"type": "string"}}, ["path", "content"]),
    _spec("str_replace", "Replace the one occurrence of old_str in a file by new_str.",
          {"path": _PATH, "old_str": {"type": "string"}, "new_str": {"type": "string"}},
          ["path", "old_str", "new_str"]),
    _spec("run_tests", "Run tests: pytest node ids, or none for the whole visible suite. Returns the report.",
          {"tests": {"type": "array", "items": {"type": "string"}}}, []),
    _spec("submit", "Hand in the repository as it is now; the episode ends.", {}, []),
]
INTRO = ("You are in a copy of a Python repository. A user reported this problem:\n\n{statement}\n\nFix it by editing "
         "the repository's source code. Tools: bash (a shell in the repository, no network), read_file, write_file, "
         "str_replace, run_tests (pytest node ids, or none for the visible suite) and submit (when you are done). "
         "Hidden tests decide; changes to test files are not judged. {turns} turns.")
MAX_FILE_CHARS = 1 << 20


class ToolError(Exception):
    """A tool call the agent got wrong: its message is the tool's answer."""


class SweFactory:
    max_action_tokens = 512

    def __init__(self, settings: SweSettings) -> None:
        self.settings = settings
        if not Path(settings.tasks).is_file():
            raise EnvError(f"{SETTING}: no such file: {settings.tasks}")
        self.lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(settings.max_concurrent)
        self.splits: dict[str, list[Task]] | None = None
        self._root: Path | None = None  # made on first use: a factory only checked or asked for tasks leaves nothing
        self.bases: dict[str, Path] = {}
        limits = ShellLimits(wall_s=settings.bash_timeout_s, cpu_s=int(max(settings.judge_timeout_s,
                             settings.tests_timeout_s)) + 1, memory_mb=settings.memory_mb, nproc=settings.nproc,
                             output_chars=settings.max_observation_chars)
        self.shell = ShellSandbox(limits, require_namespaces=settings.require_namespaces, python=settings.python)
        self._podman: Any = None
        if settings.require_namespaces and settings.runtime != "podman":
            try:  # fail closed at the start, not in the middle of a trajectory
                self.shell.check()
            except SandboxError as exc:
                raise EnvError(f"env.kwargs.require_namespaces: {exc}") from None

    @property
    def root(self) -> Path:
        """Where this factory's unpacked bases and trajectories' copies live."""
        with self.lock:
            if self._root is None:
                self._root = Path(tempfile.mkdtemp(prefix="async-rl-swe-", dir=self.settings.work_dir))
            return self._root

    @property
    def step_timeout_s(self) -> float:
        """A turn may call several tools: room for a few test runs (the runner's limit, rollout/plugin_calls.py)."""
        return 3 * self.settings.tests_timeout_s + 2 * self.settings.bash_timeout_s + 60

    @property
    def judge_timeout_s(self) -> float:
        return self.settings.judge_timeout_s + 120

    def tasks(self, split: str) -> list[Task]:
        if split not in ("train", "eval"):
            raise EnvError(f"env 'swe': no split {split!r} (train, eval)")
        with self.lock:
            if self.splits is None:
                tasks = sorted(load_tasks(self.settings.tasks), key=lambda t: t.id)
                if not tasks:
                    raise EnvError(f"{SETTING}: {self.settings.tasks}: no task in the file")
                random.Random(f"swe-split/{self.settings.split_seed}").shuffle(tasks)
                n_eval = 0 if self.settings.eval_fraction == 0 else min(
                    len(tasks) - 1, max(1, round(len(tasks) * self.settings.eval_fraction)))
                self.splits = {"eval": tasks[:n_eval], "train": tasks[n_eval:]}
        return list(self.splits[split])

    def make(self) -> SweEnv:
        return SweEnv(self)

    def base(self, task: SweTask) -> Path:
        """The task's repository at its base, unpacked once per factory."""
        root = self.root
        with self.lock:
            if task.instance_id not in self.bases:
                source = Path(task.repo_dir)
                if source.is_dir():
                    self.bases[task.instance_id] = source
                else:
                    into = root / "bases" / _safe(task.instance_id)
                    self.bases[task.instance_id] = unpack(str(source), into)
            return self.bases[task.instance_id]

    def runtime(self, task: SweTask) -> Runtime:
        if self.settings.runtime == "podman" or (self.settings.runtime == "auto" and task.image):
            if not task.image:
                raise EnvError(f"env.kwargs.runtime: podman needs a task with an image; {task.instance_id} has none")
            from rollout.sandbox.podman import PodmanShell

            with self.lock:
                if self._podman is None:
                    self._podman = PodmanShell(self.shell.limits)
            return self._podman.for_image(task.image)
        return self.shell

    def run(self, task: SweTask, fn: Any, *args: Any) -> Any:
        """One sandbox call, bounded by the factory's semaphore; a host that lost its namespaces is an EnvError."""
        with self.slots:
            try:
                return fn(*args)
            except SandboxError as exc:
                raise EnvError(f"env.kwargs.require_namespaces: {exc}") from None

    def demonstration(self, task: Task) -> list[dict] | None:
        """The gold fix through the env's own tools: read each file it touches, a str_replace per hunk, run_tests,
        submit (`async-rl demos`). None when a hunk's old text is not unique in its file."""
        swe = SweTask.of(task)
        base = self.base(swe)
        turns: list[dict] = []
        seen: set[str] = set()
        for number, (path, old, new) in enumerate(hunks(swe.patch)):
            if path not in seen:
                seen.add(path)
                turns.append(_turn(f"read-{number}", "read_file", {"path": path}))
            source = (base / path).read_text()
            if source.count(old) != 1:
                return None
            turns.append(_turn(f"edit-{number}", "str_replace", {"path": path, "old_str": old, "new_str": new}))
        turns.append(_turn("tests", "run_tests", {}))
        turns.append(_turn("submit", "submit", {}))
        return turns

    def close(self) -> None:
        """The worker's end: the unpacked bases and podman's settings go."""
        if self._podman is not None:
            self._podman.close()
        if self._root is not None:
            remove_tree(self._root)


def _turn(call_id: str, name: str, arguments: dict) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:100]


class SweEnv:
    def __init__(self, factory: SweFactory) -> None:
        self.factory, self.settings = factory, factory.settings
        self.task: SweTask | None = None
        self.home: Path | None = None
        self.turns = 0
        self.done = False
        self.counts = {"tool_calls": 0, "tool_errors": 0, "tests_run": 0}
        self._judgement: Judgement | None = None

    @property
    def repo(self) -> Path:
        assert self.home is not None, "swe env: step called before reset(task)"
        return self.home / "repo"

    def tools(self) -> list[dict]:
        return TOOLS

    def reset(self, task: Task) -> str:
        self.task = SweTask.of(task)
        base = self.factory.base(self.task)
        self.home = Path(tempfile.mkdtemp(prefix="episode-", dir=self.factory.root))
        copy_repo(base, self.repo)
        return INTRO.format(statement=self.task.problem_statement.strip(), turns=self.settings.max_turns)

    def step(self, action: str | Action) -> StepResult:
        if self.task is None:
            raise EnvError("swe env: step called before reset(task)")
        if self.done:
            return StepResult(None, 0.0, True)
        if isinstance(action, str):
            action = Action(action, [])
        self.turns += 1
        results: list[ToolResult] = []
        reward, submitted = 0.0, False
        for call in action.tool_calls:
            self.counts["tool_calls"] += 1
            try:
                content, fraction = self._call(call)
            except (ToolError, OSError, ValueError) as exc:  # a directory written as a file, a NUL in a path, ...
                self.counts["tool_errors"] += 1
                content, fraction = f"error: {exc}", None
            if fraction is not None:
                reward = fraction
            submitted = submitted or call.name == "submit"
            results.append(ToolResult(_cap(content, self.settings.max_observation_chars), call.name, call.id))
        if action.parse_error:
            self.counts["tool_errors"] += 1
            results.append(ToolResult(f"error: {action.parse_error}"))
        over = self._over_disk()
        self.done = submitted or over or self.turns >= self.settings.max_turns
        if self.done:
            return StepResult(None, reward, True)
        if not results:
            left = self.settings.max_turns - self.turns
            return StepResult(f"No tool call in your turn. Use the tools; call submit() when done. [{left} turns "
                              "left]", reward, False)
        return StepResult(results, reward, False)

    def _call(self, call: ToolCall) -> tuple[str, float | None]:
        """The tool's answer, and for run_tests the fraction passing (the stage reward)."""
        args = call.arguments
        if call.name == "submit":
            return "Submitted.", None
        if call.name == "run_tests":
            tests = args.get("tests") or []
            if isinstance(tests, str):
                tests = tests.split()
            if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
                raise ToolError("run_tests takes `tests`: a list of pytest node ids (or none)")
            return self._run_tests(tests)
        if call.name == "bash":
            command = args.get("command")
            if not isinstance(command, str) or not command.strip():
                raise ToolError("bash takes `command`: a non-empty string")
            result = self.factory.run(self.task, self.factory.runtime(self.task).run, command, str(self.repo))
            status = "timed out (killed)" if result.timed_out else f"exit code {result.exit_code}"
            dropped = f"\n[{result.output_dropped} bytes of output dropped]" if result.output_dropped else ""
            return f"[{status}]\n{result.output}{dropped}", None
        path = self._path(args.get("path"))
        if call.name == "read_file":
            if not path.is_file():
                raise ToolError(f"no such file: {args['path']}")
            with open(path, encoding="utf-8", errors="replace") as f:
                return f.read(MAX_FILE_CHARS), None
        if call.name == "write_file":
            content = args.get("content")
            if not isinstance(content, str) or len(content) > MAX_FILE_CHARS:
                raise ToolError(f"write_file takes `content`: a string of at most {MAX_FILE_CHARS} characters")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
            return f"Wrote {args['path']} ({len(content)} characters).", None
        if call.name == "str_replace":
            old, new = args.get("old_str"), args.get("new_str")
            if not isinstance(old, str) or not old or not isinstance(new, str):
                raise ToolError("str_replace takes `old_str` (non-empty) and `new_str`: strings")
            if not path.is_file():
                raise ToolError(f"no such file: {args['path']}")
            text = path.read_text(errors="replace")
            count = text.count(old)
            if count != 1:
                raise ToolError(f"old_str occurs {count} times in {args['path']}; it must occur exactly once")
            path.write_text(text.replace(old, new, 1))
            return f"Replaced 1 occurrence in {args['path']}.", None
        raise ToolError(f"no tool {call.name!r}")

    def _path(self, given: Any) -> Path:
        """A path inside the copy, links resolved (a link out of it is refused), never a special file."""
        if not isinstance(given, str) or not given.strip():
            raise ToolError("`path`: a non-empty string, relative to the repository's root")
        root = self.repo.resolve()
        path = (root / given).resolve()
        if path != root and root not in path.parents:
            raise ToolError(f"{given} is outside the repository")
        if path.exists() and not (path.is_file() or path.is_dir()):
            raise ToolError(f"{given} is not a regular file")
        return path

    def _run_tests(self, tests: list[str]) -> tuple[str, float]:
        self.counts["tests_run"] += 1
        run: TestRun = self.factory.run(self.task, run_pytest, self.factory.runtime(self.task), self.repo,
                                        self.task.test_cmd, tests, self.settings.tests_timeout_s)
        outcomes = {n: s for n, s in run.outcomes.items()}
        for node in tests:
            outcomes.setdefault(node, "not run")
        passed = sum(s == "passed" for s in outcomes.values())
        counted = sum(s != "skipped" for s in outcomes.values())
        fraction = passed / counted if counted else 0.0
        counts = ", ".join(f"{n} {s}" for s, n in sorted(_count(outcomes).items()))
        failing = [f"{s.upper()} {n}: {run.messages.get(n, '')}".rstrip(": ")
                   for n, s in outcomes.items() if s not in ("passed", "skipped")]
        head = f"{passed}/{counted} passed ({counts or 'no test ran'})"
        if run.shell.timed_out:
            head += "; the run was killed at its time limit"
        if run.collect_errors:
            head += "\ncollection errors: " + "; ".join(f"{n}: {run.messages.get(n, '')}" for n in run.collect_errors)
        if not outcomes and not run.collect_errors:
            head += "\n" + run.shell.output[-1500:]
        return head + ("\n" + "\n".join(failing[:20]) if failing else ""), fraction

    def _over_disk(self) -> bool:
        if self.home is None:
            return False
        size = sum(p.lstat().st_size for p in files_of(self.repo).values())
        return size > self.settings.disk_mb << 20

    def judge(self) -> Judgement:
        if self._judgement is not None:
            return self._judgement
        if self.task is None:
            raise EnvError("swe env: judge called before reset(task)")
        task = self.task
        result = self.factory.run(task, judge, task, self.factory.base(task), self.repo, self.factory.runtime(task),
                                  self.settings.judge_timeout_s, str(self.factory.root))
        changed = any(not is_protected(rel) for rel in _changed(self.factory.base(task), self.repo))
        info = {**result.info, **{k: float(v) for k, v in self.counts.items()}, "turns": float(self.turns),
                "submitted_change": float(changed)}
        self._judgement = Judgement(result.score, result.success, info)
        return self._judgement

    def close(self) -> None:
        """The trajectory is over (judged, or abandoned): its copy goes."""
        self.done = True
        if self.home is not None:
            remove_tree(self.home)


def _changed(base: Path, copy: Path) -> list[str]:
    before, after = files_of(base), files_of(copy)
    out = [rel for rel in set(before) ^ set(after)]
    for rel in set(before) & set(after):
        a, b = before[rel], after[rel]
        if a.is_file() and b.is_file() and not b.is_symlink() and a.read_bytes() != b.read_bytes():
            out.append(rel)
    return out


def _count(outcomes: dict[str, str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for status in outcomes.values():
        counts[status] = counts.get(status, 0) + 1
    return counts


def _cap(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 40] + f"\n...[cut: {len(text) - limit + 40} more chars]"


def factory(**kwargs: Any) -> SweFactory:
    """`env.name=swe` with `env.kwargs` (SweSettings)."""
    return SweFactory(settings_from_kwargs("swe", SweSettings, kwargs))
