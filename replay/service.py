"""The replay service: leases, the per-group credit ledger, immediate and correction items, batches.

`ReplayService` is the whole logic with the clock passed in: `handle(identity, message, now)` answers one message
and `tick(now)` runs the timers (lease expiry, stage-group timeouts, unacked batches, parked batch requests);
both return the replies to send as (peer identity, message). `run` wraps it in one ROUTER socket.

Delivery of credit is at most once per item: only the ack of the batch currently holding an item counts. A batch
not acked within `replay.batch_ack_timeout_s` is put back at the front of the queue and a late ack for it is
refused (`Error bad_state`), so the ledger never counts an item twice. The price: if that learner did train the
batch before vanishing, those tokens are trained again when the items are re-served; the ledger then records
what was acknowledged, not everything the optimizer saw.
"""

from __future__ import annotations

import itertools
import logging
import signal
import threading
import time
from collections import deque

import msgspec
import zmq

from async_rl.config import Config
from async_rl.ledger import GroupLedger, corrections_on, immediate_updates_on
from async_rl.protocol import (
    Ack,
    AnyMessage,
    Batch,
    BatchAck,
    BatchRequest,
    Error,
    EvalReport,
    Heartbeat,
    LeaseDenied,
    LeaseGrant,
    LeaseRequest,
    Message,
    Outcome,
    ReplayStats,
    StageRecord,
)
from async_rl.staleness import admission_allowed, correction_trainable, immediate_trainable
from async_rl.transport import BadFrame, bind_router, poll, receive, send
from replay.group import Group
from replay.queue import InFlightBatch, ItemQueue
from replay.store import QueuedItem

log = logging.getLogger("async_rl.replay")

Reply = tuple[bytes, Message]

STALENESS_RETRY_S = 0.05  # admission reopens as soon as the learner steps; ask again soon
BUDGET_RETRY_S = 1.0  # the env-step budget never reopens; the worker is told to wind down
POLL_S = 0.02
MAX_MESSAGES_PER_TICK = 1000  # timers still run under a flood of messages


