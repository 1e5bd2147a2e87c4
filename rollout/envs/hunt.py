"""A long-horizon environment that needs its observations: a treasure hunt through a chain of rooms.

Each task is a house of `rooms` rooms in a row. Entering a room, the agent's tool shows a sign, a colour drawn
at random for this episode; the door to take is the house's cipher of that colour (a fixed permutation; the
houses share `ciphers` of them, one by default, so the skill is reading the sign and the per-house part is the
traps).
The agent answers with a two-word action, `go <door>`. The right door earns stage reward 1 and leads to the next
room (and its sign); a wrong door earns 0 and the tool says `wall`, without showing the sign again: the agent
must remember what the tool answered earlier. Anything else (`huh`) is a miss too. After `retries` misses in one
room the episode ends, failed. At a few *trap* rooms one fixed door also opens (stage reward 1) whatever the
sign says, but the house is then a dead end: the outcome is 0. So the stage rewards are informative (right
doors earn them) and can mislead (a trap earns them too, and needs no sign).

    task3 room1 sign red  →  go C  →  room2 sign blue  →  go A  →  wall  →  go D  →  room3 sign red  → …

A policy that ignores the signs opens a room with probability 1 − (1 − 1/doors)^(1 + retries): with the defaults
(8 rooms, 4 doors, 2 retries) 0.58 per room and about 0.58⁸ ≈ 0.013 per episode. `async-rl evaluate --blind`
replaces every tool answer by a fixed string to measure what a trained policy does without them.

`env.name=hunt`, settings in `env.kwargs` (`HuntSettings`). Episodes are seeded (`seed` and a per-factory
counter), so a run is reproducible; train and eval split are the same `num_tasks` houses, with fresh signs.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from rollout.envs.base import Judgement, StepResult, Task, settings_from_kwargs

DOORS = "ABCDEFGH"
COLOURS = ("red", "green", "blue", "yellow", "white", "black", "pink", "gray")
GO, WALL, HUH, SIGN = "go", "wall", "huh", "sign"


class HuntSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    seed: int = 0  # derives the houses (ciphers, traps) and the episodes' signs
    num_tasks: Annotated[int, msgspec.Meta(ge=1, le=64)] = 8  # houses
    ciphers: Annotated[int, msgspec.Meta(ge=1)] = 1  # distinct sign-to-door ciphers; house t uses cipher t % ciphers
    rooms: Annotated[int, msgspec.Meta(ge=1, le=32)] = 8  # turns of a perfect episode
    doors: Annotated[int, msgspec.Meta(ge=2, le=len(DOORS))] = 4  # doors per room = colours of a sign
    traps: Annotated[int, msgspec.Meta(ge=0)] = 2  # rooms with a trap door
    retries: Annotated[int, msgspec.Meta(ge=0)] = 2  # extra attempts in a room after a miss
    step_latency_s: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0  # simulated tool time per step
    judge_delay_s: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0  # simulated judge time before the outcome

    def __post_init__(self) -> None:
        if self.traps > self.rooms:
            raise ValueError(f"traps: expected <= rooms ({self.rooms}), got {self.traps}")


@dataclass(frozen=True)
class House:
    cipher: tuple[int, ...]  # colour -> door
    traps: dict[int, int]  # trap room -> its trap door


def make_house(settings: HuntSettings, task: int) -> House:
    cipher = list(range(settings.doors))
    random.Random(f"hunt-cipher/{settings.seed}/{task % settings.ciphers}").shuffle(cipher)
    rng = random.Random(f"hunt-env/{settings.seed}/{task}")
    trap_rooms = sorted(rng.sample(range(settings.rooms), settings.traps))
    return House(tuple(cipher), {room: rng.randrange(settings.doors) for room in trap_rooms})


class HuntEnv:
    def __init__(self, settings: HuntSettings, houses: list[House], seed: int) -> None:
        self.settings = settings
        self.houses = houses
        self.rng = random.Random(seed)
        self.house: House | None = None
        self.room = self.sign = self.misses_left = 0
        self.trapped = self.failed = self.done = False

    def reset(self, task: Task) -> str:
        number = int(task.data["house"])
        self.house = self.houses[number]
        self.room, self.misses_left = 0, self.settings.retries
        self.trapped = self.failed = self.done = False
        return f"task{number} {self._enter()}"

    def step(self, action: str) -> StepResult:
        if self.house is None or self.done:
            raise RuntimeError("HuntEnv.step called before reset(task) or after the episode ended")
        if self.settings.step_latency_s > 0:  # sleep(0) hands the GIL away (an inline call waits to get it back)
            time.sleep(self.settings.step_latency_s)
        words = action.split()
        door = DOORS.index(words[1]) if len(words) == 2 and words[0] == GO and words[1] in self._doors() else None
        if door is not None and door == self.house.cipher[self.sign]:
            return self._advance()
        if door is not None and self.house.traps.get(self.room) == door:
            self.trapped = True  # it opened: the stage reward says "right", the outcome will not
            return self._advance()
        if self.misses_left > 0:
            self.misses_left -= 1
            return StepResult(WALL if door is not None else HUH, 0.0, False)
        self.failed = self.done = True
        return StepResult(None, 0.0, True)

    def judge(self) -> Judgement:
        if self.settings.judge_delay_s > 0:
            time.sleep(self.settings.judge_delay_s)
        solved = self.done and not (self.trapped or self.failed)
        return Judgement(score=float(solved), success=solved, info={"trap_rate": float(self.trapped)})

    def _doors(self) -> str:
        return DOORS[: self.settings.doors]

    def _enter(self) -> str:
        self.sign = self.rng.randrange(self.settings.doors)
        return f"room{self.room + 1} {SIGN} {COLOURS[self.sign]}"

    def _advance(self) -> StepResult:
        self.room += 1
        self.misses_left = self.settings.retries
        if self.room == self.settings.rooms:
            self.done = True
            return StepResult(None, 1.0, True)
        return StepResult(self._enter(), 1.0, False)


class HuntFactory:
    max_action_tokens = 2  # `go <door>`: the rollout.max_new_tokens this env suggests

    def __init__(self, settings: HuntSettings) -> None:
        self.settings = settings
        self.houses = [make_house(settings, t) for t in range(settings.num_tasks)]
        self._tasks = [Task(id=str(t), data={"house": t}) for t in range(settings.num_tasks)]
        self._episode_seeds = random.Random(f"hunt-episodes/{settings.seed}")
        self._lock = threading.Lock()

    def tasks(self, split: str) -> list[Task]:
        return list(self._tasks)

    def make(self) -> HuntEnv:
        with self._lock:
            seed = self._episode_seeds.getrandbits(64)
        return HuntEnv(self.settings, self.houses, seed)

    def vocabulary(self) -> list[str]:
        s = self.settings
        return (
            [GO, WALL, HUH, SIGN]
            + [f"task{t}" for t in range(s.num_tasks)]
            + [f"room{r + 1}" for r in range(s.rooms)]
            + list(DOORS[: s.doors])
            + list(COLOURS[: s.doors])
        )


def factory(**kwargs: Any) -> HuntFactory:
    """`env.name=hunt`: `env.kwargs` are `HuntSettings` fields."""
    return HuntFactory(settings_from_kwargs("hunt", HuntSettings, kwargs))
