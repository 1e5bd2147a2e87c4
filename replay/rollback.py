"""Resume after a learner crash (docs/architecture.md, "Resume after a crash"): the journal of trained acks above
the learner's latest reported checkpoint, which groups may close, and the rollback to a checkpoint at or above it.

With learner checkpoints on, trained acks above the learner's latest reported checkpoint (the oldest one it keeps:
learner/checkpoint.py `rollback_point`) stay undoable (the journal), and a group whose items were acked above it
stays open, so a learner that comes back at any checkpoint it keeps (the newest, or an older one past a damaged
newest) can be rolled back to it exactly.
"""

from __future__ import annotations

import logging

from replay.group import Group
from replay.state import ReplayState, RollbackState
from replay.store import QueuedItem

log = logging.getLogger("async_rl.replay")


class Rollback:
    def __init__(self, checkpoint_every: int, state: ReplayState) -> None:
        self.state = state
        self.own: RollbackState = state.rollback
        self.checkpoints_on = checkpoint_every > 0  # learner.checkpoint_every

    def retaining(self) -> bool:
        """Keep what a rollback needs: learner checkpoints are on, and the learner tells its session (a client that
        does not, e.g. a test driving the service by hand, gets the plain service: groups close at once)."""
        return self.checkpoints_on and self.own.session != 0

    def journal_ack(self, version: int, items: list[QueuedItem]) -> None:
        if not self.retaining() or not items:
            return
        self.own.journal.append((version, items))
        unconfirmed = self.own.unconfirmed
        for queued in items:
            unconfirmed[queued.group_id] = max(version, unconfirmed.get(queued.group_id, version))

    def confirmed(self, group: Group) -> bool:
        """May `group` close? Not while a rollback could still take back one of its acks, nor (immediate-only)
        while its immediate items wait: a rollback would requeue them into a group that is gone."""
        if not self.retaining():
            return True
        if group.queued_immediates or group.in_flight_immediates:
            return False
        return self.own.unconfirmed.get(group.group_id, -1) <= self.own.checkpointed

    def confirm_checkpoint(self, version: int) -> list[Group]:
        """The learner's checkpoint at `version` is durable: acks at or below it are final. Returns the groups that
        may close now."""
        own = self.own
        if version <= own.checkpointed or version > self.state.learner.policy_version:
            return []
        own.checkpointed = version
        released: set[str] = set()
        while own.journal and own.journal[0][0] <= version:
            released.update(queued.group_id for queued in own.journal.pop(0)[1])
        freed = []
        for group_id in released:
            if own.unconfirmed.get(group_id, -1) <= version:
                own.unconfirmed.pop(group_id, None)
                group = self.state.groups.get(group_id)
                if group is not None:
                    freed.append(group)
        return freed

    def problem(self, version: int) -> str | None:
        """Why a learner restarted at `version` (below the replay's) cannot be rolled back to, or None. A target
        at or above the learner's reported checkpoint (its rollback point: the oldest checkpoint it keeps, so that a
        resume past a damaged newer one lands here too) is exact, every ack above it being in the journal; below it
        the acks are final. A forged restart can at most undo the acks above the reported checkpoint (they are
        trained again), never a group that closed."""
        if not self.retaining():
            return (f"the learner restarted at version {version} below {self.state.learner.policy_version}, and "
                    "with learner.checkpoint_every 0 the replay keeps nothing to roll back: restart the replay as well")
        if version < self.own.checkpointed:
            return (f"the learner restarted at version {version}, but its latest reported checkpoint is "
                    f"{self.own.checkpointed}: the acks up to it are final, the replay can only roll back to a "
                    "version at or above it")
        return None

    def roll_back(self, version: int) -> list[Group]:
        """Undo every trained ack above `version`: its credit leaves the ledger and its items go back to the front of
        the queue, to be trained once more by the resumed learner. A finalized group that loses an immediate's credit
        is finalized again (its corrections are withdrawn and C = A_final − issued recomputed). Returns the groups
        it touched."""
        own, state = self.own, self.state
        undone: list[QueuedItem] = []
        while own.journal and own.journal[-1][0] > version:
            undone[:0] = own.journal.pop()[1]
        refinalize, touched, kept = self._undo(undone)
        state.serving.queue.push_front(kept)
        for group in refinalize.values():
            self._unfinalize(group)
        own.unconfirmed.clear()
        for ack_version, items in own.journal:
            for queued in items:
                own.unconfirmed[queued.group_id] = max(ack_version, own.unconfirmed.get(queued.group_id, ack_version))
        learner = state.learner
        state.counters.rollbacks += 1
        state.counters.items_rolled_back += len(undone)
        log.warning("learner resumed at version %d below %d: rolled back %d trained item(s) (%d group(s) finalized "
                    "again)", version, learner.policy_version, len(undone), len(refinalize))
        # The groups admitted for the versions taken back are in the system already, and the resumed learner may
        # retrain their items in fewer steps; counted from its version alone, admission would wait for steps that
        # no item is left to make (a stall, tests/test_faults.py).
        state.leases.admission_offset += learner.policy_version - version
        learner.policy_version = version
        return list(touched.values())

    def _undo(self, undone: list[QueuedItem]) -> tuple[dict[str, Group], dict[str, Group], list[QueuedItem]]:
        """Take the credit of `undone` out of its groups' ledgers: (groups to finalize again, groups touched, the
        items to requeue)."""
        state = self.state
        refinalize: dict[str, Group] = {}
        touched: dict[str, Group] = {}
        kept: list[QueuedItem] = []
        for queued in undone:
            group = state.groups.get(queued.group_id)  # kept open by `confirmed`
            if group is None:  # cannot happen (a bug if it does): the item is not requeued, its group is gone
                log.error("rollback: group %s of item %d is closed; not requeued", queued.group_id, queued.item_id)
                continue
            kept.append(queued)
            immediate = queued.kind == "immediate"
            for k, advantage in queued.credit.items():
                group.ledger.undo_trained(queued.member, k, advantage, immediate=immediate)
            tally = state.tally(queued.group_id)
            tally[0] += 1
            tally[1] -= 1
            if immediate:
                group.queued_immediates.add(queued.item_id)
                if group.finalized:
                    refinalize[group.group_id] = group
            else:
                group.open_corrections.add(queued.item_id)
            touched[group.group_id] = group
        return refinalize, touched, kept

    def _unfinalize(self, group: Group) -> None:
        for item_id in group.open_corrections:
            self.state.serving.queue.remove(item_id)  # every correction came after the immediate's ack: none final
        self.state.tally(group.group_id)[0] -= len(group.open_corrections)
        group.open_corrections.clear()
        group.dropped_stages.clear()
        group.finalized = False
        group.ledger.unfinalize()