class ReplayService:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.algo = config.algo
        self.policy_version = 0  # the learner's latest version (BatchRequest / BatchAck)
        self.counters = ReplayStats()  # cumulative counters; the windowed fields are filled by stats_snapshot
        self.groups: dict[str, Group] = {}
        self.leases: dict[str, set[str]] = {}  # worker id -> its groups still waiting for outcomes
        self.worker_seen: dict[str, float] = {}  # worker id -> last message (workers holding leases)
        self.last_grant: dict[str, LeaseGrant] = {}  # worker id -> its last grant, for a resent LeaseRequest
        self.queue = ItemQueue()
        self.in_flight: dict[int, InFlightBatch] = {}
        # group id -> [items queued or in flight, items trained]: a group that ends with nothing trained (no item,
        # or every item skipped as stale) is counted in groups_empty and no longer holds admission back.
        self.item_tally: dict[str, list[int]] = {}
        self.parked: dict[bytes, tuple[BatchRequest, float]] = {}  # learner identity -> (request, arrival)
        self.stage_group_deadlines: deque[tuple[float, str, int]] = deque()  # (deadline, group, k), in time order
        self.finished: deque[tuple[bool, float, int]] = deque(maxlen=config.replay.success_window)
        self.finished_long: deque[bool] = deque(maxlen=config.replay.long_success_window)
        self.successes_long = 0  # successes in finished_long, kept as a running count (the window is long)
        self.latest_eval: dict[str, float] = {}  # the newest EvalReport's metrics, for the learner's metrics line
        self.item_ids = itertools.count()
        self.batch_ids = itertools.count()

    # --- the two entry points ---------------------------------------------------------------------

    def handle(self, identity: bytes, message: AnyMessage, now: float) -> list[Reply]:
        """Answer one decoded message from peer `identity`; also answers parked batch requests it unblocks."""
        if isinstance(message, LeaseRequest | StageRecord | Outcome | Heartbeat):
            self._renew(message.worker_id, now)
        match message:
            case LeaseRequest():
                reply = self._lease(message, now)
            case StageRecord():
                reply = self._stage_record(message, now)
            case Outcome():
                reply = self._outcome(message, now)
            case Heartbeat():
                reply = None
            case EvalReport():
                reply = self._eval_report(message)
            case BatchRequest():
                reply = self._park(identity, message, now)
            case BatchAck():
                reply = self._batch_ack(message, now)
            case _:
                reply = self._unexpected(message)
        replies = [(identity, reply)] if reply is not None else []
        return replies + self._answer_parked(now)

    def tick(self, now: float) -> list[Reply]:
        """Run the timers: lease expiry, stage-group timeouts, unacked batches, parked batch requests."""
        self._expire_leases(now)
        self._time_out_stage_groups(now)
        self._requeue_unacked(now)
        return self._answer_parked(now)

    def reject_frame(self, identity: bytes | None, detail: str) -> list[Reply]:
        """A frame that did not decode: count it, log it, answer `Error` when the sender is known."""
        self.counters.bad_messages += 1
        log.warning("bad frame from %r: %s", identity, detail)
        if identity is None:
            return []
        return [(identity, Error(msg_id=-1, code="malformed", detail=detail))]

    def stats_snapshot(self) -> ReplayStats:
        successes = sum(success for success, _, _ in self.finished)
        reward_sum = sum(rewards for _, rewards, _ in self.finished)
        stages = sum(num_stages for _, _, num_stages in self.finished)
        return msgspec.structs.replace(
            self.counters,
            eval_metrics=dict(self.latest_eval),
            success_rate=successes / len(self.finished) if self.finished else 0.0,
            success_rate_long=self.successes_long / len(self.finished_long) if self.finished_long else 0.0,
            stage_reward_mean=reward_sum / stages if stages else 0.0,
            items_queued=len(self.queue),
        )

    # --- rollout workers --------------------------------------------------------------------------

    def _renew(self, worker_id: str, now: float) -> None:
        if worker_id in self.leases:
            self.worker_seen[worker_id] = now

    def _lease(self, request: LeaseRequest, now: float) -> LeaseGrant | LeaseDenied:
        """Admission, not discard (docs/algorithm.md, "Staleness")."""
        previous = self.last_grant.get(request.worker_id)
        if previous is not None and previous.msg_id == request.msg_id and previous.group_id in self.groups:
            return previous  # a resend (the grant was lost): the group is already started
        v, algo, budget = self.policy_version, self.algo, self.config.run.max_env_steps
        if budget is not None and self.counters.env_steps >= budget:
            self.counters.leases_denied += 1
            return LeaseDenied(msg_id=request.msg_id, reason="budget", retry_after_s=BUDGET_RETRY_S, policy_version=v)
        # A group that ended with nothing trained never takes learner capacity, so it does not count: with it counted,
        # a stretch of zero-variance groups (a random policy's usual output), or of immediate-only groups whose items
        # all went stale, stalled admission for good while the learner waited for items.
        admitted = self.counters.groups_started - self.counters.groups_empty
        if not admission_allowed(admitted + 1, v, algo.max_staleness, algo.groups_per_step):
            self.counters.leases_denied += 1
            return LeaseDenied(
                msg_id=request.msg_id, reason="staleness", retry_after_s=STALENESS_RETRY_S, policy_version=v
            )
        group_id = f"g{self.counters.groups_started}"
        self.counters.groups_started += 1
        group_size = self.config.rollout.group_size
        self.groups[group_id] = Group(group_id, request.worker_id, GroupLedger(group_size))
        self.leases.setdefault(request.worker_id, set()).add(group_id)
        self.worker_seen[request.worker_id] = now
        grant = LeaseGrant(msg_id=request.msg_id, group_id=group_id, group_size=group_size, policy_version=v)
        self.last_grant[request.worker_id] = grant
        return grant

    def _stage_record(self, record: StageRecord, now: float) -> Ack | Error:
        group = self.groups.get(record.group_id)
        if group is None:
            return self._error(record.msg_id, "unknown_group", f"stage record for unknown group {record.group_id!r}")
        problem = group.member_problem(record.member, record.trajectory_id)
        if problem is None and group.is_duplicate(record.member, record.stage_index):
            return Ack(msg_id=record.msg_id, duplicate=True)
        problem = problem or group.stage_problem(record)
        if problem is not None:
            return self._error(record.msg_id, "bad_state", problem)
        if group.add_stage(record, now, track_stage_group=immediate_updates_on(self.algo.updates)):
            deadline = now + self.config.replay.stage_group_timeout_s
            self.stage_group_deadlines.append((deadline, group.group_id, record.stage_index))
        self.counters.env_steps += 1
        self._advance(group, now)
        return Ack(msg_id=record.msg_id)

    def _outcome(self, message: Outcome, now: float) -> Ack | Error:
        group = self.groups.get(message.group_id)
        if group is None:
            return self._error(message.msg_id, "unknown_group", f"outcome for unknown group {message.group_id!r}")
        problem = group.member_problem(message.member, message.trajectory_id)
        if problem is not None:
            return self._error(message.msg_id, "bad_state", problem)
        i, ledger = message.member, group.ledger
        if i in ledger.outcomes or i in ledger.abandoned:
            # A resend, or the outcome of a member already abandoned (its lease expired): nothing changes.
            return Ack(msg_id=message.msg_id, duplicate=True)
        if message.abandoned:
            self._abandon(group, i, message.reason or "abandoned by its worker")
        else:
            problem = group.outcome_problem(message)
            if problem is not None:
                return self._error(message.msg_id, "bad_state", problem)
            ledger.add_outcome(i, message.outcome, message.num_stages)
            self.counters.trajectories_finished += 1
            rewards = sum(r for r in ledger.rewards[i].values() if r is not None)
            self.finished.append((message.success, rewards, message.num_stages))
            if len(self.finished_long) == self.finished_long.maxlen:
                self.successes_long -= self.finished_long[0]
            self.finished_long.append(message.success)
            self.successes_long += message.success
        if not group.unfinished_members():
            self._end_lease(group)
        self._advance(group, now)
        return Ack(msg_id=message.msg_id)

    def _abandon(self, group: Group, i: int, reason: str) -> None:
        group.ledger.abandon(i)
        self.counters.trajectories_abandoned += 1
        self.counters.env_errors += reason.startswith("env_error")
        log.info("member %d of group %s abandoned: %s", i, group.group_id, reason)

    def _end_lease(self, group: Group) -> None:
        held = self.leases.get(group.worker_id)
        if held is None:
            return
        held.discard(group.group_id)
        if not held:
            del self.leases[group.worker_id]
            self.worker_seen.pop(group.worker_id, None)

    def _expire_leases(self, now: float) -> None:
        timeout_s = self.config.replay.lease_timeout_s
        for worker_id, group_ids in list(self.leases.items()):
            if now - self.worker_seen[worker_id] < timeout_s:
                continue
            log.warning("worker %s silent for %.1f s: abandoning its unfinished trajectories", worker_id, timeout_s)
            for group_id in list(group_ids):
                group = self.groups[group_id]
                for i in group.unfinished_members():
                    self._abandon(group, i, f"lease of worker {worker_id} expired")
                self._end_lease(group)
                self._advance(group, now)

    def _eval_report(self, report: EvalReport) -> Ack:
        self.latest_eval = {**report.metrics, "eval_version": float(report.policy_version)}
        log.info("evaluation at version %d from %s: %s", report.policy_version, report.worker_id, report.metrics)
        return Ack(msg_id=report.msg_id)

    # --- a group's life (docs/algorithm.md, "Final credit and correction") ----------------------------

    def _advance(self, group: Group, now: float) -> None:
        """Move a group as far as its state allows: immediate items, finalization, closing."""
        updates = self.algo.updates
        # Once every outcome is in, the correction carries the credit of a stage group not yet handed out.
        carried_by_correction = corrections_on(updates) and group.ledger.outcomes_complete()
        if immediate_updates_on(updates) and not group.finalized and not carried_by_correction:
            for item in group.immediate_items(now, self.algo, self.config.replay, self.item_ids):
                self.queue.append(item)
                self._tally(group.group_id)[0] += 1
        if group.ready_to_finalize():
            self._end_lease(group)
            if corrections_on(updates):
                for item_id in group.queued_immediates:
                    self.queue.remove(item_id)  # never trained: issued stays 0 and the correction carries it
                self.counters.immediate_superseded += len(group.queued_immediates)
                self._tally(group.group_id)[0] -= len(group.queued_immediates)
            for item in group.finalize(self.algo, self.item_ids, with_corrections=corrections_on(updates)):
                self.queue.append(item)
                self._tally(group.group_id)[0] += 1
        if group.closable():
            self.counters.ledger_residual_max = max(self.counters.ledger_residual_max, group.residual())
            self.counters.groups_closed += 1
            self._end_lease(group)
            del self.groups[group.group_id]
            self._settle(group.group_id)

    def _tally(self, group_id: str) -> list[int]:
        return self.item_tally.setdefault(group_id, [0, 0])

    def _item_done(self, group_id: str, trained: bool) -> None:
        tally = self._tally(group_id)
        tally[0] -= 1
        tally[1] += trained
        self._settle(group_id)

    def _settle(self, group_id: str) -> None:
        """A closed group with no item left in the queue or in flight is over: empty if nothing was trained."""
        tally = self._tally(group_id)
        if group_id not in self.groups and tally[0] == 0:
            del self.item_tally[group_id]
            self.counters.groups_empty += tally[1] == 0

    def _time_out_stage_groups(self, now: float) -> None:
        deadlines = self.stage_group_deadlines
        while deadlines and deadlines[0][0] <= now:
            _, group_id, k = deadlines.popleft()
            group = self.groups.get(group_id)
            if group is not None and k in group.stage_group_started:
                self._advance(group, now)

    # --- learners -----------------------------------------------------------------------------------

    def _park(self, identity: bytes, request: BatchRequest, now: float) -> Error | None:
        if request.max_tokens < 1:
            return self._error(request.msg_id, "bad_state", f"max_tokens {request.max_tokens} < 1")
        self.policy_version = max(self.policy_version, request.policy_version)
        self.parked[identity] = (request, now)  # a newer request from the same learner replaces its older one
        return None

    def _answer_parked(self, now: float) -> list[Reply]:
        replies: list[Reply] = []
        budget = self.config.run.max_env_steps
        budget_spent = budget is not None and self.counters.env_steps >= budget
        for identity, (request, since) in list(self.parked.items()):
            waited = now - since >= request.max_wait_s
            if not self.queue:
                if budget_spent and waited:
                    # No more rollouts will come: an empty batch carries the stats that let the learner stop.
                    del self.parked[identity]
                    replies.append((identity, self._empty_batch(request, now)))
                continue
            if len(self.queue) < max(1, request.min_items) and not waited:
                continue
            batch = self._serve(request, now)
            if batch is not None:
                del self.parked[identity]
                replies.append((identity, batch))
        return replies

    def _serve(self, request: BatchRequest, now: float) -> Batch | None:
        """Take items FIFO while the padded size fits the token budget (§4 bounds checked at the learner's v)."""
        v, algo = self.policy_version, self.algo
        served: list[QueuedItem] = []
        longest = 0
        while self.queue:
            queued = self.queue.pop_front()
            group = self.groups.get(queued.group_id)
            if queued.kind == "immediate" and not immediate_trainable(v, queued.oldest_version, algo.max_staleness):
                self.counters.immediate_skipped_stale += 1  # issued stays 0: the correction carries its credit
                if group is not None:
                    group.queued_immediates.discard(queued.item_id)
                self._item_done(queued.group_id, trained=False)
                continue
            if queued.kind == "correction" and not correction_trainable(
                v, queued.oldest_version, algo.max_correction_staleness
            ):
                self._drop_correction(group, queued, now)
                continue
            if served and max(longest, queued.num_tokens) * (len(served) + 1) > request.max_tokens:
                self.queue.push_front([queued])
                break
            longest = max(longest, queued.num_tokens)
            served.append(queued)
            if queued.kind == "immediate" and group is not None:
                group.queued_immediates.discard(queued.item_id)
                group.in_flight_immediates.add(queued.item_id)
        if not served:
            return None
        batch_id = next(self.batch_ids)
        self.in_flight[batch_id] = InFlightBatch(served, now)
        stats = self.stats_snapshot()
        stats.immediate_before_outcome = sum(self._before_outcome(queued) for queued in served)
        self.counters.ledger_residual_max = 0.0  # reported once: the max since the previous batch
        return Batch(msg_id=request.msg_id, batch_id=batch_id, items=[q.item for q in served], stats=stats)

    def _empty_batch(self, request: BatchRequest, now: float) -> Batch:
        batch_id = next(self.batch_ids)
        self.in_flight[batch_id] = InFlightBatch([], now)
        return Batch(msg_id=request.msg_id, batch_id=batch_id, items=[], stats=self.stats_snapshot())

    def _before_outcome(self, queued: QueuedItem) -> bool:
        """An immediate item trained while its trajectory is still running: the point of immediate updates."""
        group = self.groups.get(queued.group_id)
        return queued.kind == "immediate" and group is not None and queued.member not in group.ledger.outcomes

    def _drop_correction(self, group: Group | None, queued: QueuedItem, now: float) -> None:
        """Past max_correction_staleness: the credit is lost, counted, and left out of the residual (§4)."""
        assert group is not None, "a group stays open while it has corrections"
        self.counters.credit_dropped += len(queued.credit)
        group.drop_correction(queued)
        self._tally(queued.group_id)[0] -= 1
        log.warning("correction of %s dropped: past max_correction_staleness", queued.item.trajectory_id)
        self._advance(group, now)

    def _batch_ack(self, ack: BatchAck, now: float) -> Ack | Error:
        batch = self.in_flight.pop(ack.batch_id, None)
        if batch is None:
            log.warning("ack for batch %d, which is not in flight (requeued after a timeout?): refused", ack.batch_id)
            return self._error(ack.msg_id, "bad_state", f"batch {ack.batch_id} is not in flight")
        self.policy_version = max(self.policy_version, ack.policy_version)
        touched: dict[str, Group] = {}
        for queued in batch.items:
            tally = self._tally(queued.group_id)
            tally[0] -= 1
            tally[1] += 1
            group = self.groups.get(queued.group_id)
            if group is not None:
                group.record_trained(queued)
                touched[group.group_id] = group
            else:  # an immediate-only group already closed; nothing left to account but its tally
                self._settle(queued.group_id)
        for group in touched.values():
            self._advance(group, now)
        return Ack(msg_id=ack.msg_id)

    def _requeue_unacked(self, now: float) -> None:
        timeout_s = self.config.replay.batch_ack_timeout_s
        expired = [batch_id for batch_id, batch in self.in_flight.items() if now - batch.sent_at >= timeout_s]
        touched: dict[str, Group] = {}
        for batch_id in reversed(expired):  # the oldest batch ends up first
            batch = self.in_flight.pop(batch_id)
            log.warning("batch %d not acked within %.1f s: back to the front of the queue", batch_id, timeout_s)
            self.queue.push_front(batch.items)
            for queued in batch.items:
                group = self.groups.get(queued.group_id)
                if group is not None and queued.kind == "immediate":
                    group.in_flight_immediates.discard(queued.item_id)
                    group.queued_immediates.add(queued.item_id)
                    touched[group.group_id] = group
        for group in touched.values():
            self._advance(group, now)

    # --- errors ---------------------------------------------------------------------------------------

    def _error(self, msg_id: int, code: str, detail: str) -> Error:
        log.warning("rejected message %d: %s: %s", msg_id, code, detail)
        return Error(msg_id=msg_id, code=code, detail=detail)

    def _unexpected(self, message: AnyMessage) -> Error | None:
        """A message type the replay service never receives: count and log it, answer `bad_state`."""
        self.counters.bad_messages += 1
        name = type(message).__name__
        if isinstance(message, Error):
            log.warning("a peer sent an Error to the replay service: %s", message)
            return None  # never answer an Error with an Error: two confused peers would ping-pong forever
        return self._error(getattr(message, "msg_id", -1), "bad_state", f"the replay service does not accept {name}")


