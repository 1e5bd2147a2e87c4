"""The environment seam: what a user implements to train an agent on their own task (docs/environments.md).

An environment is text in, text out. A factory hands out tasks (a "train" and an "eval" split) and makes one
fresh `Env` per trajectory; the rollout worker runs the episode:

    observation = env.reset(task)              # the prompt, or the first tool output
    loop: action = <the policy's text for this turn>
          result = env.step(action)            # the tool's answer, this turn's stage reward, whether it ended
    judgement = env.judge()                    # the final outcome (may be slow: hidden tests, a grader)

These names and signatures are the public API: code outside the project is written against them. The types
(`Task`, `StepResult`, `Judgement`, `Env`, `EnvFactory`, and for envs with tools `Action`, `ToolCall`,
`ToolResult`) live in the kernel, async_rl/env_types.py, and are exported by `async_rl` itself; they are
re-exported here. The optional members a factory or an env may add are declared, with their defaults, on
`EnvFactoryDefaults` and `EnvDefaults` (read through `optional`).

`env.name` in the config is a built-in short name (`trap`, `hunt`, `coding`, `tasks`, `chain`, `agent`, `verifiers`,
`swe`) or an import path `package.module:callable`; the callable is called with `env.kwargs` as keyword arguments
and returns the factory (`load_factory`). Everything a plugin does is checked: a wrong path, a missing attribute, an
object without the methods, an exception inside `reset`/`step`/`judge`, a reward that is not a finite number: each
raises `EnvError` naming the env and the method. Inside a trajectory that abandons the trajectory (counted), never
the worker.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from async_rl.env_types import (  # noqa: F401 - the seam's types, re-exported: every existing import keeps working
    Action,
    Env,
    EnvDefaults,
    EnvFactory,
    EnvFactoryDefaults,
    Judgement,
    StepResult,
    Task,
    ToolCall,
    ToolResult,
    has_own,
    optional,
)
from async_rl.errors import AsyncRLError

S = TypeVar("S", bound=msgspec.Struct)


class EnvError(AsyncRLError):
    """An environment plugin failed or broke the contract; the message names the env and the method."""


BUILTIN = {
    "trap": "rollout.envs.trap:factory",
    "hunt": "rollout.envs.hunt:factory",
    "coding": "rollout.envs.coding:factory",
    "tasks": "rollout.envs.tasks:factory",
    "chain": "rollout.envs.chain:factory",
    "agent": "rollout.agents.env:factory",
    "verifiers": "rollout.agents.verifiers_env:factory",
    "swe": "rollout.envs.swe:factory",
}


def load_callable(path: str, what: str, expected: str = "expected a function") -> Any:
    """The callable at `package.module:attribute`; an EnvError that starts with `what` when it cannot be had."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise EnvError(f"{what}: expected MODULE:FUNCTION, got {path!r}")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise EnvError(f"{what}: cannot import module {module_name!r}: {exc} (is it on PYTHONPATH?)") from None
    except Exception as exc:
        raise EnvError(f"{what}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise EnvError(f"{what}: module {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise EnvError(f"{what}: {path} is not callable ({expected})")
    return target


def load_factory(name: str, kwargs: Mapping[str, Any] | None = None) -> EnvFactory:
    """`env.name` (a built-in short name or `package.module:callable`) called with `env.kwargs`."""
    path = BUILTIN.get(name, name)
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise EnvError(
            f"env.name {name!r}: expected a built-in ({', '.join(BUILTIN)}) or an import path package.module:callable"
        )
    target = load_callable(path, f"env {name!r}", "expected a function or class returning the factory")
    kwargs = dict(kwargs or {})
    _check_kwargs(name, target, kwargs)
    try:
        factory = target(**kwargs)
    except AsyncRLError:
        raise
    except Exception as exc:
        raise EnvError(f"env {name!r}: {path}(**env.kwargs) raised {type(exc).__name__}: {exc}") from None
    missing = [m for m in ("tasks", "make") if not callable(getattr(factory, m, None))]
    if missing:
        raise EnvError(
            f"env {name!r}: {path} returned {type(factory).__name__}, which has no "
            f"{' or '.join(m + '()' for m in missing)} "
            "(an EnvFactory needs tasks(split) and make())"
        )
    return factory


def _check_kwargs(name: str, target: Callable, kwargs: dict[str, Any]) -> None:
    """Name an unknown env.kwargs key before calling (a TypeError from inside the call would be vaguer)."""
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    accepted = [n for n, p in parameters.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for key in kwargs:
        if key not in accepted:
            raise EnvError(f"env.kwargs.{key}: env {name!r} takes no such argument (accepted: {', '.join(accepted)})")


def settings_from_kwargs(env_name: str, settings: type[S], kwargs: Mapping[str, Any]) -> S:
    """`env.kwargs` validated into an env's settings Struct (unknown keys, types and ranges named like config
    errors: `env.kwargs.stages: expected int >= 1, got 0`)."""
    unknown = [key for key in kwargs if key not in settings.__struct_fields__]
    if unknown:
        raise EnvError(
            f"env.kwargs.{unknown[0]}: env {env_name!r} takes no such setting "
            f"(allowed: {', '.join(settings.__struct_fields__)})"
        )
    try:
        return msgspec.convert(dict(kwargs), settings, strict=False)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = re.search(r" - at `\$\.?(.*)`$", text)
        detail = text.split(" - at ")[0]
        detail = detail[0].lower() + detail[1:]
        if match:  # a field's type or range
            key = match.group(1)
            got = "" if "got" in detail else f", got {kwargs.get(key)!r}"
            raise EnvError(f"env.kwargs.{key}: {detail}{got}") from None
        # __post_init__ checks across fields say "key: why"
        across = f"env.kwargs.{detail}" if re.match(r"\w+: ", detail) else f"env {env_name!r}: {detail}"
        raise EnvError(across) from None


def env_call(env_name: str, method: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Call one plugin method; any exception becomes `EnvError` naming the env and the method."""
    try:
        return fn(*args)
    except EnvError:
        raise
    except Exception as exc:
        raise EnvError(f"env {env_name!r}: {method} raised {type(exc).__name__}: {exc}") from exc


def finite_number(env_name: str, method: str, what: str, value: Any) -> float:
    """`value` as a float, or `EnvError` if it is not a finite real number (bools are refused too)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EnvError(f"env {env_name!r}: {method} returned a {what} of type {type(value).__name__}, not a number")
    if not math.isfinite(value):
        raise EnvError(f"env {env_name!r}: {method} returned a non-finite {what}: {value}")
    return float(value)


def checked_reset(env_name: str, env: Env, task: Task) -> str:
    observation = env_call(env_name, "reset", env.reset, task)
    if not isinstance(observation, str):
        raise EnvError(f"env {env_name!r}: reset returned {type(observation).__name__}, expected str")
    return observation


def checked_step(env_name: str, env: Env, action: str | Action) -> StepResult:
    """`env.step(action)` checked; the observation may be None, a str, or (an env with tools) a list of
    ToolResult whose fields are strings."""
    result = env_call(env_name, "step", env.step, action)
    if not isinstance(result, StepResult):
        raise EnvError(f"env {env_name!r}: step returned {type(result).__name__}, expected StepResult")
    reward = finite_number(env_name, "step", "reward", result.reward)
    observation = result.observation
    if isinstance(observation, list | tuple):
        for item in observation:
            if not isinstance(item, ToolResult):
                raise EnvError(f"env {env_name!r}: step returned an observation list holding a "
                               f"{type(item).__name__}, expected ToolResult")
            for name in ("content", "name", "call_id"):
                if not isinstance(getattr(item, name), str):
                    raise EnvError(f"env {env_name!r}: step returned a ToolResult whose {name} is a "
                                   f"{type(getattr(item, name)).__name__}, expected str")
        observation = list(observation)
    elif observation is not None and not isinstance(observation, str):
        raise EnvError(f"env {env_name!r}: step returned an observation of type {type(observation).__name__} "
                       "(expected str, None, or a list of ToolResult)")
    return StepResult(observation, reward, bool(result.done))


def tools_of(env_name: str, env: Env) -> list[dict] | None:
    """The env's tool specs (optional member `tools()`), checked: None when it has no `tools`; else a list of
    OpenAI-style function specs ({"type": "function", "function": {"name": ..., ...}}) with distinct names, JSON
    serialisable."""
    declare = optional(env, "tools")
    if not callable(declare):
        raise EnvError(f"env {env_name!r}: tools is not callable (expected a method returning a list of specs)")
    specs = env_call(env_name, "tools", declare)
    if specs is None:
        return None
    if not isinstance(specs, list | tuple):
        raise EnvError(f"env {env_name!r}: tools() returned {type(specs).__name__}, expected a list of dicts")
    names: list[str] = []
    for spec in specs:
        function = spec.get("function") if isinstance(spec, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(spec, dict) or spec.get("type") != "function" or not isinstance(name, str) or not name:
            raise EnvError(f"env {env_name!r}: tools() holds {spec!r:.200}, expected "
                           '{"type": "function", "function": {"name": ..., "description": ..., "parameters": ...}}')
        if name in names:
            raise EnvError(f"env {env_name!r}: tools() names {name!r} twice")
        names.append(name)
    try:
        json.dumps(list(specs))
    except (TypeError, ValueError) as exc:
        raise EnvError(f"env {env_name!r}: tools() is not JSON-serialisable: {exc}") from None
    return list(specs)


def checked_judge(env_name: str, env: Env) -> Judgement:
    judgement = env_call(env_name, "judge", env.judge)
    if not isinstance(judgement, Judgement):
        raise EnvError(f"env {env_name!r}: judge returned {type(judgement).__name__}, expected Judgement")
    score = finite_number(env_name, "judge", "score", judgement.score)
    info = {str(k): finite_number(env_name, "judge", f"info[{k!r}]", v) for k, v in (judgement.info or {}).items()}
    return Judgement(score, bool(judgement.success), info)


def checked_tasks(env_name: str, factory: EnvFactory, split: str) -> list[Task]:
    tasks = env_call(env_name, f"tasks({split!r})", factory.tasks, split)
    try:
        tasks = list(tasks)
    except TypeError:
        raise EnvError(f"env {env_name!r}: tasks({split!r}) returned {type(tasks).__name__}, not a sequence") from None
    if not tasks:
        raise EnvError(f"env {env_name!r}: tasks({split!r}) returned no task")
    for task in tasks:
        if not isinstance(task, Task):
            raise EnvError(f"env {env_name!r}: tasks({split!r}) holds a {type(task).__name__}, expected Task")
    return tasks


def checked_make(env_name: str, factory: EnvFactory) -> Env:
    env = env_call(env_name, "make", factory.make)
    needed = ("reset_tokens", "step_tokens", "judge") if token_level(env) else ("reset", "step", "judge")
    missing = [m for m in needed if not callable(getattr(env, m, None))]
    if missing:
        calls = ", ".join(m + "()" for m in missing)
        raise EnvError(f"env {env_name!r}: make() returned {type(env).__name__}, which has no {calls}")
    return env


# --- token-level environments ------------------------------------------------------------------------------------
# An env whose `reset_tokens(task) -> Prompt` and `step_tokens(generation) -> StepResult` (observation a Prompt or
# None) replace `reset` and `step` hands the runner tokens, not text: it renders its own observations and sees the
# model's sampled tokens as they are (the `agent` env's trajectory, rollout/agents/trajectory.py, which serves
# them to an outside agent over an OpenAI-compatible endpoint). An internal seam, not the public one: its Prompt
# tokens are appended to the trajectory's context unchanged.


@dataclass
class Prompt:
    """What a token-level env shows the model next: tokens appended to the trajectory's context as they are, the
    most action tokens the next turn may take (None: the runner's own budget), and who hears each action token as
    the engine samples it (an engine that streams them: the built-in one; others hand all of them over at the end)."""

    tokens: list[int]
    max_new_tokens: int | None = None
    on_token: Callable[[int], None] | None = None  # on the engine's thread: quick, and never raising


def token_level(env: Any) -> bool:
    return callable(getattr(env, "step_tokens", None)) and callable(getattr(env, "reset_tokens", None))


def _checked_prompt(env_name: str, method: str, prompt: Any) -> Prompt:
    if not isinstance(prompt, Prompt):
        raise EnvError(f"env {env_name!r}: {method} returned {type(prompt).__name__}, expected Prompt")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt.tokens):
        raise EnvError(f"env {env_name!r}: {method} returned a Prompt whose tokens are not token ids")
    if prompt.max_new_tokens is not None and (not isinstance(prompt.max_new_tokens, int) or prompt.max_new_tokens < 1):
        raise EnvError(f"env {env_name!r}: {method} returned a Prompt with max_new_tokens {prompt.max_new_tokens!r}")
    if prompt.on_token is not None and not callable(prompt.on_token):
        raise EnvError(f"env {env_name!r}: {method} returned a Prompt whose on_token is not callable")
    return Prompt(list(prompt.tokens), prompt.max_new_tokens, prompt.on_token)


def checked_reset_tokens(env_name: str, env: Any, task: Task) -> Prompt:
    return _checked_prompt(env_name, "reset", env_call(env_name, "reset", env.reset_tokens, task))


def checked_step_tokens(env_name: str, env: Any, generation: Any) -> StepResult:
    """`env.step_tokens(generation)` checked: a StepResult whose observation is a Prompt, or None when done."""
    result = env_call(env_name, "step", env.step_tokens, generation)
    if not isinstance(result, StepResult):
        raise EnvError(f"env {env_name!r}: step returned {type(result).__name__}, expected StepResult")
    reward = finite_number(env_name, "step", "reward", result.reward)
    observation = None if result.observation is None else _checked_prompt(env_name, "step", result.observation)
    if observation is None and not result.done:
        raise EnvError(f"env {env_name!r}: step returned no Prompt for a trajectory that goes on")
    return StepResult(observation, reward, bool(result.done))  # type: ignore[arg-type]


def env_metrics(env_name: str, factory: EnvFactory) -> dict[str, float]:
    """The factory's own counts for the rollout metrics line (optional member `metrics() -> dict[str, number]`); {}
    when it has none. A factory whose metrics() raises or returns something else costs only its counts (logged)."""
    report = optional(factory, "metrics")
    if not callable(report):
        return {}
    try:
        counts = report()
        return {str(k): finite_number(env_name, "metrics", f"count {k!r}", v) for k, v in dict(counts).items()}
    except Exception as exc:
        import logging

        logging.getLogger("async_rl.rollout").warning("env %r: metrics() failed: %s", env_name, exc)
        return {}


def close_factory(env_name: str, factory: EnvFactory) -> None:
    """The factory's optional `close()` (a worker's or an evaluation's end: stop a server it started); one that
    raises is logged, never raised."""
    close = optional(factory, "close")
    if not callable(close):
        return
    try:
        close()
    except Exception as exc:
        import logging

        logging.getLogger("async_rl.rollout").warning("env %r: close() failed: %s: %s", env_name, type(exc).__name__,
                                                      exc)


def vocabulary_of(env_name: str, factory: EnvFactory) -> list[str] | None:
    """The factory's declared vocabulary (optional member), checked; None when it declares none."""
    declare = optional(factory, "vocabulary")
    if not callable(declare):
        raise EnvError(f"env {env_name!r}: vocabulary is not callable (expected a method returning a list of words)")
    words = env_call(env_name, "vocabulary", declare)
    if words is None:
        return None
    if not isinstance(words, list | tuple) or not all(isinstance(w, str) and w.split() == [w] for w in words):
        raise EnvError(f"env {env_name!r}: vocabulary() must return a list of non-empty words without whitespace")
    return list(dict.fromkeys(words))
