"""Tasks from data, with tools: questions from reasoning-gym or a JSONL file, answered over a few turns, judged by
the data's verifier (docs/environments.md, "tasks").

`env.name=tasks`. The first observation is the question and how to answer; the env's `tools()` are the ones
`env.kwargs.tools` names (`calculator`: safe arithmetic through `ast`, rollout/envs/calculator.py; `python`: the
code runs in the sandbox, rollout/sandbox/, and its stdout comes back), plus an MCP server's tools when
`env.kwargs.mcp` names one (rollout/agents/mcp_tools.py). A turn with tool calls (or a call
that did not parse) gets the tools' answers as `tool` messages and the episode goes on; a turn with
`<answer>...</answer>`, or without a tool call, is the final answer and ends it; so does the `max_turns`-th turn.
Stage reward: `tool_reward` on the final turn when the answer uses the result of a well-formed tool call (the
result's text appears in the answer as a whole number or word), else 0. Outcome: reasoning-gym's own
`score_answer` for its datasets; for a file, 1 when the answer equals the record's after normalising (case,
whitespace, a trailing period, thousands separators; numbers compared as numbers), else 0.
"""

from __future__ import annotations

import json
import math
import random
import re
import threading
import time
from pathlib import Path
from typing import Any, Literal

import msgspec

from async_rl.env_types import Action, Judgement, StepResult, Task, ToolCall, ToolResult
from rollout.agents.mcp_tools import McpSettings, McpTools
from rollout.envs.base import EnvError, settings_from_kwargs
from rollout.envs.calculator import CALC_SPEC, CalcError, calculate, format_number
from rollout.envs.task_file import SETTING, read_task_file
from rollout.tool_parser import CLOSE, OPEN

DEFAULT_DATASET = "basic_arithmetic"
TOOLS = ("calculator", "python")
PYTHON_SPEC = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a short Python program in a sandbox (no network, no files kept) and return what it "
                       "printed.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program; print() what you need"}},
            "required": ["code"],
        },
    },
}
INSTRUCTIONS = "Give your final answer as <answer>...</answer>."
TOOL_HINT = " You may call a tool first; its result comes back before you answer."
MAX_RESULT_CHARS = 1000
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_EXPRESSION = re.compile(r"[-(\d][\d\s+\-*/().]*[\d)]")  # a run of arithmetic in a question


class TasksSettings(msgspec.Struct, forbid_unknown_fields=True):
    dataset: str | None = None  # a reasoning-gym dataset name (basic_arithmetic when tasks_file is not set)
    dataset_config: dict[str, Any] = {}  # more keyword arguments of reasoning_gym.create_dataset
    tasks_file: str | None = None  # a JSONL file of {"question": ..., "answer": ...} (optional "id")
    size: int = 200  # reasoning-gym entries generated before the split (ignored for a file)
    eval_fraction: float = 0.2  # the share of tasks in the eval split
    seed: int = 0  # the generator's seed and the split's
    tools: list[str] = msgspec.field(default_factory=lambda: ["calculator"])  # calculator, python; [] for none
    max_turns: int = 4  # turns per episode, the final answer's included
    tool_reward: float = 0.1  # the stage reward for an answer that uses a tool's result (the outcome is 0..1)
    judge_delay_s: float = 0.0  # a sleep inside judge(): a slow grader
    # What a final turn without <answer>...</answer> answers: "text", its text without tool calls; "last-number",
    # its last number (for numeric datasets: a small model states "3 + 10 = 13" long before it learns the tag).
    untagged: Literal["text", "last-number"] = "text"
    python_timeout_s: float = 5.0  # the wall-clock limit of one `python` call
    # An MCP server whose tools the env adds to `tools` ({"command": [...], "env": {...}, ...}: McpSettings,
    # rollout/agents/mcp_tools.py); started with the first trajectory, stopped with the worker.
    mcp: McpSettings | None = None

    def __post_init__(self) -> None:
        if self.dataset is not None and self.tasks_file is not None:
            raise ValueError("dataset: give a reasoning-gym dataset or a tasks_file, not both")
        if self.size < 2:
            raise ValueError(f"size: expected >= 2, got {self.size}")
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"eval_fraction: expected 0 < f < 1, got {self.eval_fraction}")
        unknown = [t for t in self.tools if t not in TOOLS]
        if unknown:
            raise ValueError(f"tools: unknown tool {unknown[0]!r} (allowed: {', '.join(TOOLS)})")
        if self.max_turns < 1:
            raise ValueError(f"max_turns: expected >= 1, got {self.max_turns}")
        if self.tool_reward < 0 or self.judge_delay_s < 0 or self.python_timeout_s <= 0:
            raise ValueError("tool_reward: tool_reward and judge_delay_s must be >= 0, python_timeout_s > 0")


