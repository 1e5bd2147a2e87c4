"""Serving batches to learners: parked batch requests, the batch a request gets, acks, untrained steps and the
requeue of unacked batches, and a learner's new session (docs/algorithm.md, "Batches").

Delivery of credit is at most once per item: only the ack of the batch currently holding an item counts. A batch
not acked within `replay.batch_ack_timeout_s` is put back at the front of the queue. A late ack for it (a learner
frozen or cut off past the timeout, then back) takes the items still waiting in the queue as trained, so a learner
that did train the batch does not get them again (`late_batch_acks`); items already served again are not its any
more, and an ack with none left is refused (`Error bad_state`), so the ledger never counts an item twice. Such an
immediate is never superseded by its group's correction while that late ack may still come: a group whose outcomes
are all in holds it out of the queue (`held`) and finalizes only once the ack made its credit issued, or said it
was not trained, or can no longer come (a new learner process, REQUEUED_KEPT newer requeued batches); then C =
A_final − issued carries exactly the rest, where a correction made earlier would have carried that credit a second
time. The price: if the learner vanished for good after training the batch, or came back after its items were
served again, those tokens are trained again; the ledger then records what was acknowledged, not everything the
optimizer saw.

A step that changes what a group's transitions depend on yields `Advance(group)` there, for the service to carry out
before the step goes on (replay/decisions.py); a refusal is returned as a problem, (reason, detail), that the service
counts and answers with `Error bad_state`.
"""

from __future__ import annotations

import logging

from async_rl.ledger import corrections_on
from async_rl.protocol import Ack, Batch, BatchAck, BatchRequest, Message
from async_rl.staleness import correction_trainable, immediate_trainable
from replay.decisions import Advance, Steps
from replay.edge import Edge, Problem
from replay.group import Group
from replay.guard import Guard
from replay.queue import InFlightBatch, batch_cost
from replay.rollback import Rollback
from replay.rounds import Rounds
from replay.settings import ServingSettings
from replay.state import ReplayState, ServeState
from replay.store import QueuedItem

log = logging.getLogger("async_rl.replay")

Reply = tuple[bytes, Message]

REQUEUED_KEPT = 16  # requeued batches whose late ack is still taken (a learner holds one batch at a time)


