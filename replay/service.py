"""The replay core: `ReplayService` answers each message and runs the timers, dispatching to the components that
own each part of its state (replay/state.py).

`handle(identity, message, now)` answers one message and `tick(now)` runs the timers (lease expiry, stage-group
timeouts, unacked batches, the correction guard's abandon clock, parked batch requests); both return the replies to
send as (peer identity, message). The clock is passed in, so the core is replayed exactly from its inputs
(replay/wal.py); replay/server.py wraps it in one ROUTER socket and the write-ahead log.

The service keeps stage records, outcomes and abandonments (they change a group), and is the only caller of
`Group.advance`: its dispatch (`advance`) applies what a group's transition produced to the queue, the tallies,
the leases and the counters. The components: replay/leases.py (admission, leases, worker sessions),
replay/serving.py (batches, acks, requeues), replay/guard.py (the correction guard), replay/rounds.py (lock-step
rounds), replay/rollback.py (a learner's crash), replay/edge.py (validation against the state). None of them calls
back into the service: their steps return what they decided (replay/decisions.py), and `carry_out` acts on it.

Validation at the edge (docs/architecture.md): every message is checked before anything is stored, first by
`protocol.value_problem` (finite rewards and outcomes, log-probs <= 0, members and versions >= 0, sane batch
requests), then against the service's state (replay/edge.py). A refusal is an `Error` naming the reason, counted by
reason in `ReplayStats.rejected` and logged at most once per reason every `REJECT_LOG_EVERY_S`. A stage record or
outcome refused for its values abandons its trajectory (when the group and member are real and the sender holds
the group's lease), so its group still closes over the other members. Before any of that, with CURVE, the sender's
key must be of the message's role and own the connection's identity and the worker id (replay/edge.py); a record
or outcome for a group must come from the worker that leased it (`not_leaseholder`).
"""

from __future__ import annotations

import logging
import math
from typing import TypeVar

from async_rl.ledger import immediate_updates_on
from async_rl.protocol import (
    Ack,
    AnyMessage,
    BatchAck,
    BatchRequest,
    Error,
    ErrorCode,
    EvalReport,
    Heartbeat,
    LeaseRequest,
    Message,
    Outcome,
    StageRecord,
    value_problem,
)
from async_rl.ratelimit import RateLimitedLog
from replay.decisions import Advance, GiveUp, Steps
from replay.edge import Edge, Problem, key_problem
from replay.group import Group
from replay.guard import Guard
from replay.hold import PACE_STEPS, Hold
from replay.leases import AdmissionClock, Leases
from replay.rollback import Rollback
from replay.rounds import Rounds
from replay.serving import Serving
from replay.settings import ReplaySettings
from replay.state import Ids, OutcomeState, ReplayState
from replay.view import ReplayView

log = logging.getLogger("async_rl.replay")

Reply = tuple[bytes, Message]
T = TypeVar("T")

REJECT_LOG_EVERY_S = 10.0  # at most one warning per rejection reason this often (a flood must not fill the log)


