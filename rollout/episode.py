"""A trajectory in flight (`Episode`) and where an episode runner's results go (`Sink`): the runner's contract.

rollout/runner.py moves each Episode through its phases

    reset  →  act  →  generate  →  step  →  act  → … → judge → done        (or abandoned, from any phase)

and hands every stage and every outcome to its Sink: the replay service's records for training
(rollout/worker.py), a tally for evaluation (rollout/evaluate.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from rollout.engines import Generation
from rollout.envs.base import Env, Judgement, Task

Phase = Literal["reset", "act", "generate", "step", "judge", "done"]


@dataclass(eq=False)
class Episode:
    group_id: str
    member: int
    task: Task
    env: Env | None
    phase: Phase = "reset"
    context: list[int] = field(default_factory=list)  # every token so far: what the policy conditions on
    observation_tokens: list[int] = field(default_factory=list)  # the observation the next action answers
    stages: int = 0  # stages handed to the sink
    generation: Generation | None = None  # the action whose step is under way
    since: float = 0.0  # when the current reset, step or judge began (its latency, for the metrics)
    tools: list[dict] | None = None  # the env's tool specs, asked after reset (None: an env without tools())
    max_new_tokens: int | None = None  # a token-level env's budget for the next action (None: the runner's)

    @property
    def trajectory_id(self) -> str:
        return f"{self.group_id}/{self.member}"


class Sink(Protocol):
    """Where a runner's results go: the replay service (training) or a tally (evaluation)."""

    def stage(self, episode: Episode, generation: Generation, reward: float, terminal: bool) -> None: ...

    def outcome(self, episode: Episode, judgement: Judgement | None, reason: str) -> None: ...
