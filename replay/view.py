"""The replay's state as tests, the metrics line and the benchmarks read it: `ReplayView`, the read-only side of
`ReplayService` (replay/service.py), named properties over its `ReplayState` (replay/state.py)."""

from __future__ import annotations

from async_rl.protocol import BatchRequest, ReplayStats
from replay.group import Group
from replay.queue import InFlightBatch, ItemQueue
from replay.state import ReplayState


class ReplayView:
    state: ReplayState

    @property
    def counters(self) -> ReplayStats:
        return self.state.counters

    @property
    def groups(self) -> dict[str, Group]:
        return self.state.groups

    @property
    def queue(self) -> ItemQueue:
        return self.state.serving.queue

    @property
    def in_flight(self) -> dict[int, InFlightBatch]:
        return self.state.serving.in_flight

    @property
    def parked(self) -> dict[bytes, tuple[BatchRequest, float]]:
        return self.state.serving.parked

    @property
    def policy_version(self) -> int:
        return self.state.learner.policy_version

    @property
    def version_ceiling(self) -> int | None:
        return self.state.learner.version_ceiling

    @property
    def epoch(self) -> int:
        return self.state.epoch

    @property
    def checkpointed(self) -> int:
        return self.state.rollback.checkpointed

    @property
    def learner_session(self) -> int:
        return self.state.rollback.session

    @property
    def longest_trajectory(self) -> int:
        return self.state.guard.longest_trajectory

    @property
    def batch_tokens(self) -> int:
        return self.state.guard.batch_tokens

    def stats_snapshot(self, now: float | None = None) -> ReplayStats:
        """The stats (`ReplayState.stats`); `now`: with the guard's running hold counted."""
        return self.state.stats(now)
