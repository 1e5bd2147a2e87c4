"""The built-in multi-stage environment with traps (ALGORITHM.md §5), text in and text out.

Each task hides a secret code of `stages` symbols drawn from `choices` options. The agent names one symbol per
turn. A correct symbol earns stage reward 1 and advances. At a few *trap* stages one wrong symbol also earns
stage reward 1 and advances ("it looks right"), but the final outcome of that trajectory is then 0: only the
outcome tells a trap from the code, which is what immediate updates alone cannot learn. A miss earns 0; the
agent may retry a stage `retries` times, so trajectory lengths vary.

An episode reads, one word per token (async_rl/vocab.py):  `task7 stage1` → `C` → `ok stage2` → `A` → `miss stage2` …
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from async_rl.config import EnvConfig
from async_rl.vocab import MISS, OK, stage_word, symbol, task_word


@dataclass(frozen=True)
class TrapTask:
    code: tuple[int, ...]  # the right choice at each stage
    traps: dict[int, int]  # trap stage -> the trap choice there (never the code's choice)


def make_task(env: EnvConfig, task_id: int) -> TrapTask:
    """Task `task_id` of the environment seeded `env.seed`; independent of `num_tasks`, so tasks stay put."""
    if not 0 <= task_id < env.num_tasks:
        raise ValueError(f"task_id: expected 0 <= task_id < env.num_tasks ({env.num_tasks}), got {task_id}")
    rng = random.Random(f"trap-env/{env.seed}/{task_id}")
    code = tuple(rng.randrange(env.choices) for _ in range(env.stages))
    trap_stages = sorted(rng.sample(range(env.stages), env.traps))
    traps = {s: rng.choice([c for c in range(env.choices) if c != code[s]]) for s in trap_stages}
    return TrapTask(code=code, traps=traps)


class TrapEnv:
    """One trajectory at a time: `reset(task_id)`, then `step(action)` until done, then `outcome()`."""

    def __init__(self, env: EnvConfig) -> None:
        self.config = env
        self._symbols = {symbol(c): c for c in range(env.choices)}
        self.task: TrapTask | None = None
        self.stage = 0  # from 0
        self.retries_left = 0
        self.trapped = False
        self.failed = False
        self.done = False

    def reset(self, task_id: int) -> str:
        self.task = make_task(self.config, task_id)
        self.stage = 0
        self.retries_left = self.config.retries
        self.trapped = False
        self.failed = False
        self.done = False
        return f"{task_word(task_id)} {stage_word(0)}"

    def step(self, action_text: str) -> tuple[str, float, bool]:
        """Apply one action; returns (observation, stage reward, done). Sleeps `step_latency_s` (a tool call)."""
        if self.task is None:
            raise RuntimeError("TrapEnv.step called before reset(task_id)")
        if self.done:
            raise RuntimeError("TrapEnv.step called after the episode ended; call reset(task_id) first")
        time.sleep(self.config.step_latency_s)
        choice = self._symbols.get(action_text.strip())  # anything but exactly one known symbol is a miss
        if choice is not None and choice == self.task.code[self.stage]:
            return self._advance()
        if choice is not None and self.task.traps.get(self.stage) == choice:
            self.trapped = True  # the stage reward says "right"; the outcome will say otherwise
            return self._advance()
        if self.retries_left > 0:
            self.retries_left -= 1
            return f"{MISS} {stage_word(self.stage)}", 0.0, False
        self.failed = True
        self.done = True
        return "", 0.0, True

    def outcome(self) -> float:
        """The final reward, known only after a slow judge (`outcome_delay_s`): 1 for the exact code, else 0."""
        if not self.done:
            raise RuntimeError("TrapEnv.outcome called before the episode ended")
        time.sleep(self.config.outcome_delay_s)
        return 1.0 if not (self.trapped or self.failed) else 0.0

    def _advance(self) -> tuple[str, float, bool]:
        self.stage += 1
        self.retries_left = self.config.retries
        if self.stage == self.config.stages:
            self.done = True
            return "", 1.0, True
        return f"{OK} {stage_word(self.stage)}", 1.0, False