class ReplayService(ReplayView):
    def __init__(self, settings: ReplaySettings) -> None:
        """`settings`: built from the run's config at the role's entry (replay/server.py `build_service`)."""
        self.settings = settings
        self.reject_log = RateLimitedLog(log, REJECT_LOG_EVERY_S)
        self.tick_changed = False  # whether the last tick changed the state (only such ticks need logging)
        self.admission = AdmissionClock()  # lease waits, for the metrics line (not state)
        self.restore(ReplayState(outcomes=OutcomeState(window=settings.success_window,
                                                       long_window=settings.long_success_window)))
        self.state.guard.batch_tokens = settings.batch_tokens

    def restore(self, state: ReplayState) -> None:
        """Serve `state` (a fresh one, or a snapshot's): the components are built over its parts."""
        self.state, settings = state, self.settings
        windows = state.outcomes  # the windows are the config's, as the log's were when it wrote them
        windows.window, windows.long_window = settings.success_window, settings.long_success_window
        windows.__post_init__()
        state.hold.window = PACE_STEPS * settings.hold.batch_trajectories
        state.hold.__post_init__()
        self.hold = Hold(settings.hold, state.hold)
        self.edge = Edge(settings.edge, state)
        self.guard = Guard(settings.guard, state)
        self.rounds = Rounds(settings.rounds, state)
        self.rollback = Rollback(settings.checkpoint_every, state)
        self.leases = Leases(settings.leases, state, self.guard, self.rounds, self.admission)
        self.serving = Serving(settings.serving, state, self.edge, self.guard, self.rounds, self.rollback)

    # --- the two entry points ---------------------------------------------------------------------

    def handle(self, identity: bytes, message: AnyMessage, now: float, peer: str | None = None) -> list[Reply]:
        """Answer one decoded message from peer `identity`; also answers parked batch requests it unblocks.
        `peer`: the sender's identity as CURVE authenticated it ("learner", "rollout-3"), None without CURVE."""
        if peer is not None and not isinstance(message, Error):
            refused = key_problem(identity, message, peer)
            if refused is not None:
                error = self.reject(getattr(message, "msg_id", -1), "unauthorized", *refused)
                return [(identity, error)]
        problem = value_problem(message)
        if problem is not None:
            return self._refuse(identity, message, "malformed", *problem, now)
        if isinstance(message, LeaseRequest | Heartbeat) and self.leases.restarted(message.worker_id, message.session):
            self._abandon_worker(message.worker_id, f"worker {message.worker_id} restarted", now)
        if isinstance(message, LeaseRequest | StageRecord | Outcome | Heartbeat):
            self.leases.renew(message.worker_id, now)
        reply = self._dispatch(identity, message, now)
        replies = [(identity, reply)] if reply is not None else []
        if self.guard.holding() and isinstance(message, StageRecord | Heartbeat | LeaseRequest):
            return replies  # more work cannot release a held learner: outcomes, acks, requests and ticks can
        return replies + self.carry_out(self.serving.answer_parked(now), now)

    def _dispatch(self, identity: bytes, message: AnyMessage, now: float) -> Message | None:
        match message:
            case LeaseRequest():
                return self.carry_out(self.leases.lease(message, now), now)
            case StageRecord():
                return self._stage_record(message, now)
            case Outcome():
                return self._outcome(message, now)
            case Heartbeat():
                return None
            case EvalReport():
                return self._eval_report(message)
            case BatchRequest():
                return self._answer(message.msg_id, self.carry_out(self.serving.park(identity, message, now), now))
            case BatchAck():
                return self._answer(message.msg_id, self.carry_out(self.serving.batch_ack(message), now))
            case _:
                return self._unexpected(message)

    def tick(self, now: float) -> list[Reply]:
        """Run the timers: lease expiry, stage-group timeouts, unacked batches, the correction guard's abandon
        clock, parked batch requests. Sets `tick_changed` when any of them changed the state (the write-ahead log
        records only those ticks)."""
        changed = self._expire_leases(now)
        changed |= self._time_out_stage_groups(now)
        changed |= self._end_holds(now)
        changed |= self.carry_out(self.serving.requeue_unacked(now), now)
        changed |= self._abandon_guard_blocker(now)
        own = self.state.guard
        serves, guard = self.state.serving.serves, (own.since, own.abandon_at)
        replies = self.carry_out(self.serving.answer_parked(now), now)
        # a hold of the correction guard that begins or ends here is a change too (its times set its abandon clock)
        self.tick_changed = changed or self.state.serving.serves != serves or (own.since, own.abandon_at) != guard
        return replies

    def start_epoch(self, epoch: int, now: float) -> None:
        """A (re)start of the replay: ids made from now on carry `epoch` (docs/architecture.md, "A durable replay":
        an id made before a restart is never made again after it), and parked batch requests are dropped (a batch
        sent before its learner reconnected would be lost: the learner re-sends after learner.request_timeout_s).
        Groups, ledgers, queues, leases and the batches in flight rebuilt from the log stay as they are: their ids
        stay valid. A batch in flight at the crash keeps waiting for its ack (the learner may well have trained it:
        requeueing it would train its items twice); if no ack comes within replay.batch_ack_timeout_s it goes back
        to the queue as always, and a learner that restarted too requeues it at once with its new session."""
        state = self.state
        if not state.epoch < epoch < 2**31:
            raise ValueError(f"epoch {epoch}: expected in (current epoch {state.epoch}, 2**31)")
        state.serving.parked.clear()
        state.epoch = epoch
        state.group_ids, state.item_ids, state.batch_ids = Ids(epoch), Ids(epoch), Ids(epoch)
        # The learner's first word after a restart is trusted again, as a fresh replay's is (replay/edge.py): a log
        # that lost acknowledged bytes (a disk that lies; the chaos soak truncates it) forgot batches the learner
        # trained, and a ceiling rebuilt from it would refuse the learner's true version for good (version_ahead:
        # the soak's run stalled after its first truncation). Only the learner's key may send a BatchRequest.
        state.learner.version_ceiling = None

    def reject_frame(self, identity: bytes | None, detail: str) -> list[Reply]:
        """A frame that did not decode: count it, log it, answer `Error` when the sender is known."""
        self.counters.bad_messages += 1
        self.reject(-1, "malformed", "undecodable", f"bad frame from {identity!r}: {detail}")
        if identity is None:
            return []
        return [(identity, Error(msg_id=-1, code="malformed", detail=detail))]

    def refuse_handshake(self, reason: str) -> None:
        """A connection CURVE refused (no key, or one not in security.curve_dir): counted under `reason`."""
        self.reject(-1, "unauthorized", reason, "a peer without an allowed CURVE key was refused a connection")

    def carry_out(self, step: Steps[T], now: float) -> T:
        """Run a component's step, carrying out each of its decisions when it makes it (replay/decisions.py)."""
        while True:
            try:
                decision = next(step)
            except StopIteration as done:
                answer: T = done.value
                return answer
            match decision:
                case Advance(group):
                    self.advance(group, now)
                case GiveUp(group):
                    self._give_up(group, now)

    # --- a group's life (docs/algorithm.md, "Final credit and correction") ----------------------------

    def advance(self, group: Group, now: float) -> None:
        """The dispatch of a group's transitions: `Group.advance` says what they produced, this applies it."""
        state = self.state
        self.serving.hold_late_claims(group)  # before A_final is fixed: a late ack may still make credit issued
        hold_s = self.hold.seconds()
        state.counters.immediate_hold_s = hold_s if math.isfinite(hold_s) else -1.0
        step = group.advance(now, self.settings.group, state.item_ids, self.rollback.confirmed, hold_s)
        self.hold.waits(group.group_id, bool(group.held_since))
        queue, tally = state.serving.queue, state.tally(group.group_id)
        for item in step.immediates:
            queue.append(item)
            tally[0] += 1
        if step.finalized:
            self.guard.outcomes_in(group)
            self.leases.end(group)
            for item_id in step.superseded:
                queue.remove(item_id)
            state.counters.immediate_superseded += len(step.superseded)
            state.counters.immediate_held_over += step.held_over
            tally[0] -= len(step.superseded)
            for item in step.corrections:
                queue.append(item)
                tally[0] += 1
        if step.closed:
            residual = group.residual()
            if not residual <= state.counters.ledger_residual_max:  # NaN-aware: a NaN residual must show
                state.counters.ledger_residual_max = residual
            state.counters.groups_closed += 1
            self.leases.end(group)
            del state.groups[group.group_id]
            self.hold.waits(group.group_id, False)
            self.guard.forget(group.group_id)
            state.settle(group.group_id)

    def _stage_record(self, record: StageRecord, now: float) -> Ack | Error:
        group = self._group_of(record)
        if not isinstance(group, Group):
            return group
        if group.is_duplicate(record.member, record.stage_index):
            return Ack(msg_id=record.msg_id, duplicate=True)
        if record.member in group.ledger.abandoned:
            # A late record: its member was abandoned (the lease expired while its worker was frozen or cut off, or
            # the group was given up). Nothing of it is stored; the ack stops the worker's resends.
            self.counters.late_records += 1
            return Ack(msg_id=record.msg_id, duplicate=True)
        refused = self.edge.record_problem(group, record)
        if refused is not None:
            error = self.reject(record.msg_id, "bad_state", *refused)
            self._abandon_refused(group, record.member, refused[0], now)
            return error
        problem = group.stage_problem(record)
        if problem is not None:
            return self.reject(record.msg_id, "bad_state", "bad_stage", problem)
        self.guard.forget(group.group_id)
        if group.add_stage(record, now, track_stage_group=immediate_updates_on(self.settings.group.updates)):
            deadline = now + self.settings.group.stage_group_timeout_s
            self.state.stage_group_deadlines.append((deadline, group.group_id, record.stage_index))
        self.counters.env_steps += 1
        self.hold.stored(now, record.terminal)
        group.touched = now
        self.guard.stored(group.trajectories[record.member].num_tokens)
        self.leases.generates_with(record.worker_id, int(record.versions().max()))
        if record.member in group.ledger.outcomes:  # a stage resent after its outcome (replay/group.py)
            self._end_lease_when_all_in(group)
        self.advance(group, now)
        return Ack(msg_id=record.msg_id)

    def _group_of(self, message: StageRecord | Outcome) -> Group | Ack | Error:
        """The open group a worker's message is about, or its answer: a duplicate's Ack for a closed group's resend,
        an Error for an unknown group or a member that is not this group's."""
        group = self.groups.get(message.group_id)
        name = "stage record" if isinstance(message, StageRecord) else "outcome"
        if group is None and self.edge.closed(message.group_id):
            self.counters.closed_group_resends += 1
            return Ack(msg_id=message.msg_id, duplicate=True)
        if group is None:
            return self.reject(message.msg_id, "unknown_group", "unknown_group",
                               f"{name} for unknown group {message.group_id!r}")
        if message.worker_id != group.worker_id:  # the lease is the worker's, and with CURVE so is the worker id
            return self.reject(message.msg_id, "unauthorized", "not_leaseholder",
                               f"{name} from worker {message.worker_id!r} for group {message.group_id!r}, leased by "
                               f"{group.worker_id!r}")
        problem = group.member_problem(message.member, message.trajectory_id)
        if problem is not None:
            return self.reject(message.msg_id, "bad_state", "bad_member", problem)
        return group

    def _outcome(self, message: Outcome, now: float) -> Ack | Error:
        group = self._group_of(message)
        if not isinstance(group, Group):
            return group
        i, ledger = message.member, group.ledger
        if i in ledger.outcomes or i in ledger.abandoned:
            # A resend, or the outcome of a member already abandoned (its lease expired): nothing changes.
            self.counters.late_records += i in ledger.abandoned and not message.abandoned
            return Ack(msg_id=message.msg_id, duplicate=True)
        group.touched = now
        if message.abandoned:
            self._abandon(group, i, message.reason or "abandoned by its worker")
        else:
            problem = group.outcome_problem(message)
            if problem is not None:
                return self.reject(message.msg_id, "bad_state", "bad_outcome", problem)
            self._finished(group, message)
        self._end_lease_when_all_in(group)
        self.advance(group, now)
        return Ack(msg_id=message.msg_id)

    def _finished(self, group: Group, message: Outcome) -> None:
        """A member's outcome: into the ledger, the length model and the success windows."""
        i, ledger, windows = message.member, group.ledger, self.state.outcomes
        assert message.outcome is not None  # Group.outcome_problem refused a None outcome not marked abandoned
        ledger.add_outcome(i, message.outcome, message.num_stages)
        self.guard.forget(group.group_id)
        self.counters.trajectories_finished += 1
        if i in group.trajectories:
            self.state.guard.lengths.add(group.trajectories[i].num_tokens)
        rewards = sum(r for r in ledger.rewards[i].values() if r is not None)
        windows.finished.append((message.success, rewards, message.num_stages))
        if len(windows.finished_long) == windows.finished_long.maxlen:
            windows.successes_long -= windows.finished_long[0]
        windows.finished_long.append(message.success)
        windows.successes_long += message.success

    def _end_lease_when_all_in(self, group: Group) -> None:
        """No member left to wait for (every stage and outcome in, or abandoned): the worker's lease ends."""
        if not group.unfinished_members():
            self.leases.end(group)

    def _abandon(self, group: Group, i: int, reason: str) -> None:
        group.ledger.abandon(i)
        self.guard.forget(group.group_id)
        self.counters.trajectories_abandoned += 1
        self.counters.env_errors += reason.startswith("env_error")
        log.info("member %d of group %s abandoned: %s", i, group.group_id, reason)

    def _abandon_worker(self, worker_id: str, reason: str, now: float) -> None:
        for group_id in self.leases.held(worker_id):
            self._abandon_unfinished(self.groups[group_id], reason, now)

    def _abandon_unfinished(self, group: Group, reason: str, now: float) -> None:
        """A leased group's unfinished trajectories abandoned and its lease ended: it finalizes over the finished
        ones, and late records of its worker are acked, not stored."""
        for i in group.unfinished_members():
            self._abandon(group, i, reason)
        self.leases.end(group)
        self.advance(group, now)

    def _give_up(self, group: Group, now: float) -> None:
        """replay.max_open_groups: the group idle longest is given up, as for an expired lease."""
        log.warning("%d groups wait for outcomes (replay.max_open_groups): giving up group %s of worker %s, idle "
                    "%.1f s (%d unfinished trajectories abandoned)", self.settings.leases.max_open_groups,
                    group.group_id, group.worker_id, now - group.touched, len(group.unfinished_members()))
        self.counters.groups_given_up += 1
        self._abandon_unfinished(group, "given up at replay.max_open_groups", now)

    def _eval_report(self, report: EvalReport) -> Ack:
        self.state.outcomes.latest_eval = {**report.metrics, "eval_version": float(report.policy_version)}
        log.info("evaluation at version %d from %s: %s", report.policy_version, report.worker_id, report.metrics)
        return Ack(msg_id=report.msg_id)

    # --- timers ------------------------------------------------------------------------------------------

    def _expire_leases(self, now: float) -> bool:
        silent = self.leases.expired(now)
        for worker_id in silent:
            self._abandon_worker(worker_id, f"lease of worker {worker_id} expired", now)
        return bool(silent)

    def _time_out_stage_groups(self, now: float) -> bool:
        deadlines = self.state.stage_group_deadlines
        changed = False
        while deadlines and deadlines[0][0] <= now:
            changed = True
            _, group_id, k = deadlines.popleft()
            group = self.groups.get(group_id)
            if group is not None and k in group.stage_group_started:
                self.advance(group, now)
        return changed

    def _end_holds(self, now: float) -> bool:
        """Groups whose immediate items' hold ended by `now` make them (replay/hold.py)."""
        hold_s = self.hold.seconds()
        due = [group_id for group_id in sorted(self.state.hold.waiting)
               if group_id in self.groups and self.groups[group_id].hold_over(now, hold_s)]
        for group_id in due:
            self.advance(self.groups[group_id], now)
        return bool(due)

    def _abandon_guard_blocker(self, now: float) -> bool:
        """A group that held the learner replay.guard_abandon_s: its unfinished trajectories are abandoned (as if
        their lease expired), so it finalizes over the finished ones and the guard lets go. True: state changed."""
        due, blocker = self.guard.blocker_due(now)
        if blocker is None:
            return due
        unfinished = blocker.unfinished_members()
        log.warning("group %s held the learner %.0f s for its outcomes: abandoning its %d unfinished trajectories",
                    blocker.group_id, self.settings.guard.guard_abandon_s, len(unfinished))
        for i in unfinished:
            self._abandon(blocker, i, "its outcome held the learner past replay.guard_abandon_s")
        self.counters.guard_abandoned += len(unfinished)
        self.leases.end(blocker)
        self.advance(blocker, now)
        return True

    # --- errors ---------------------------------------------------------------------------------------

    def reject(self, msg_id: int, code: ErrorCode, reason: str, detail: str) -> Error:
        """Count a refusal under `reason`, log it (rate-limited), and build the `Error` that answers it."""
        rejected = self.counters.rejected
        rejected[reason] = rejected.get(reason, 0) + 1
        self.reject_log(reason, logging.WARNING, "rejected message %d: %s: %s", msg_id, reason, detail)
        return Error(msg_id=msg_id, code=code, detail=f"{reason}: {detail}")

    def _refuse(
        self, identity: bytes, message: AnyMessage, code: ErrorCode, reason: str, detail: str, now: float
    ) -> list[Reply]:
        """A message with a value out of range: nothing of it is stored, and its trajectory (if real) is abandoned."""
        error = self.reject(getattr(message, "msg_id", -1), code, reason, detail)
        if isinstance(message, StageRecord | Outcome):
            group = self.groups.get(message.group_id)
            if group is not None and message.worker_id == group.worker_id and message.member >= 0 and (
                group.member_problem(message.member, message.trajectory_id) is None
            ):  # only the leaseholder's own bad message gives up its trajectory
                self._abandon_refused(group, message.member, reason, now)
        return [(identity, error)] + self.carry_out(self.serving.answer_parked(now), now)

    def _abandon_refused(self, group: Group, member: int, reason: str, now: float) -> None:
        if member in group.unfinished_members():
            self._abandon(group, member, f"a message of it was refused ({reason})")
            self.leases.renew(group.worker_id, now)
            self._end_lease_when_all_in(group)
            self.advance(group, now)

    def _answer(self, msg_id: int, answer: Ack | Problem | None) -> Ack | Error | None:
        """A component's answer to a learner's message, or its refusal, (reason, detail), as `Error bad_state`."""
        return self.reject(msg_id, "bad_state", *answer) if isinstance(answer, tuple) else answer

    def _unexpected(self, message: AnyMessage) -> Error | None:
        """A message type the replay service never receives: count and log it, answer `bad_state`."""
        self.counters.bad_messages += 1
        name = type(message).__name__
        if isinstance(message, Error):
            self.reject(message.msg_id, "bad_state", "unexpected_error", f"a peer sent an Error: {message}")
            return None  # never answer an Error with an Error: two confused peers would ping-pong forever
        return self.reject(
            getattr(message, "msg_id", -1), "bad_state", "unexpected_type", f"the replay service does not accept {name}"
        )
