"""The environment seam: loading a plugin by name or import path, and every way a plugin can be wrong.

Each bad case must raise `EnvError` naming the env and the method (or the setting); inside a trajectory the
runner turns it into an abandoned trajectory (tests/test_rollout.py), never a dead worker.
"""

from __future__ import annotations

import math
import sys
import textwrap

import pytest

from rollout.envs.base import (
    EnvError,
    Judgement,
    StepResult,
    Task,
    checked_judge,
    checked_make,
    checked_reset,
    checked_step,
    checked_tasks,
    load_factory,
    vocabulary_of,
)
from rollout.envs.hunt import COLOURS, DOORS, HuntEnv, HuntSettings, make_house
from rollout.envs.hunt import factory as hunt_factory

GOOD_PLUGIN = '''
from rollout.envs.base import Judgement, StepResult, Task

class Echo:
    def __init__(self, target): self.target, self.turns = target, 0
    def reset(self, task): self.turns = 0; return "say " + task.data["word"]
    def step(self, action):
        self.turns += 1
        return StepResult(observation="again", reward=float(action.strip() == self.target), done=self.turns >= 2)
    def judge(self): return Judgement(score=1.0, success=True)

class Factory:
    def __init__(self, word="hi"): self.word = word
    def tasks(self, split): return [Task(id=split + "-1", data={"word": self.word})]
    def make(self): return Echo(self.word)

def factory(word="hi"):
    return Factory(word)

not_callable = 3

def returns_nothing_useful():
    return object()

def raises(**kwargs):
    raise RuntimeError("no database")
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A user's module outside the project, importable by name (as on PYTHONPATH)."""
    (tmp_path / "my_plugin_env.py").write_text(textwrap.dedent(GOOD_PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_plugin_env"
    sys.modules.pop("my_plugin_env", None)


def test_a_user_module_loads_by_import_path_with_its_kwargs(plugin):
    factory = load_factory(f"{plugin}:factory", {"word": "yo"})
    (task,) = checked_tasks(plugin, factory, "train")
    env = checked_make(plugin, factory)
    assert checked_reset(plugin, env, task) == "say yo"
    assert checked_step(plugin, env, "yo") == StepResult("again", 1.0, False)
    assert checked_judge(plugin, env) == Judgement(1.0, True, {})


def test_builtins_load_by_short_name_and_by_import_path():
    assert type(load_factory("trap")).__name__ == "TrapFactory"
    assert type(load_factory("rollout.envs.trap:factory", {"stages": 2})).__name__ == "TrapFactory"
    assert type(load_factory("hunt", {"rooms": 3})).__name__ == "HuntFactory"


@pytest.mark.parametrize(
    ("name", "kwargs", "expected"),
    [
        ("no_such_module_xyz:f", {}, "env 'no_such_module_xyz:f': cannot import module 'no_such_module_xyz'"),
        ("PLUGIN:missing", {}, "module 'my_plugin_env' has no attribute 'missing'"),
        ("PLUGIN", {}, "expected a built-in (trap, hunt, coding, tasks, chain, agent, verifiers, swe) or an "
                       "import path"),
        ("PLUGIN:not_callable", {}, "my_plugin_env:not_callable is not callable"),
        ("PLUGIN:returns_nothing_useful", {}, "which has no tasks() or make()"),
        ("PLUGIN:raises", {}, "my_plugin_env:raises(**env.kwargs) raised RuntimeError: no database"),
        ("PLUGIN:factory", {"colour": "red"}, "env.kwargs.colour: env 'my_plugin_env:factory' takes no such argument"),
        ("trap", {"stages": 0}, "env.kwargs.stages: expected `int` >= 1, got 0"),
        ("trap", {"stagez": 3}, "env.kwargs.stagez: env 'trap' takes no such setting"),
        ("trap", {"traps": 5, "stages": 2}, "env.kwargs.traps: expected <= stages (2), got 5"),
        ("hunt", {"doors": "many"}, "env.kwargs.doors: expected `int`, got `str`"),
    ],
)
def test_a_bad_plugin_is_named_with_what_is_wrong(plugin, name, kwargs, expected):
    with pytest.raises(EnvError) as info:
        load_factory(name.replace("PLUGIN", plugin), kwargs)
    assert expected in str(info.value)


class Broken:
    """An env whose every method can be made to misbehave."""

    def __init__(self, **bad):
        self.bad = bad

    def reset(self, task):
        if "reset" in self.bad:
            return self.bad["reset"]()
        return "start"

    def step(self, action):
        return self.bad.get("step", lambda: StepResult("obs", 1.0, False))()

    def judge(self):
        return self.bad.get("judge", lambda: Judgement(1.0, True))()


def boom():
    raise ZeroDivisionError("tool crashed")


@pytest.mark.parametrize(
    ("method", "bad", "expected"),
    [
        ("reset", boom, "env 'broken': reset raised ZeroDivisionError: tool crashed"),
        ("reset", lambda: 42, "env 'broken': reset returned int, expected str"),
        ("step", boom, "env 'broken': step raised ZeroDivisionError: tool crashed"),
        ("step", lambda: ("obs", 1.0, False), "env 'broken': step returned tuple, expected StepResult"),
        ("step", lambda: StepResult("obs", math.nan, False), "env 'broken': step returned a non-finite reward: nan"),
        ("step", lambda: StepResult("obs", math.inf, False), "env 'broken': step returned a non-finite reward: inf"),
        ("step", lambda: StepResult("obs", "1.0", False), "env 'broken': step returned a reward of type str"),
        ("step", lambda: StepResult("obs", True, False), "env 'broken': step returned a reward of type bool"),
        ("step", lambda: StepResult(7, 1.0, False), "env 'broken': step returned an observation of type int"),
        ("judge", boom, "env 'broken': judge raised ZeroDivisionError: tool crashed"),
        ("judge", lambda: 1.0, "env 'broken': judge returned float, expected Judgement"),
        ("judge", lambda: Judgement(math.nan, False), "env 'broken': judge returned a non-finite score: nan"),
        ("judge", lambda: Judgement(1.0, True, {"x": math.inf}), "judge returned a non-finite info['x']: inf"),
    ],
)
def test_a_misbehaving_env_method_is_named(method, bad, expected):
    env = Broken(**{method: bad})
    task = Task("t", {})
    with pytest.raises(EnvError) as info:
        checked_reset("broken", env, task)
        checked_step("broken", env, "go")
        checked_judge("broken", env)
    assert expected in str(info.value)


def test_bad_factories_are_named():
    class NoTasks:
        def tasks(self, split):
            return []

        def make(self):
            return object()

        def vocabulary(self):
            return ["two words"]

    with pytest.raises(EnvError, match=r"env 'f': tasks\('train'\) returned no task"):
        checked_tasks("f", NoTasks(), "train")
    with pytest.raises(EnvError, match=r"make\(\) returned object, which has no reset\(\), step\(\), judge\(\)"):
        checked_make("f", NoTasks())
    with pytest.raises(EnvError, match="vocabulary\\(\\) must return a list of non-empty words"):
        vocabulary_of("f", NoTasks())


# --- the hunt: a long-horizon env that needs its observations -------------------------------------------------


def test_the_hunt_rewards_the_ciphered_door_and_needs_the_sign():
    settings = HuntSettings(seed=3, num_tasks=2, rooms=4, doors=4, traps=0, retries=1)
    factory = hunt_factory(seed=3, num_tasks=2, rooms=4, doors=4, traps=0, retries=1)
    house = make_house(settings, 1)
    env = factory.make()
    observation = env.reset(Task("1", {"house": 1}))
    turns = 0
    while True:
        colour = observation.split()[-1]
        door = DOORS[house.cipher[COLOURS.index(colour)]]
        result = env.step(f"go {door}")
        turns += 1
        assert result.reward == 1.0
        if result.done:
            break
        observation = result.observation
        assert observation.startswith(f"room{turns + 1} sign ")
    assert turns == 4 and env.judge() == Judgement(1.0, True, {"trap_rate": 0.0})


def test_a_wrong_door_says_wall_without_the_sign_and_garbage_says_huh():
    settings = HuntSettings(seed=0, num_tasks=1, rooms=3, doors=4, traps=0, retries=2)
    env = HuntEnv(settings, [make_house(settings, 0)], seed=1)
    observation = env.reset(Task("0", {"house": 0}))
    right = env.house.cipher[COLOURS.index(observation.split()[-1])]
    wrong = DOORS[(right + 1) % 4]
    assert env.step(f"go {wrong}") == StepResult("wall", 0.0, False)
    assert env.step("open sesame") == StepResult("huh", 0.0, False)
    assert env.step(f"go {wrong}") == StepResult(None, 0.0, True)  # retries spent
    assert env.judge().success is False


def test_a_trap_door_opens_but_the_outcome_is_zero():
    settings = HuntSettings(seed=5, num_tasks=1, rooms=2, doors=4, traps=2, retries=0)
    house = make_house(settings, 0)
    for episode in range(50):  # find an episode whose room-1 sign does not point at the trap door
        env = HuntEnv(settings, [house], seed=episode)
        colour = env.reset(Task("0", {"house": 0})).split()[-1]
        if house.cipher[COLOURS.index(colour)] != house.traps[0]:
            break
    result = env.step(f"go {DOORS[house.traps[0]]}")
    assert result.reward == 1.0 and not result.done
    colour = result.observation.split()[-1]
    assert env.step(f"go {DOORS[house.cipher[COLOURS.index(colour)]]}").done
    assert env.judge() == Judgement(0.0, False, {"trap_rate": 1.0})


def test_signs_vary_between_episodes_and_episodes_are_reproducible():
    def signs(factory):
        return [factory.make().reset(Task("0", {"house": 0})) for _ in range(20)]

    first, again = signs(hunt_factory(seed=1)), signs(hunt_factory(seed=1))
    assert first == again and len(set(first)) > 1


def test_a_policy_blind_to_the_signs_rarely_succeeds():
    """Always `go A`, whatever the sign: right in 1 room of 4 (a retry repeats the same door), 0.25**8 overall."""
    factory = hunt_factory(traps=0)
    successes = 0
    for episode in range(400):
        env = factory.make()
        env.reset(factory.tasks("train")[episode % 8])
        result = StepResult("", 0.0, False)
        while not result.done:
            result = env.step("go A")
        successes += env.judge().success
    assert successes / 400 < 0.05


def test_the_hunt_declares_a_small_vocabulary_and_two_token_actions():
    factory = hunt_factory(num_tasks=2, rooms=2, doors=2)
    assert factory.vocabulary() == ["go", "wall", "huh", "sign", "task0", "task1", "room1", "room2", "A", "B", "red",
                                    "green"]
    assert factory.max_action_tokens == 2
