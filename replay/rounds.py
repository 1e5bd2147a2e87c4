"""Lock-step rounds (algo.mode=sync): which groups a round admits, and when its batch may be served."""

from __future__ import annotations

from replay.settings import RoundSettings
from replay.state import ReplayState, RoundState


class Rounds:
    def __init__(self, settings: RoundSettings, state: ReplayState) -> None:
        self.settings, self.state = settings, state
        self.own: RoundState = state.rounds

    def add(self, group_id: str) -> None:
        self.own.groups.add(group_id)

    def generated(self) -> bool:
        """Every group of the current round has all its outcomes in (finalized or closed), and the round is full
        (or the env-step budget stopped it)."""
        budget, groups, round_groups = self.settings.max_env_steps, self.state.groups, self.own.groups
        full = len(round_groups) >= self.settings.groups_per_step or (
            budget is not None and self.state.counters.env_steps >= budget
        )
        return full and bool(round_groups) and all(gid not in groups or groups[gid].finalized for gid in round_groups)

    def open(self) -> bool:
        """May a group start in the current round? A round that is over (every item of it trained: its groups
        closed and their items acknowledged) is replaced by the next one first."""
        if len(self.own.groups) < self.settings.groups_per_step:
            return True
        if all(self._group_over(gid) for gid in self.own.groups):
            self.own.groups = set()
            self.state.counters.sync_rounds += 1
            return True
        return False

    def _group_over(self, group_id: str) -> bool:
        """No item of the group is left to train: closed, or finalized with nothing queued or in flight. A group
        held open only because its acks are above the learner's last checkpoint (replay/rollback.py: a rollback
        could still take them back) is over for the round; waiting for its close would wait for the next
        checkpoint."""
        tally = self.state.item_tally.get(group_id)
        if tally is not None and tally[0] > 0:
            return False
        group = self.state.groups.get(group_id)
        if group is None:
            return True
        return group.finalized and not (group.queued_immediates or group.in_flight_immediates
                                        or group.open_corrections)