def normalise(text: str) -> str:
    text = " ".join(str(text).strip().lower().split())
    text = text.strip("$").rstrip(".").strip()
    return re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)


def same_answer(given: str, expected: str) -> bool:
    a, b = normalise(given), normalise(expected)
    if a == b:
        return True
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9)


def final_answer(text: str) -> str | None:
    """The last `<answer>...</answer>` of a turn, or None."""
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else None


def without_calls(text: str) -> str:
    return re.sub(re.escape(OPEN) + r".*?(" + re.escape(CLOSE) + r"|$)", "", text, flags=re.DOTALL).strip()


def last_number(text: str) -> str:
    """The last number in `text` (thousands separators dropped), or the text itself when it has none."""
    numbers = _NUMBER.findall(text.replace(",", ""))
    return numbers[-1] if numbers else text


def uses(answer: str, result: str) -> bool:
    """Whether `result` appears in `answer` as a whole number or word (not inside a longer one)."""
    result = normalise(result)
    if not result or result.startswith("error"):
        return False
    return re.search(r"(?<![\w.])" + re.escape(result) + r"(?!\w|\.\d)", normalise(answer)) is not None


class TasksEnv:
    def __init__(self, factory: TasksFactory) -> None:
        self.factory, self.settings = factory, factory.settings
        self.task: Task | None = None
        self.turns, self.calls, self.errors = 0, 0, 0
        self.results: list[str] = []  # the answers of well-formed calls
        self.answer = ""
        self.tagged = False
        self.mcp_generation: int | None = None  # the MCP server process this trajectory called (it may hold state)

    def tools(self) -> list[dict]:
        specs = [{"calculator": CALC_SPEC, "python": PYTHON_SPEC}[t] for t in self.settings.tools]
        if self.factory.mcp is not None:
            served = self.factory.mcp.specs()
            clash = sorted({s["function"]["name"] for s in served} & set(self.settings.tools))
            if clash:
                raise EnvError(f"env.kwargs.mcp: the MCP server's tool {clash[0]!r} has the name of a built-in tool "
                               "(leave it out of env.kwargs.tools)")
            specs += served
        return specs

    def reset(self, task: Task) -> str:
        self.task = task
        hint = TOOL_HINT if self.settings.tools or self.settings.mcp else ""
        return f"{task.data['question']}\n\n{INSTRUCTIONS}{hint}"

    def step(self, action: str | Action) -> StepResult:
        if isinstance(action, str):  # rollout.tool_parser none, or a caller without the tool seam
            action = Action(action, [])
        self.turns += 1
        answer = final_answer(action.text)
        calling = bool(action.tool_calls or action.parse_error)
        if answer is None and calling and self.turns < self.settings.max_turns:
            return StepResult(self._run_calls(action), 0.0, False)
        self.tagged = answer is not None
        self.answer = answer if answer is not None else self._untagged(without_calls(action.text))
        used = any(uses(self.answer, r) for r in self.results)
        return StepResult(None, self.settings.tool_reward if used else 0.0, True)

    def _untagged(self, text: str) -> str:
        return text if self.settings.untagged == "text" else last_number(text)

    def _run_calls(self, action: Action) -> list[ToolResult]:
        results = []
        for call in action.tool_calls:
            self.calls += 1
            if self.factory.mcp is not None and call.name not in self.settings.tools:
                content, ok, self.mcp_generation = self.factory.mcp.call(call.name, call.arguments, self.mcp_generation)
            else:
                content, ok = self.factory.run_tool(call)
            self.errors += not ok
            if ok:
                self.results.append(content)
            results.append(ToolResult(content, call.name, call.id))
        if action.parse_error:
            self.errors += 1
            results.append(ToolResult(f"error: {action.parse_error}"))
        return results

    def judge(self) -> Judgement:
        if self.settings.judge_delay_s:
            time.sleep(self.settings.judge_delay_s)
        assert self.task is not None
        score = self.factory.score(self.task, self.answer)
        info = {"tool_calls": float(self.calls), "tool_errors": float(self.errors), "answer_tagged": float(self.tagged),
                "called_tool": float(self.calls > 0),
                "used_tool_result": float(any(uses(self.answer, r) for r in self.results))}
        return Judgement(score=score, success=score >= 1.0 - 1e-9, info=info)