class Serving:
    def __init__(self, settings: ServingSettings, state: ReplayState, edge: Edge, guard: Guard, rounds: Rounds,
                 rollback: Rollback) -> None:
        self.settings, self.state = settings, state
        self.own: ServeState = state.serving
        self.edge, self.guard, self.rounds, self.rollback = edge, guard, rounds, rollback

    # --- requests ---

    def park(self, identity: bytes, request: BatchRequest, now: float) -> Steps[Problem | None]:
        refused = yield from self._learner_session(request, now)
        if refused is None:
            refused = self.edge.take_version(request.policy_version)
        if refused is not None:
            return refused
        # A newer request from the same learner replaces its older one (among them a request re-sent after
        # learner.request_timeout_s: the learner takes a Batch that answers any request it sent).
        self.own.parked[identity] = (request, now)
        return None

    def answer_parked(self, now: float) -> Steps[list[Reply]]:
        replies: list[Reply] = []
        for identity, (request, since) in list(self.own.parked.items()):
            batch = yield from self._answer(request, now - since >= request.max_wait_s, now)
            if batch is not None:
                del self.own.parked[identity]
                replies.append((identity, batch))
        return replies

    def _answer(self, request: BatchRequest, waited: bool, now: float) -> Steps[Batch | None]:
        """The batch that answers a parked request now, or None (it stays parked)."""
        queue, budget = self.own.queue, self.settings.max_env_steps
        if not queue:
            if budget is not None and self.state.counters.env_steps >= budget and waited:
                return self._empty_batch(request, now)  # no more rollouts will come: the learner may stop
            return None
        if self.settings.mode == "sync":
            if not self.rounds.generated():
                return None  # lock-step: nothing is trained before the whole round is in; then all of it at once
        elif len(queue) < max(1, request.min_items) and not waited:
            return None
        decision = self.guard.decide(request)
        if decision == "hold":
            self.guard.hold(now)
            return None
        batch = yield from self._serve(request, now, corrections_only=decision == "corrections")
        if batch is not None:
            self.guard.release(now)
        return batch

    def _serve(self, request: BatchRequest, now: float, corrections_only: bool = False) -> Steps[Batch | None]:
        """Take items FIFO while the batch fits the token budget, counted as learner.batch_budget says (§4 bounds
        checked at the learner's v); with `corrections_only` (the guard), stop at the first item that is not a
        correction."""
        self.own.serves += 1
        queue, packed = self.own.queue, self.settings.batch_budget == "packed"
        served: list[QueuedItem] = []
        stale_groups: dict[str, Group] = {}  # a group held open for its immediates may close now (`confirmed`)
        longest = total = 0
        while queue:
            queued = queue.pop_front()
            group = self.state.groups.get(queued.group_id)
            trainable = yield from self._trainable(queued, group, stale_groups)
            if not trainable:
                continue
            n = queued.num_tokens
            over = served and batch_cost(packed, longest, total, len(served), n) > request.max_tokens
            if over or (corrections_only and queued.kind != "correction"):
                queue.push_front([queued])
                break
            longest, total = max(longest, n), total + n
            served.append(queued)
            if queued.kind == "immediate" and group is not None:
                group.queued_immediates.discard(queued.item_id)
                group.in_flight_immediates.add(queued.item_id)
        for group in stale_groups.values():
            if group.group_id in self.state.groups:
                yield Advance(group)
        if not served:
            return None
        batch_id = next(self.state.batch_ids)
        self.own.in_flight[batch_id] = InFlightBatch(served, now)
        self.edge.served(request.policy_version)
        stats = self.state.stats(now)  # the guard's hold this batch ends (released after it) counts
        stats.immediate_before_outcome = sum(self._before_outcome(queued) for queued in served)
        self.state.counters.ledger_residual_max = 0.0  # reported once: the max since the previous batch
        return Batch(msg_id=request.msg_id, batch_id=batch_id, items=[q.item for q in served], stats=stats)

    def _trainable(self, queued: QueuedItem, group: Group | None, stale_groups: dict[str, Group]) -> Steps[bool]:
        """Whether an item taken from the queue may be trained at the learner's version; a stale one is accounted
        here (an immediate's credit goes to its correction, a correction's is dropped)."""
        v, max_staleness = self.state.learner.policy_version, self.settings.max_staleness
        if queued.kind == "immediate" and not immediate_trainable(v, queued.oldest_version, max_staleness):
            self.state.counters.immediate_skipped_stale += 1  # issued stays 0: the correction carries its credit
            if group is not None:
                group.queued_immediates.discard(queued.item_id)
                if self.rollback.retaining():
                    stale_groups[group.group_id] = group
            self.state.item_done(queued.group_id, trained=False)
            return False
        if queued.kind == "correction" and not correction_trainable(
            v, queued.oldest_version, self.guard.bound()
        ):
            yield from self._drop_correction(group, queued)
            return False
        return True

    def _empty_batch(self, request: BatchRequest, now: float) -> Batch:
        self.own.serves += 1
        batch_id = next(self.state.batch_ids)
        self.own.in_flight[batch_id] = InFlightBatch([], now)
        return Batch(msg_id=request.msg_id, batch_id=batch_id, items=[], stats=self.state.stats())

    def _before_outcome(self, queued: QueuedItem) -> bool:
        """An immediate item trained while its trajectory is still running: the point of immediate updates."""
        group = self.state.groups.get(queued.group_id)
        return queued.kind == "immediate" and group is not None and queued.member not in group.ledger.outcomes

    def _drop_correction(self, group: Group | None, queued: QueuedItem) -> Steps[None]:
        """Past the correction bound (Guard.bound): the credit is lost, counted, and left out of the residual (§4)."""
        assert group is not None, "a group stays open while it has corrections"
        self.state.counters.credit_dropped += len(queued.credit)
        group.drop_correction(queued)
        self.state.tally(queued.group_id)[0] -= 1
        log.warning("correction of %s dropped: past the correction bound %d", queued.item.trajectory_id,
                    self.guard.bound())
        yield Advance(group)

    # --- acks ---

    def batch_ack(self, ack: BatchAck) -> Steps[Ack | Problem]:
        if ack.batch_id not in self.own.in_flight:
            late = yield from self._late_ack(ack)
            if late is not None:
                return late
            return ("batch_not_in_flight",
                    f"batch {ack.batch_id} is not in flight (requeued after a timeout?): its ack is refused")
        problem = self.edge.take_version(ack.policy_version, acked=True)
        if problem is not None:
            return problem
        batch = self.own.in_flight.pop(ack.batch_id)
        if not ack.trained:
            yield from self._untrained(batch)
            return Ack(msg_id=ack.msg_id)
        yield from self._trained(batch.items, ack.policy_version)
        return Ack(msg_id=ack.msg_id)

    def _late_ack(self, ack: BatchAck) -> Steps[Ack | Problem | None]:
        """The ack of a batch requeued after replay.batch_ack_timeout_s: its items still in the queue (served to no
        one since) or held for it (`hold_late_claims`) leave it as trained, since the learner trained them. None:
        nothing of it is left (the ack is refused as for any batch not in flight)."""
        item_ids = self.own.requeued.pop(ack.batch_id, None) or []
        queue, held = self.own.queue, self.own.held
        items = [queued for queued in map(queue.get, item_ids) if queued is not None]
        claimed = [held[item_id] for item_id in item_ids if item_id in held]
        if not items and not claimed:
            return None
        problem = self.edge.take_version(ack.policy_version, acked=True)
        if problem is not None:
            yield from self._release_held(item_ids)  # refused: this ack will not come again
            return problem
        if not ack.trained:  # nothing was trained: the items wait in the queue as they are, the held ones again
            yield from self._release_held(item_ids)
            return Ack(msg_id=ack.msg_id)
        log.warning("late ack of batch %d (requeued after %.1f s): %d of its %d items were still queued or held for "
                    "it and count as trained", ack.batch_id, self.settings.batch_ack_timeout_s,
                    len(items) + len(claimed), len(item_ids))
        self.state.counters.late_batch_acks += 1
        for queued in items:
            queue.remove(queued.item_id)
        for queued in claimed:
            del held[queued.item_id]
        yield from self._trained(items + claimed, ack.policy_version)
        return Ack(msg_id=ack.msg_id)

    def hold_late_claims(self, group: Group) -> None:
        """Before `group` finalizes (its outcomes all in, corrections on): its queued immediates that a requeued
        batch's late ack may still claim leave the queue and count as in flight, so A_final − issued is not fixed
        while that ack could still make their credit issued (the correction would carry it a second time)."""
        own = self.own
        if (not own.requeued or group.finalized or not group.queued_immediates
                or not corrections_on(self.settings.updates) or not group.ledger.outcomes_complete()):
            return
        claimable = {item_id for item_ids in own.requeued.values() for item_id in item_ids}
        for item_id in sorted(group.queued_immediates & claimable):
            queued = own.queue.get(item_id)
            if queued is None:
                continue
            own.queue.remove(item_id)
            own.held[item_id] = queued
            group.queued_immediates.discard(item_id)
            group.in_flight_immediates.add(item_id)

    def _release_held(self, item_ids: list[int]) -> Steps[None]:
        """The late ack that could claim these items will not come (or said untrained): the held ones go back to
        the front of the queue, and their groups finalize over them (superseded: the correction carries them)."""
        touched: dict[str, Group] = {}
        for item_id in item_ids:
            queued = self.own.held.pop(item_id, None)
            if queued is None:
                continue
            self.own.queue.push_front([queued])
            group = self.state.groups.get(queued.group_id)
            if group is not None:
                group.in_flight_immediates.discard(item_id)
                group.queued_immediates.add(item_id)
                touched[group.group_id] = group
        for group in touched.values():
            if group.group_id in self.state.groups:
                yield Advance(group)

    def _trained(self, items: list[QueuedItem], version: int) -> Steps[None]:
        """Acked items: their credit is trained (and journaled, for a rollback to `version`'s checkpoint)."""
        self.rollback.journal_ack(version, items)
        touched: dict[str, Group] = {}
        for queued in items:
            tally = self.state.tally(queued.group_id)
            tally[0] -= 1
            tally[1] += 1
            group = self.state.groups.get(queued.group_id)
            if group is not None:
                group.queued_immediates.discard(queued.item_id)  # a late ack's immediate waited in the queue again
                group.record_trained(queued)
                touched[group.group_id] = group
            else:  # an immediate-only group already closed; nothing left to account but its tally
                self.state.settle(queued.group_id)
        for group in touched.values():
            yield Advance(group)

    def _untrained(self, batch: InFlightBatch) -> Steps[None]:
        """The learner refused the step (BatchAck.trained=False): no credit was trained. An immediate's credit goes
        to its correction (as for a stale one); a correction's credit is dropped and counted (docs/algorithm.md)."""
        if batch.items:
            log.warning("the learner did not train a batch of %d items: none of its credit counts", len(batch.items))
        touched: dict[str, Group] = {}
        for queued in batch.items:
            group = self.state.groups.get(queued.group_id)
            if queued.kind == "correction":
                yield from self._drop_correction(group, queued)
                continue
            if group is not None:
                group.in_flight_immediates.discard(queued.item_id)
                touched[group.group_id] = group
            self.state.item_done(queued.group_id, trained=False)
        for group in touched.values():
            if group.group_id in self.state.groups:
                yield Advance(group)

    def requeue_unacked(self, now: float, everything: bool = False) -> Steps[bool]:
        """Batches not acked within replay.batch_ack_timeout_s (`everything`: all of them, their learner restarted
        or the replay did) go back to the front of the queue. True if any did."""
        timeout_s, in_flight = self.settings.batch_ack_timeout_s, self.own.in_flight
        expired = [batch_id for batch_id, batch in in_flight.items() if everything or now - batch.sent_at >= timeout_s]
        touched: dict[str, Group] = {}
        no_late_ack: list[int] = []  # item ids of requeued batches whose late ack is no longer taken
        for batch_id in reversed(expired):  # the oldest batch ends up first
            batch = in_flight.pop(batch_id)
            if everything:
                log.warning("batch %d was in flight to a learner (or a replay) that restarted: back to the front of "
                            "the queue", batch_id)
            else:
                log.warning("batch %d not acked within %.1f s: back to the front of the queue", batch_id, timeout_s)
            self.own.queue.push_front(batch.items)
            if not everything and batch.items:  # its learner may be frozen, not dead: its late ack is still taken
                requeued = self.own.requeued
                requeued[batch_id] = [queued.item_id for queued in batch.items]
                for old in list(requeued)[:-REQUEUED_KEPT]:
                    no_late_ack += requeued.pop(old)
            for queued in batch.items:
                group = self.state.groups.get(queued.group_id)
                if group is not None and queued.kind == "immediate":
                    group.in_flight_immediates.discard(queued.item_id)
                    group.queued_immediates.add(queued.item_id)
                    touched[group.group_id] = group
        for group in touched.values():
            yield Advance(group)
        yield from self._release_held(no_late_ack)
        return bool(expired)

    # --- a learner's session (replay/rollback.py) ---

    def _learner_session(self, request: BatchRequest, now: float) -> Steps[Problem | None]:
        """Take the learner's checkpoint report; on the first request of a new learner process, requeue what was in
        flight to the old one and, if it came back below the acked version, roll back to its checkpoint."""
        own, learner = self.rollback.own, self.state.learner
        if request.session == 0 or request.session == own.session:
            yield from self._confirm_checkpoint(request.checkpoint)
            return None
        if request.session < own.session:  # sessions are start times: a newer learner already spoke
            return "old_session", f"learner session {request.session} is older than {own.session}"
        r = request.policy_version
        if r < learner.policy_version:
            problem = self.rollback.problem(r)
            if problem is not None:
                return "bad_resume", problem
        log.info("learner session %d starts at version %d (the replay had %d, checkpoint %d)",
                 request.session, r, learner.policy_version, own.checkpointed)
        own.session = request.session
        # a new learner process: the old one's late acks are not its lineage's
        no_late_ack = [item_id for item_ids in self.own.requeued.values() for item_id in item_ids]
        self.own.requeued.clear()
        yield from self._release_held(no_late_ack)
        yield from self.requeue_unacked(now, everything=True)
        if r < learner.policy_version:
            for group in self.rollback.roll_back(r):
                if group.group_id in self.state.groups:
                    yield Advance(group)
        yield from self._confirm_checkpoint(request.checkpoint)
        return None

    def _confirm_checkpoint(self, version: int) -> Steps[None]:
        for group in self.rollback.confirm_checkpoint(version):
            yield Advance(group)
