"""The environment seam: what a user implements to train an agent on their own task (docs/environments.md).

An environment is text in, text out. A factory hands out tasks (a "train" and an "eval" split) and makes one
fresh `Env` per trajectory; the rollout worker runs the episode:

    observation = env.reset(task)              # the prompt, or the first tool output
    loop: action = <the policy's text for this turn>
          result = env.step(action)            # the tool's answer, this turn's stage reward, whether it ended
    judgement = env.judge()                    # the final outcome (may be slow: hidden tests, a grader)

These names and signatures are the public API: code outside the project is written against them. Optional
members a factory or an env may add are listed in `EnvFactory` and `Env` (each has a default here).

`env.name` in the config is a built-in short name (`trap`, `hunt`, `coding`) or an import path
`package.module:callable`; the callable is called with `env.kwargs` as keyword arguments and returns the factory
(`load_factory`). Everything a plugin does is checked: a wrong path, a missing attribute, an object without the
methods, an exception inside `reset`/`step`/`judge`, a reward that is not a finite number: each raises `EnvError`
naming the env and the method. Inside a trajectory that abandons the trajectory (counted), never the worker.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import msgspec

from async_rl.errors import AsyncRLError

S = TypeVar("S", bound=msgspec.Struct)


@dataclass
class Task:
    id: str  # unique within the factory; reported in metrics and records
    data: dict  # JSON-serialisable; the replay treats it as opaque (it never sees it)


@dataclass
class StepResult:
    observation: str | None  # the tool's answer (None or "" when the episode ended)
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

    # Optional: `close(self) -> None`, called once when the trajectory is over (judged or abandoned).


@runtime_checkable
class EnvFactory(Protocol):
    def tasks(self, split: str) -> Sequence[Task]: ...  # "train" and "eval"

    def make(self) -> Env: ...  # a fresh environment for one trajectory

    # Optional: `vocabulary(self) -> list[str]`: the whitespace-separated words every text of this env is made
    # of. The built-in tiny model then uses a word-level tokenizer over them (one token per word, a small action
    # space a random policy can explore); without it the tiny model's tokenizer is byte-level (any UTF-8 text).


class EnvError(AsyncRLError):
    """An environment plugin failed or broke the contract; the message names the env and the method."""


BUILTIN = {
    "trap": "rollout.envs.trap:factory",
    "hunt": "rollout.envs.hunt:factory",
    "coding": "rollout.envs.coding:factory",
}


def load_factory(name: str, kwargs: Mapping[str, Any] | None = None) -> EnvFactory:
    """`env.name` (a built-in short name or `package.module:callable`) called with `env.kwargs`."""
    path = BUILTIN.get(name, name)
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise EnvError(
            f"env.name {name!r}: expected a built-in ({', '.join(BUILTIN)}) or an import path package.module:callable"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EnvError(f"env {name!r}: cannot import module {module_name!r}: {exc} (is it on PYTHONPATH?)") from None
    except Exception as exc:
        raise EnvError(f"env {name!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise EnvError(f"env {name!r}: module {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise EnvError(f"env {name!r}: {path} is not callable (expected a function or class returning the factory)")
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


def checked_step(env_name: str, env: Env, action: str) -> StepResult:
    result = env_call(env_name, "step", env.step, action)
    if not isinstance(result, StepResult):
        raise EnvError(f"env {env_name!r}: step returned {type(result).__name__}, expected StepResult")
    reward = finite_number(env_name, "step", "reward", result.reward)
    if result.observation is not None and not isinstance(result.observation, str):
        raise EnvError(f"env {env_name!r}: step returned an observation of type {type(result.observation).__name__}")
    return StepResult(result.observation, reward, bool(result.done))


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
    missing = [m for m in ("reset", "step", "judge") if not callable(getattr(env, m, None))]
    if missing:
        calls = ", ".join(m + "()" for m in missing)
        raise EnvError(f"env {env_name!r}: make() returned {type(env).__name__}, which has no {calls}")
    return env


def vocabulary_of(env_name: str, factory: EnvFactory) -> list[str] | None:
    """The factory's declared vocabulary (optional member), checked; None when it declares none."""
    declare = getattr(factory, "vocabulary", None)
    if declare is None:
        return None
    words = env_call(env_name, "vocabulary", declare)
    if not isinstance(words, list | tuple) or not all(isinstance(w, str) and w.split() == [w] for w in words):
        raise EnvError(f"env {env_name!r}: vocabulary() must return a list of non-empty words without whitespace")
    return list(dict.fromkeys(words))