class TasksFactory:
    max_action_tokens = 128

    def __init__(self, settings: TasksSettings) -> None:
        self.settings = settings
        self.name = settings.dataset or (None if settings.tasks_file else DEFAULT_DATASET)
        self.dataset: Any = None
        if self.name is not None:
            from reasoning_gym.factory import DATASETS

            if self.name not in DATASETS:
                raise EnvError(f"env.kwargs.dataset: reasoning-gym has no dataset {self.name!r} "
                               f"(e.g. {', '.join(sorted(DATASETS)[:8])}, ...)")
            import reasoning_gym

            try:  # its generators make each entry on demand: creating the dataset generates nothing yet
                self.dataset = reasoning_gym.create_dataset(self.name, size=settings.size, seed=settings.seed,
                                                            **settings.dataset_config)
            except Exception as exc:
                raise EnvError(f"env.kwargs.dataset_config: reasoning-gym's {self.name!r} refused it: "
                               f"{type(exc).__name__}: {exc}") from None
        elif not Path(str(settings.tasks_file)).is_file():
            raise EnvError(f"env.kwargs.tasks_file: no such file: {settings.tasks_file}")
        self.lock = threading.Lock()
        self.mcp = McpTools(settings.mcp) if settings.mcp is not None else None  # starts nothing yet
        self.splits: dict[str, list[Task]] | None = None
        self.entries: dict[str, dict] = {}  # reasoning-gym's entry of each task (its score_answer needs it)
        self._sandbox: Any = None

    def tasks(self, split: str) -> list[Task]:
        if split not in ("train", "eval"):
            raise EnvError(f"env 'tasks': no split {split!r} (train, eval)")
        with self.lock:
            if self.splits is None:
                self.splits = self._split(self._load())
        return list(self.splits[split])

    def make(self) -> TasksEnv:
        return TasksEnv(self)

    def metrics(self) -> dict[str, float]:
        """The MCP server's counts (`mcp_*`) for the worker's metrics line; {} without one."""
        return self.mcp.metrics() if self.mcp is not None else {}

    def close(self) -> None:
        """Stop the MCP server, if one was started (the worker's end)."""
        if self.mcp is not None:
            self.mcp.close()

    def _load(self) -> list[Task]:
        if self.name is None:
            path = str(self.settings.tasks_file)
            tasks = read_task_file(path, _question_task)
            if len(tasks) < 2:
                raise EnvError(f"{SETTING}: {path} holds {len(tasks)} task(s); a train and an eval split need 2")
            return tasks
        tasks = []
        for index in range(self.settings.size):
            entry = self.dataset[index]
            task = Task(id=f"{self.name}/{index}", data={"question": entry["question"], "answer": str(entry["answer"])})
            self.entries[task.id] = entry
            tasks.append(task)
        return tasks

    def _split(self, tasks: list[Task]) -> dict[str, list[Task]]:
        """A seeded shuffle, the eval share first; one task per distinct question, so no question is in both."""
        unique = list({t.data["question"]: t for t in reversed(tasks)}.values())[::-1]
        random.Random(self.settings.seed).shuffle(unique)
        n_eval = max(1, round(len(unique) * self.settings.eval_fraction))
        if len(unique) - n_eval < 1:
            raise EnvError(f"env 'tasks': {len(unique)} distinct question(s) leave no train task "
                           f"(eval_fraction {self.settings.eval_fraction})")
        return {"eval": unique[:n_eval], "train": unique[n_eval:]}

    def score(self, task: Task, answer: str) -> float:
        entry = self.entries.get(task.id)
        if entry is None:
            return float(same_answer(answer, task.data["answer"]))
        score = self.dataset.score_answer(answer, entry)
        return min(max(float(score), 0.0), 1.0)

    def demonstration(self, task: Task) -> list[dict[str, Any]] | None:
        """The turns that solve `task` with the calculator (OpenAI chat format): one call on the arithmetic
        expression in the question, then the answer; None when the env has no calculator or no expression in the
        question evaluates to a correct answer (`async-rl demos` skips the task)."""
        if "calculator" not in self.settings.tools:
            return None
        for expression in sorted(_EXPRESSION.findall(task.data["question"]), key=len, reverse=True):
            try:
                value = format_number(calculate(expression.strip()))
            except CalcError:
                continue
            if self.score(task, value) >= 1.0 - 1e-9:
                call = {"type": "function", "function": {"name": "calculator",
                                                         "arguments": json.dumps({"expression": expression.strip()})}}
                return [{"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "assistant", "content": f"<answer>{value}</answer>"}]
        return None

    def run_tool(self, call: ToolCall) -> tuple[str, bool]:
        """The tool's answer and whether it worked ("error: ..." when not)."""
        if call.name not in self.settings.tools:
            return f"error: no tool {call.name!r}", False
        key = "expression" if call.name == "calculator" else "code"
        value = call.arguments.get(key)
        if not isinstance(value, str):
            return f"error: {call.name} needs the argument {key!r} as a string", False
        if call.name == "calculator":
            try:
                return format_number(calculate(value)), True
            except CalcError as exc:
                return f"error: {exc}", False
        return self._python(value)

    def _python(self, code: str) -> tuple[str, bool]:
        from rollout.sandbox import Limits, Sandbox

        with self.lock:
            if self._sandbox is None:
                wall = self.settings.python_timeout_s
                limits = Limits(wall_s=wall, test_s=wall, cpu_s=max(1, math.ceil(wall)), output_chars=MAX_RESULT_CHARS)
                self._sandbox = Sandbox(limits, max_concurrent=2)
        result = self._sandbox.run(code, [])
        if result.status == "ok":
            return result.stdout[:MAX_RESULT_CHARS].strip(), True
        why = result.load_error or result.stderr or result.status
        return f"error: {why.strip()[-MAX_RESULT_CHARS:]}", False


def _question_task(record: dict, number: int) -> Task:
    """A tasks-file record: {"question": str, "answer": str or number} (optional "id")."""
    if not isinstance(record.get("question"), str):
        raise ValueError('expected {"question": str, "answer": str or number}')
    answer = record.get("answer")
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise ValueError(f"answer must be a string or a number, got {type(answer).__name__}")
    return Task(id=str(record.get("id", f"line{number}")), data={"question": record["question"], "answer": str(answer)})


def factory(**kwargs: Any) -> TasksFactory:
    """`env.name=tasks` with `env.kwargs` (TasksSettings)."""
    return TasksFactory(settings_from_kwargs("tasks", TasksSettings, kwargs))
