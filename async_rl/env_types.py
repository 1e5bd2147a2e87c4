"""The environment seam's types: what a user's environment takes and returns (docs/environments.md).

They live in the kernel so a user imports every one of them from the package's top level (`from async_rl import
Task, StepResult, Judgement, Action, ToolCall, ToolResult`); `rollout/envs/base.py` re-exports them with the checks
around plugin calls. Nothing here knows any environment.

An environment is text in, text out. An environment that declares tools (an optional `tools()` returning
OpenAI-style function specs) gets, each turn, an `Action`: the turn's text and the tool calls parsed from it (or
why they did not parse); it may answer with a list of `ToolResult`, which the model sees as `tool` messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class Task:
    id: str  # unique within the factory; reported in metrics and records
    data: dict  # JSON-serialisable; the replay treats it as opaque (it never sees it)


@dataclass
class ToolCall:
    name: str  # one of the env's tools()
    arguments: dict  # the call's JSON arguments
    id: str = ""  # the runner numbers a turn's calls "call_0", "call_1", ... (formats without ids)


@dataclass
class Action:
    """One turn of an env with tools: the model's text (special tokens dropped) and the calls parsed from it."""

    text: str
    tool_calls: list[ToolCall]  # the calls that parsed, in order (empty: the turn called nothing)
    parse_error: str | None = None  # why a call in the text did not parse (malformed JSON, unknown tool, ...)


@dataclass
class ToolResult:
    content: str  # what the tool answered: the model sees it as a `tool` message
    name: str = ""  # the tool's name
    call_id: str = ""  # the ToolCall.id it answers


@dataclass
class StepResult:
    # The tool's answer (None or "" when the episode ended). An env with tools() may return a list of ToolResult:
    # each becomes a `tool` message of the chat template.
    observation: str | list[ToolResult] | None
    reward: float  # this turn's stage reward
    done: bool


@dataclass
class Judgement:
    score: float  # the final outcome R
    success: bool  # whether it counts as solved (the success windows and the stop rule use this)
    info: dict[str, float] = field(default_factory=dict)  # optional: numbers evaluation averages as eval_<key>


@runtime_checkable
class Env(Protocol):
    def reset(self, task: Task) -> str: ...  # the first observation

    def step(self, action: str) -> StepResult: ...  # one turn: the action's text -> tool result + stage reward

    def judge(self) -> Judgement: ...  # the outcome; may be slow (hidden tests, a grader)

    # Optional members (`close`, `tools`): declared once, with their defaults, on `EnvDefaults` below.


@runtime_checkable
class EnvFactory(Protocol):
    def tasks(self, split: str) -> Sequence[Task]: ...  # "train" and "eval"

    def make(self) -> Env: ...  # a fresh environment for one trajectory

    # Optional members (`vocabulary`, `max_action_tokens`, `demonstration`, `metrics`): declared once, with their
    # defaults, on `EnvFactoryDefaults` below.


# --- the optional members, declared once ----------------------------------------------------------------------------


class EnvDefaults:
    """An `Env`'s optional members, each with the default an env that leaves it out gets. An env may inherit from
    this class (its own members override these, and a type checker sees them on it) or not: the runner takes each
    member through `optional(env, name)`, the env's own or the default here, and calls it."""

    def tools(self) -> list[dict] | None:
        """The env's tools as OpenAI-style function specs ({"type": "function", "function": {"name", "description",
        "parameters"}}), asked once per trajectory right after `reset`. An env that returns specs gets an `Action` in
        `step` (not a str) and may return a list of `ToolResult` as the observation. Default: None, no tools (the
        model's text is the action)."""
        return None

    def close(self) -> None:
        """Called once when the trajectory is over (judged or abandoned): free a sandbox, a container, a file.
        Default: nothing to free."""
        return None


class EnvFactoryDefaults:
    """An `EnvFactory`'s optional members, each with the default a factory that leaves it out gets (as
    `EnvDefaults` for an env)."""

    max_action_tokens: int | None = None
    """The action budget this env suggests, used when `rollout.max_new_tokens` is null. Default: None (256)."""

    def vocabulary(self) -> list[str] | None:
        """The whitespace-separated words every text of this env is made of. The built-in tiny model then uses a
        word-level tokenizer over them (one token per word, a small action space a random policy can explore);
        ignored with `model.path`. Default: None, the tiny model's tokenizer is byte-level (any UTF-8 text)."""
        return None

    def demonstration(self, task: Task) -> list[dict] | None:
        """The assistant turns (OpenAI chat messages, `tool_calls` included) that solve a train task, or None to skip
        it: `async-rl demos` plays them through the env for a warm start. Default: None for every task (`async-rl
        demos` refuses a factory without its own)."""
        return None

    def metrics(self) -> dict[str, float]:
        """The factory's own counts, added to each rollout worker's metrics line. Default: none."""
        return {}

    def close(self) -> None:
        """Called once when the rollout worker (or `async-rl evaluate`) ends: stop a server the factory started.
        Default: nothing to stop."""
        return None


def optional(obj: object, name: str) -> Any:
    """`obj`'s optional member `name` (declared on `EnvDefaults` or `EnvFactoryDefaults`): the object's own when it
    has one, else the declared default (a method bound to `obj`)."""
    defaults = _DECLARED[name]  # a name declared on neither is a bug here, not the user's
    own = getattr(obj, name, None)
    if own is not None:
        return own
    default = defaults[0]
    return default.__get__(obj) if callable(default) else default


def has_own(obj: object, name: str) -> bool:
    """Whether `obj` defines the optional member `name` itself, rather than having (or inheriting) its default."""
    own = getattr(obj, name, None)
    return own is not None and not any(getattr(own, "__func__", own) is d for d in _DECLARED[name])


_DECLARED: dict[str, list[Any]] = {}  # name -> its defaults (`close` is both an env's and a factory's)
for _holder in (EnvDefaults, EnvFactoryDefaults):
    for _name, _value in vars(_holder).items():
        if not _name.startswith("_"):
            _DECLARED.setdefault(_name, []).append(_value)
