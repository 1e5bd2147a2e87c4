"""The built-in multi-stage environment with traps (docs/algorithm.md), text in and text out.

Each task hides a secret code of `stages` symbols drawn from `choices` options. The agent names one symbol per
turn. A correct symbol earns stage reward 1 and advances. At a few *trap* stages one wrong symbol also earns
stage reward 1 and advances ("it looks right"), but the final outcome of that trajectory is then 0: only the
outcome tells a trap from the code, which is what immediate updates alone cannot learn. A miss earns 0; the
agent may retry a stage `retries` times, so trajectory lengths vary.

An episode reads, one word per token (the env declares its vocabulary, so the tiny model's tokenizer is
word-level):  `task7 stage1` → `C` → `ok stage2` → `A` → `miss stage2` → `B` …

`env.name=trap`, settings in `env.kwargs` (`TrapSettings`). The train and the eval split are the same
`num_tasks` tasks: the task *is* its secret code, there is nothing held out to generalise to.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from rollout.envs.base import Judgement, StepResult, Task, settings_from_kwargs

OK, MISS = "ok", "miss"
SYMBOLS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def task_word(task_id: int) -> str:
    return f"task{task_id}"


def stage_word(stage: int) -> str:
    return f"stage{stage + 1}"


def symbol(choice: int) -> str:
    return SYMBOLS[choice]


class TrapSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    seed: int = 0  # derives every task's secret code and trap stages
    num_tasks: Annotated[int, msgspec.Meta(ge=1)] = 16
    stages: Annotated[int, msgspec.Meta(ge=1, le=32)] = 4  # symbols in each secret code
    choices: Annotated[int, msgspec.Meta(ge=2, le=26)] = 6  # options per stage
    traps: Annotated[int, msgspec.Meta(ge=0)] = 2  # stages that also have a trap symbol
    retries: Annotated[int, msgspec.Meta(ge=0)] = 1  # extra attempts at a stage after a miss
    step_latency_s: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0  # simulated tool time per step
    # Long-tailed trajectory durations: each trajectory's steps take step_latency_s × m, m drawn once per trajectory
    # from a log-normal with this σ and mean 1 (0: every step takes step_latency_s; 1: p99 ≈ 6×, max of 128 ≈ 8×).
    step_latency_sigma: Annotated[float, msgspec.Meta(ge=0.0, le=4.0)] = 0.0
    outcome_delay_s: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0  # simulated judge time before the outcome

    def __post_init__(self) -> None:
        if self.traps > self.stages:
            raise ValueError(f"traps: expected <= stages ({self.stages}), got {self.traps}")


@dataclass(frozen=True)
class TrapTask:
    code: tuple[int, ...]  # the right choice at each stage
    traps: dict[int, int]  # trap stage -> the trap choice there (never the code's choice)


def make_task(settings: TrapSettings, task_id: int) -> TrapTask:
    """Task `task_id` of the environment seeded `settings.seed`; independent of `num_tasks`, so tasks stay put."""
    if not 0 <= task_id < settings.num_tasks:
        raise ValueError(f"task_id: expected 0 <= task_id < num_tasks ({settings.num_tasks}), got {task_id}")
    rng = random.Random(f"trap-env/{settings.seed}/{task_id}")
    code = tuple(rng.randrange(settings.choices) for _ in range(settings.stages))
    trap_stages = sorted(rng.sample(range(settings.stages), settings.traps))
    traps = {s: rng.choice([c for c in range(settings.choices) if c != code[s]]) for s in trap_stages}
    return TrapTask(code=code, traps=traps)


class TrapEnv:
    """One trajectory: `reset(task)`, then `step(action)` until done, then `judge()`."""

    def __init__(self, settings: TrapSettings) -> None:
        self.settings = settings
        self._symbols = {symbol(c): c for c in range(settings.choices)}
        self.task: TrapTask | None = None
        self.stage = 0  # from 0
        self.retries_left = 0
        self.trapped = False
        self.failed = False
        self.done = False
        self.latency_factor = 1.0  # this trajectory's step_latency_s multiplier (step_latency_sigma)

    def reset(self, task: Task) -> str:
        task_id = int(task.data["task"])
        self.task = make_task(self.settings, task_id)
        self.stage = 0
        self.retries_left = self.settings.retries
        self.trapped = self.failed = self.done = False
        sigma = self.settings.step_latency_sigma
        # Only the latency is random (the process's generator: a Random() per env read os.urandom each time); the
        # task and its code stay deterministic.
        self.latency_factor = math.exp(sigma * random.gauss(0.0, 1.0) - sigma**2 / 2) if sigma > 0 else 1.0
        return f"{task_word(task_id)} {stage_word(0)}"

    def step(self, action: str) -> StepResult:
        """Apply one action. Sleeps `step_latency_s` × this trajectory's latency factor (a tool call)."""
        if self.task is None:
            raise RuntimeError("TrapEnv.step called before reset(task)")
        if self.done:
            raise RuntimeError("TrapEnv.step called after the episode ended; call reset(task) first")
        if self.settings.step_latency_s > 0:
            time.sleep(self.settings.step_latency_s * self.latency_factor)
        choice = self._symbols.get(action.strip())  # anything but exactly one known symbol is a miss
        if choice is not None and choice == self.task.code[self.stage]:
            return self._advance()
        if choice is not None and self.task.traps.get(self.stage) == choice:
            self.trapped = True  # the stage reward says "right"; the outcome will say otherwise
            return self._advance()
        if self.retries_left > 0:
            self.retries_left -= 1
            return StepResult(f"{MISS} {stage_word(self.stage)}", 0.0, False)
        self.failed = self.done = True
        return StepResult(None, 0.0, True)

    def judge(self) -> Judgement:
        """The final reward, known only after a slow judge (`outcome_delay_s`): 1 for the exact code, else 0.
        A trajectory cut short (context limit) is judged as it stands: not solved."""
        if self.settings.outcome_delay_s > 0:  # sleep(0) would hand the GIL away: a judge run inline waits for it
            time.sleep(self.settings.outcome_delay_s)
        solved = self.done and not (self.trapped or self.failed)
        return Judgement(score=1.0 if solved else 0.0, success=solved, info={"trap_rate": float(self.trapped)})

    def _advance(self) -> StepResult:
        self.stage += 1
        self.retries_left = self.settings.retries
        if self.stage == self.settings.stages:
            self.done = True
            return StepResult(None, 1.0, True)
        return StepResult(f"{OK} {stage_word(self.stage)}", 1.0, False)


class TrapFactory:
    max_action_tokens = 1  # one symbol per turn: the rollout.max_new_tokens this env suggests

    def __init__(self, settings: TrapSettings) -> None:
        self.settings = settings
        self._tasks = [Task(id=str(t), data={"task": t}) for t in range(settings.num_tasks)]

    def tasks(self, split: str) -> list[Task]:
        return list(self._tasks)  # train and eval alike: every task

    def make(self) -> TrapEnv:
        return TrapEnv(self.settings)

    def vocabulary(self) -> list[str]:
        s = self.settings
        return (
            [OK, MISS]
            + [task_word(t) for t in range(s.num_tasks)]
            + [stage_word(k) for k in range(s.stages)]
            + [symbol(c) for c in range(s.choices)]
        )


def factory(**kwargs: Any) -> TrapFactory:
    """`env.name=trap`: `env.kwargs` are `TrapSettings` fields."""
    return TrapFactory(settings_from_kwargs("trap", TrapSettings, kwargs))
