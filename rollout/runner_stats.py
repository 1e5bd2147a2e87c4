"""The rollout role's metrics line: what an episode runner did since it was last asked (rates, latencies, tools).

rollout/runner.py counts into a `RunnerStats` as its trajectories move; `EpisodeRunner.take_stats()` turns it into
the line the worker writes (rollout/worker.py) and starts a fresh one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class RunnerStats:
    """What a runner did since the last `EpisodeRunner.take_stats()`: the rollout role's metrics line."""

    started: float = field(default_factory=time.monotonic)
    trajectories_finished: int = 0  # judged
    trajectories_abandoned: int = 0
    turns: int = 0  # stages of the judged trajectories
    actions: int = 0
    action_tokens: int = 0
    engine_s: float = 0.0  # wall time inside engine calls
    step_s: list[float] = field(default_factory=list)  # environment step latencies (tool time)
    reset_s: list[float] = field(default_factory=list)
    judge_s: list[float] = field(default_factory=list)
    tool_calls: int = 0  # calls that parsed, in the actions of envs with tools (rollout.tool_parser)
    tool_call_errors: int = 0  # calls that did not (each reached its env as Action.parse_error)

    def line(self, now: float) -> dict[str, float]:
        span = max(now - self.started, 1e-9)
        judged = max(self.trajectories_finished, 1)
        return {
            "trajectories_per_s": self.trajectories_finished / span,
            "tokens_per_s": self.action_tokens / span,
            "trajectories_finished": self.trajectories_finished,
            "trajectories_abandoned": self.trajectories_abandoned,
            "turns_mean": self.turns / judged,
            "response_tokens_mean": self.action_tokens / max(self.actions, 1),
            "engine_utilisation": min(self.engine_s / span, 1.0),
            **_latency("step_latency_s", self.step_s),
            **_latency("reset_latency_s", self.reset_s),
            **_latency("judge_latency_s", self.judge_s),
            "tool_calls": self.tool_calls,
            "tool_call_errors": self.tool_call_errors,
        }


def _latency(name: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {f"{name}_mean": 0.0, f"{name}_p90": 0.0}
    ordered = sorted(values)
    return {f"{name}_mean": sum(ordered) / len(ordered), f"{name}_p90": ordered[int(0.9 * (len(ordered) - 1))]}
