"""The env's optional members, declared once with their defaults (async_rl/env_types.py `EnvDefaults`,
`EnvFactoryDefaults`): an env that inherits them, one that leaves them out and one that defines its own are each
taken as they are, and the worker's readers (tools, vocabulary, metrics, the action budget, close, demonstrations)
call the member they get."""

from __future__ import annotations

import pytest

from async_rl import EnvDefaults, EnvFactoryDefaults, Judgement, StepResult, Task
from async_rl.env_types import has_own, optional
from rollout.envs.base import EnvError, env_metrics, tools_of, vocabulary_of


class Plain:  # no optional member at all (duck-typed, as most user envs are)
    def reset(self, task: Task) -> str:
        return "hello"

    def step(self, action: str) -> StepResult:
        return StepResult(None, 0.0, True)

    def judge(self) -> Judgement:
        return Judgement(1.0, True)


class Inheriting(EnvDefaults, Plain):
    pass


class Own(EnvDefaults, Plain):
    def __init__(self) -> None:
        self.closed = 0

    def tools(self) -> list[dict] | None:
        return [{"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}]

    def close(self) -> None:
        self.closed += 1


class PlainFactory:
    def tasks(self, split: str) -> list[Task]:
        return [Task("t0", {})]

    def make(self) -> Plain:
        return Plain()


class OwnFactory(EnvFactoryDefaults, PlainFactory):
    max_action_tokens = 12

    def vocabulary(self) -> list[str]:
        return ["a", "b", "a"]

    def metrics(self) -> dict[str, float]:
        return {"looked": 3}


class InheritingFactory(EnvFactoryDefaults, PlainFactory):
    pass


@pytest.mark.parametrize(("env", "factory"), [(Plain(), PlainFactory()), (Inheriting(), InheritingFactory())],
                         ids=["duck-typed", "inheriting"])
def test_an_env_without_its_own_members_gets_the_declared_defaults(env, factory):
    assert tools_of("x", env) is None
    assert optional(env, "close")() is None
    assert not has_own(env, "tools") and not has_own(env, "close")
    assert vocabulary_of("x", factory) is None and env_metrics("x", factory) == {}
    assert optional(factory, "max_action_tokens") is None
    assert optional(factory, "demonstration")(Task("t0", {})) is None and not has_own(factory, "demonstration")
    assert optional(factory, "close")() is None and not has_own(factory, "close")  # a factory's close, an env's


def test_an_envs_own_members_are_the_ones_called():
    env, factory = Own(), OwnFactory()
    assert [spec["function"]["name"] for spec in tools_of("x", env)] == ["look"]
    optional(env, "close")()
    assert env.closed == 1 and has_own(env, "close") and has_own(env, "tools")
    assert vocabulary_of("x", factory) == ["a", "b"] and env_metrics("x", factory) == {"looked": 3.0}
    assert optional(factory, "max_action_tokens") == 12


def test_an_optional_member_of_the_wrong_kind_is_named():
    class Bad(Plain):
        tools = ["not", "a", "method"]

    class BadVocabulary(PlainFactory):
        vocabulary = "a b"

    with pytest.raises(EnvError, match=r"env 'x': tools is not callable"):
        tools_of("x", Bad())
    with pytest.raises(EnvError, match=r"env 'x': vocabulary is not callable"):
        vocabulary_of("x", BadVocabulary())