# --- the socket loop ------------------------------------------------------------------------------------


def run(config: Config, stop: threading.Event | None = None) -> None:
    """Serve the replay ROUTER at `config.replay.endpoint` until `stop` is set (or SIGTERM / SIGINT)."""
    stop = stop if stop is not None else threading.Event()
    service = ReplayService(config)
    previous_handlers = _stop_on_signals(stop)
    context = zmq.Context()
    socket = bind_router(context, config.replay.endpoint)
    log.info("replay service listening on %s", config.replay.endpoint)
    try:
        while not stop.is_set():
            ready, received = poll(socket, POLL_S), 0
            while ready and received < MAX_MESSAGES_PER_TICK:
                for identity, reply in _receive_one(service, socket):
                    send(socket, reply, identity)
                received += 1
                ready = poll(socket, 0)
            for identity, reply in service.tick(time.monotonic()):
                send(socket, reply, identity)
    finally:
        socket.close(linger=0)
        context.term()
        for signum, handler in previous_handlers.items():
            signal.signal(signum, handler)
        log.info("replay service stopped: %s", service.stats_snapshot())


def _receive_one(service: ReplayService, socket: zmq.Socket) -> list[Reply]:
    try:
        identity, message = receive(socket)
    except BadFrame as exc:
        return service.reject_frame(exc.identity, str(exc))
    try:
        return service.handle(identity, message, time.monotonic())
    except Exception:  # a bug of ours must not take the service down for every other peer
        log.exception("internal error handling %s from %r", type(message).__name__, identity)
        service.counters.bad_messages += 1
        detail = "internal error in the replay service (see its log)"
        return [(identity, Error(msg_id=getattr(message, "msg_id", -1), code="bad_state", detail=detail))]


def _stop_on_signals(stop: threading.Event) -> dict[int, object]:
    """SIGTERM / SIGINT set `stop` (only the main thread may install handlers); returns the previous ones."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signum: signal.signal(signum, lambda *_: stop.set()) for signum in (signal.SIGTERM, signal.SIGINT)}
