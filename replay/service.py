"""The replay service: leases, the per-group credit ledger, immediate and correction items, batches.

`ReplayService` is the whole logic with the clock passed in: `handle(identity, message, now)` answers one message
and `tick(now)` runs the timers (lease expiry, stage-group timeouts, unacked batches, parked batch requests);
both return the replies to send as (peer identity, message). `run` wraps it in one ROUTER socket and, with
`replay.durable`, the write-ahead log of replay/wal.py (each round's inputs are on disk before its replies leave).

Delivery of credit is at most once per item: only the ack of the batch currently holding an item counts. A batch
not acked within `replay.batch_ack_timeout_s` is put back at the front of the queue and a late ack for it is
refused (`Error bad_state`), so the ledger never counts an item twice. The price: if that learner did train the
batch before vanishing, those tokens are trained again when the items are re-served; the ledger then records
what was acknowledged, not everything the optimizer saw.

Validation at the edge (docs/architecture.md): every message is checked before anything is stored, first by
`protocol.value_problem` (finite rewards and outcomes, log-probs <= 0, members and versions >= 0, sane batch
requests), then against the service's state (versions ahead of what the learner can have, token ids past
`replay.vocab_size`, trajectories longer than `model.max_seq_len`). A refusal is an `Error` naming the reason,
counted by reason in `ReplayStats.rejected` and logged at most once per reason every `REJECT_LOG_EVERY_S`. A
stage record or outcome refused for its values abandons its trajectory (when the group and member are real), so
its group still closes over the other members.
"""

from __future__ import annotations

import logging
import math
import re
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import msgspec
import numpy as np
import zmq

from async_rl.config import Config
from async_rl.ledger import GroupLedger, corrections_on, immediate_updates_on
from async_rl.protocol import (
    TOKEN,
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
    decode,
    encode,
    value_problem,
)
from async_rl.ratelimit import RateLimitedLog
from async_rl.security import load_keys
from async_rl.staleness import admission_allowed, correction_trainable, immediate_trainable
from async_rl.telemetry import RoleMetrics
from async_rl.transport import BadFrame, CurveServerSocket, bind_router, poll, receive_from, send
from replay.group import Group
from replay.lengths import MARGIN_SD, LengthModel
from replay.queue import InFlightBatch, ItemQueue
from replay.store import QueuedItem
from replay.telemetry import AdmissionClock, metrics_line
from replay.wal import Entry, Received, Refused, ReplayLog, Ticked, Undecodable


class Work(NamedTuple):
    """Corrections still to be served, as the correction guard counts them (`ReplayService._fits`): one row per queued
    correction or pending group, as arrays of equal length."""

    deadline: np.ndarray  # the last learner version at which they are trainable
    items: np.ndarray
    tokens: np.ndarray  # their summed tokens (members still being generated: estimated)
    longest: np.ndarray  # the longest item's tokens (estimated likewise)
    growing: np.ndarray  # how many are trajectories still being generated

    def plus(self, *rows: tuple[int, int, int, int, int]) -> Work:
        """This work and `rows`, each (deadline, items, tokens, longest, growing)."""
        extra = np.asarray(rows, dtype=np.int64).reshape(len(rows), len(self)).T
        return Work(*(np.concatenate([column, more]) for column, more in zip(self, extra, strict=True)))


log = logging.getLogger("async_rl.replay")

Reply = tuple[bytes, Message]

STALENESS_RETRY_S = 0.05  # admission reopens as soon as the learner steps; ask again soon
BUDGET_RETRY_S = 1.0  # the env-step budget never reopens; the worker is told to wind down
POLL_S = 0.02
MAX_MESSAGES_PER_TICK = 1000  # timers still run under a flood of messages
REJECT_LOG_EVERY_S = 10.0  # at most one warning per rejection reason this often (a flood must not fill the log)
EPOCH_SHIFT = 32  # item and batch ids are epoch << 32 | n
ID_MASK = 2**EPOCH_SHIFT - 1
GROUP_ID = re.compile(r"e(\d{1,10})\.g(\d{1,10})")  # the group ids `_lease` makes


class Ids:
    """The ids of one kind a replay epoch hands out: epoch << 32 | n for n = 0, 1, ... (`next_n` is the next n)."""

    def __init__(self, epoch: int, next_n: int = 0) -> None:
        self.epoch, self.next_n = epoch, next_n

    def __iter__(self) -> Ids:
        return self

    def __next__(self) -> int:
        n, self.next_n = self.next_n, self.next_n + 1
        if n > ID_MASK:
            raise OverflowError(f"epoch {self.epoch} ran out of ids (2**{EPOCH_SHIFT})")
        return self.epoch << EPOCH_SHIFT | n


class ReplayService:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.algo = config.algo
        self.policy_version = 0  # the learner's latest version (BatchRequest / BatchAck)
        # What the learner's version can honestly be, as the replay saw it happen: the first version a learner told
        # us (a fresh or restarted replay trusts it), then + ppo_epochs per batch served or acked. Versions above
        # it + ppo_epochs + replay.max_version_lead are refused (`version_ahead`): a forged BatchRequest cannot
        # move the learner's version (and so the staleness of every item) to 2**40, and cannot ratchet it either.
        self.version_ceiling: int | None = None
        self.reject_log = RateLimitedLog(log, REJECT_LOG_EVERY_S)
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
        self.admission = AdmissionClock()  # lease waits, for the metrics line (replay/telemetry.py)
        # Ids carry the epoch of the replay start that made them (docs/architecture.md, "A durable replay"), so an id
        # made before a restart is never made again after it: group ids `e<epoch>.g<n>`, item and batch ids
        # epoch << 32 | n. The core starts at epoch 0; `run` starts a new epoch on every start.
        self.epoch = 0
        self.group_ids = Ids(0)
        self.item_ids = Ids(0)
        self.batch_ids = Ids(0)
        self.serves = 0  # calls of _serve / _empty_batch, so `tick` can tell whether it changed anything
        self.tick_changed = False  # whether the last tick changed the state (only such ticks need logging)
        # The correction-staleness guard (algo.correction_guard): when the current hold began (None: not holding),
        # and when the group holding it is abandoned (replay.guard_abandon_s).
        self.guard_since: float | None = None
        self.guard_abandon_at: float | None = None
        self.batch_tokens = config.learner.batch_tokens  # the learner's token budget (its latest BatchRequest)
        self.longest_trajectory = 0  # tokens of the longest trajectory stored so far (the guard's size estimate)
        self.length_model = LengthModel()  # finished trajectories' lengths (the guard's estimate for packed budgets)
        # group id -> (tokens so far, finished?) of each member not abandoned, for the guard's estimate: rebuilt only
        # when the group changes (a record, an outcome, an abandonment), so a guard check costs O(groups), not
        # O(trajectories). A pure function of the group: dropped wherever the group changes or goes.
        self.member_tokens: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.worker_versions: dict[str, int] = {}  # worker id -> the newest token version of its latest record
        # Lock-step rounds (algo.mode=sync): the current round's groups, and how many it has started.
        self.round_groups: set[str] = set()
        # Resume after a learner crash (docs/architecture.md, "Resume after a crash"): with learner checkpoints on,
        # trained acks above the learner's latest reported checkpoint stay undoable (the journal), and a group
        # whose items were acked above it stays open, so a learner that comes back at that checkpoint can be
        # rolled back to it exactly.
        self.checkpoints_on = config.learner.checkpoint_every > 0
        self.learner_session = 0  # the learner process the replay last heard from (BatchRequest.session)
        self.checkpointed = 0  # the learner's latest reported durable checkpoint (version 0 is rebuilt from config)
        self.journal: deque[tuple[int, list[QueuedItem]]] = deque()  # (ack version, items) above `checkpointed`
        self.unconfirmed: dict[str, int] = {}  # group id -> its newest trained ack version above `checkpointed`
        self.worker_sessions: dict[str, int] = {}  # worker id -> the newest session seen
        # Versions rollbacks took back: admission counts them as steps taken. The groups admitted for them are in
        # the system already, and the resumed learner may retrain their items in fewer steps; counted from its
        # version alone, admission would wait for steps that no item is left to make (a stall, tests/test_faults.py).
        self.admission_offset = 0

    # --- the two entry points ---------------------------------------------------------------------

    def handle(self, identity: bytes, message: AnyMessage, now: float, peer: str | None = None) -> list[Reply]:
        """Answer one decoded message from peer `identity`; also answers parked batch requests it unblocks.
        `peer`: the sender's role as CURVE authenticated it ("learner", "rollout"), None without CURVE."""
        if peer is not None and not isinstance(message, Error):
            role = "learner" if isinstance(message, BatchRequest | BatchAck) else "rollout"
            if peer != role:
                error = self._reject(getattr(message, "msg_id", -1), "unauthorized", f"not_{role}",
                                     f"{type(message).__name__} is only accepted from the {role}'s key, not {peer!r}")
                return [(identity, error)]
        problem = value_problem(message)
        if problem is not None:
            return self._refuse(identity, message, "malformed", *problem, now)
        if isinstance(message, LeaseRequest | Heartbeat):
            self._worker_session(message.worker_id, message.session, now)
        if isinstance(message, LeaseRequest | StageRecord | Outcome | Heartbeat):
            self._renew(message.worker_id, now)
        match message:
            case LeaseRequest():
                reply = self._lease(message, now)
                if isinstance(reply, LeaseDenied):
                    self.admission.denied_at(message.worker_id, reply.reason, now)
                else:
                    self.admission.granted_at(message.worker_id, now)
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
        if self.guard_since is not None and isinstance(message, StageRecord | Heartbeat | LeaseRequest):
            return replies  # more work cannot release a held learner: outcomes, acks, requests and ticks can
        return replies + self._answer_parked(now)

    def tick(self, now: float) -> list[Reply]:
        """Run the timers: lease expiry, stage-group timeouts, unacked batches, the correction guard's abandon
        clock, parked batch requests. Sets
        `tick_changed` when any of them changed the state (the write-ahead log records only those ticks)."""
        changed = self._expire_leases(now)
        changed |= self._time_out_stage_groups(now)
        changed |= self._requeue_unacked(now)
        changed |= self._abandon_guard_blocker(now)
        serves, guard = self.serves, (self.guard_since, self.guard_abandon_at)
        replies = self._answer_parked(now)
        # a hold of the correction guard that begins or ends here is a change too (its times set its abandon clock)
        self.tick_changed = changed or self.serves != serves or (self.guard_since, self.guard_abandon_at) != guard
        return replies

    def start_epoch(self, epoch: int, now: float) -> None:
        """A (re)start of the replay: ids made from now on carry `epoch`, and parked batch requests are dropped (a
        batch sent before its learner reconnected would be lost: the learner re-sends after
        learner.request_timeout_s). Groups, ledgers, queues, leases and the batches in flight rebuilt from the log
        stay as they are: their ids stay valid. A batch in flight at the crash keeps waiting for its ack (the
        learner may well have trained it: requeueing it would train its items twice); if no ack comes within
        replay.batch_ack_timeout_s it goes back to the queue as always, and a learner that restarted too requeues
        it at once with its new session."""
        if not self.epoch < epoch < 2**31:
            raise ValueError(f"epoch {epoch}: expected in (current epoch {self.epoch}, 2**31)")
        self.parked.clear()
        self.epoch = epoch
        self.group_ids, self.item_ids, self.batch_ids = Ids(epoch), Ids(epoch), Ids(epoch)

    def reject_frame(self, identity: bytes | None, detail: str) -> list[Reply]:
        """A frame that did not decode: count it, log it, answer `Error` when the sender is known."""
        self.counters.bad_messages += 1
        self._reject(-1, "malformed", "undecodable", f"bad frame from {identity!r}: {detail}")
        if identity is None:
            return []
        return [(identity, Error(msg_id=-1, code="malformed", detail=detail))]

    def refuse_handshake(self, reason: str) -> None:
        """A connection CURVE refused (no key, or one not in security.curve_dir): counted under `reason`."""
        self._reject(-1, "unauthorized", reason, "a peer without an allowed CURVE key was refused a connection")

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
            rejected=dict(self.counters.rejected),
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
        if algo.mode == "sync":
            allowed = self._round_open()
        else:
            # rolled-back versions count as steps taken (see admission_offset)
            allowed = admission_allowed(admitted + 1, v + self.admission_offset, algo.max_staleness,
                                        algo.groups_per_step)
            if allowed and not self._guard_admits(request.worker_id):
                allowed = False
                self.counters.guard_leases_denied += 1
        if not allowed:
            self.counters.leases_denied += 1
            return LeaseDenied(
                msg_id=request.msg_id, reason="staleness", retry_after_s=STALENESS_RETRY_S, policy_version=v
            )
        group_id = f"e{self.epoch}.g{next(self.group_ids) & ID_MASK}"
        self.counters.groups_started += 1
        group_size = self.config.rollout.group_size
        self.groups[group_id] = Group(group_id, request.worker_id, GroupLedger(group_size),
                                      leased_version=self.new_group_version(request.worker_id))
        if algo.mode == "sync":
            self.round_groups.add(group_id)
        self.leases.setdefault(request.worker_id, set()).add(group_id)
        self.worker_seen[request.worker_id] = now
        grant = LeaseGrant(msg_id=request.msg_id, group_id=group_id, group_size=group_size, policy_version=v)
        self.last_grant[request.worker_id] = grant
        return grant

    def _stage_record(self, record: StageRecord, now: float) -> Ack | Error:
        group = self.groups.get(record.group_id)
        if group is None and self._closed(record.group_id):
            self.counters.closed_group_resends += 1
            return Ack(msg_id=record.msg_id, duplicate=True)
        if group is None:
            return self._reject(
                record.msg_id, "unknown_group", "unknown_group", f"stage record for unknown group {record.group_id!r}"
            )
        problem = group.member_problem(record.member, record.trajectory_id)
        if problem is None and group.is_duplicate(record.member, record.stage_index):
            return Ack(msg_id=record.msg_id, duplicate=True)
        if problem is not None:
            return self._reject(record.msg_id, "bad_state", "bad_member", problem)
        refused = self._record_problem(group, record)
        if refused is not None:
            error = self._reject(record.msg_id, "bad_state", *refused)
            self._abandon_refused(group, record.member, refused[0], now)
            return error
        problem = group.stage_problem(record)
        if problem is not None:
            return self._reject(record.msg_id, "bad_state", "bad_stage", problem)
        self.member_tokens.pop(group.group_id, None)
        if group.add_stage(record, now, track_stage_group=immediate_updates_on(self.algo.updates)):
            deadline = now + self.config.replay.stage_group_timeout_s
            self.stage_group_deadlines.append((deadline, group.group_id, record.stage_index))
        self.counters.env_steps += 1
        self.longest_trajectory = max(self.longest_trajectory, group.trajectories[record.member].num_tokens)
        self.worker_versions[record.worker_id] = int(record.versions().max())  # the weights it generates with
        self._advance(group, now)
        return Ack(msg_id=record.msg_id)

    def _outcome(self, message: Outcome, now: float) -> Ack | Error:
        group = self.groups.get(message.group_id)
        if group is None and self._closed(message.group_id):
            self.counters.closed_group_resends += 1
            return Ack(msg_id=message.msg_id, duplicate=True)
        if group is None:
            return self._reject(
                message.msg_id, "unknown_group", "unknown_group", f"outcome for unknown group {message.group_id!r}"
            )
        problem = group.member_problem(message.member, message.trajectory_id)
        if problem is not None:
            return self._reject(message.msg_id, "bad_state", "bad_member", problem)
        i, ledger = message.member, group.ledger
        if i in ledger.outcomes or i in ledger.abandoned:
            # A resend, or the outcome of a member already abandoned (its lease expired): nothing changes.
            return Ack(msg_id=message.msg_id, duplicate=True)
        if message.abandoned:
            self._abandon(group, i, message.reason or "abandoned by its worker")
        else:
            problem = group.outcome_problem(message)
            if problem is not None:
                return self._reject(message.msg_id, "bad_state", "bad_outcome", problem)
            ledger.add_outcome(i, message.outcome, message.num_stages)
            self.member_tokens.pop(group.group_id, None)
            self.counters.trajectories_finished += 1
            if i in group.trajectories:
                self.length_model.add(group.trajectories[i].num_tokens)
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

    def _closed(self, group_id: str) -> bool:
        """Whether this replay issued `group_id` (`e<epoch>.g<n>`: an earlier epoch, or below the next n) and it is
        gone: a record for it is a worker's resend after the group closed (its ack was lost or late), so it is
        acknowledged as a duplicate (nothing of a closed group can change) instead of refused."""
        match = GROUP_ID.fullmatch(group_id)
        if match is None or group_id in self.groups:
            return False
        epoch, n = int(match[1]), int(match[2])
        return epoch < self.epoch or (epoch == self.epoch and n < self.group_ids.next_n)

    def _abandon(self, group: Group, i: int, reason: str) -> None:
        group.ledger.abandon(i)
        self.member_tokens.pop(group.group_id, None)
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

    def _expire_leases(self, now: float) -> bool:
        timeout_s = self.config.replay.lease_timeout_s
        expired = False
        for worker_id in list(self.leases):
            if now - self.worker_seen[worker_id] < timeout_s:
                continue
            expired = True
            log.warning("worker %s silent for %.1f s: abandoning its unfinished trajectories", worker_id, timeout_s)
            self._abandon_worker(worker_id, f"lease of worker {worker_id} expired", now)
        return expired

    def _abandon_worker(self, worker_id: str, reason: str, now: float) -> None:
        # Sorted, not in set order: a str's hash differs between processes, and a replay rebuilt from its log
        # must make the same items in the same order (docs/architecture.md, "A durable replay").
        for group_id in sorted(self.leases.get(worker_id, ())):
            group = self.groups[group_id]
            for i in group.unfinished_members():
                self._abandon(group, i, reason)
            self._end_lease(group)
            self._advance(group, now)

    def _worker_session(self, worker_id: str, session: int, now: float) -> None:
        """A worker id seen under a newer session is a restarted worker: the old process's leases are abandoned
        now (it will never send their outcomes), not after replay.lease_timeout_s of heartbeats from the new one."""
        known = self.worker_sessions.get(worker_id)
        if session == 0 or (known is not None and session <= known):
            return  # not told, the same process, or a late message of an older one
        self.worker_sessions[worker_id] = session
        if known is not None:
            self.counters.workers_restarted += 1
            log.warning("worker %s restarted: abandoning what its previous process held", worker_id)
            self._abandon_worker(worker_id, f"worker {worker_id} restarted", now)

    def _eval_report(self, report: EvalReport) -> Ack:
        self.latest_eval = {**report.metrics, "eval_version": float(report.policy_version)}
        log.info("evaluation at version %d from %s: %s", report.policy_version, report.worker_id, report.metrics)
        return Ack(msg_id=report.msg_id)

    # --- a group's life (docs/algorithm.md, "Final credit and correction") ----------------------------

    def _advance(self, group: Group, now: float) -> None:
        """Move a group as far as its state allows: immediate items, finalization, closing."""
        updates, hold = self.algo.updates, self.algo.hold_immediates
        outcomes_in = group.ledger.outcomes_complete()
        # Once every outcome is in, the correction carries the credit of a stage group not yet handed out (unless
        # immediate items are held for it: then they all go first, and the correction after their acks).
        carried_by_correction = corrections_on(updates) and outcomes_in and not hold
        if immediate_updates_on(updates) and not group.finalized and not carried_by_correction:
            for item in group.immediate_items(now, self.algo, self.config.replay, self.item_ids):
                (group.held_immediates if hold else self.queue).append(item)
                self._tally(group.group_id)[0] += 1
        if outcomes_in and group.held_immediates:
            for item in group.held_immediates:
                self.queue.append(item)
            group.held_immediates.clear()
        if group.ready_to_finalize() and not (hold and group.queued_immediates):
            self._end_lease(group)
            if corrections_on(updates):
                for item_id in group.queued_immediates:
                    self.queue.remove(item_id)  # never trained: issued stays 0 and the correction carries it
                self.counters.immediate_superseded += len(group.queued_immediates)
                self._tally(group.group_id)[0] -= len(group.queued_immediates)
            for item in group.finalize(self.algo, self.item_ids, with_corrections=corrections_on(updates)):
                self.queue.append(item)
                self._tally(group.group_id)[0] += 1
        if group.closable() and self._confirmed(group):
            residual = group.residual()
            if not residual <= self.counters.ledger_residual_max:  # NaN-aware: a NaN residual must show, not vanish
                self.counters.ledger_residual_max = residual
            self.counters.groups_closed += 1
            self._end_lease(group)
            del self.groups[group.group_id]
            self.member_tokens.pop(group.group_id, None)
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

    def _time_out_stage_groups(self, now: float) -> bool:
        deadlines = self.stage_group_deadlines
        changed = False
        while deadlines and deadlines[0][0] <= now:
            changed = True
            _, group_id, k = deadlines.popleft()
            group = self.groups.get(group_id)
            if group is not None and k in group.stage_group_started:
                self._advance(group, now)
        return changed

    # --- learners -----------------------------------------------------------------------------------

    def _park(self, identity: bytes, request: BatchRequest, now: float) -> Error | None:
        refused = self._learner_session(request, now)
        if refused is None:
            refused = self._learner_version(request.msg_id, request.policy_version)
        if refused is not None:
            return refused
        # A newer request from the same learner replaces its older one (among them a request re-sent after
        # learner.request_timeout_s: the learner takes a Batch that answers any request it sent).
        self.parked[identity] = (request, now)
        return None

    def _version_limit(self) -> int | None:
        """The highest version a message may carry (None: no learner has spoken since this replay started)."""
        if self.version_ceiling is None:
            return None
        return self.version_ceiling + self.algo.ppo_epochs + self.config.replay.max_version_lead

    def _learner_version(self, msg_id: int, version: int, acked: bool = False) -> Error | None:
        """Refuse a learner's version above what it can honestly have; else take it as the latest."""
        limit = self._version_limit()
        if limit is not None and version > limit:
            return self._reject(
                msg_id, "bad_state", "version_ahead",
                f"policy_version {version} is above {limit}, the most the learner can have "
                f"({self.version_ceiling} + algo.ppo_epochs + replay.max_version_lead)",
            )
        self.policy_version = max(self.policy_version, version)
        if self.version_ceiling is None:
            self.version_ceiling = version  # a learner's first word: trusted (the replay may have restarted)
        elif acked:  # one batch trained: at most ppo_epochs further
            self.version_ceiling = max(self.version_ceiling, min(version, self.version_ceiling + self.algo.ppo_epochs))
        return None

    def _record_problem(self, group: Group, record: StageRecord) -> tuple[str, str] | None:
        """(reason, detail) for a new stage record whose values the service's state refuses, or None."""
        limit = self._version_limit()
        newest = int(record.versions().max())
        if limit is not None and newest > limit:
            return "version_ahead", f"policy version {newest} is above {limit}, the most the learner can have"
        vocab_size = self.config.replay.vocab_size
        if vocab_size is not None:
            for name, ids in (("action", record.action_ids()), ("observation", record.observation_ids())):
                if len(ids) and ids.max() >= vocab_size:
                    return "bad_token", f"{name} token id {int(ids.max())} >= replay.vocab_size {vocab_size}"
        trajectory = group.trajectories.get(record.member)
        stored = trajectory.num_tokens if trajectory is not None else 0
        length = stored + (len(record.observation_tokens) + len(record.action_tokens)) // TOKEN.itemsize
        max_seq_len = self.config.model.max_seq_len
        if length > max_seq_len:
            return "too_long", f"trajectory {record.trajectory_id} would be {length} tokens > model.max_seq_len"
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
            if self.algo.mode == "sync":
                if not self._round_generated():
                    continue  # lock-step: nothing is trained before the whole round is in; then all of it at once
            elif len(self.queue) < max(1, request.min_items) and not waited:
                continue
            guard = self._guard(request)
            if guard == "hold":
                self._guard_hold(now)
                continue
            batch = self._serve(request, now, corrections_only=guard == "corrections")
            if batch is not None:
                self._guard_release(now)
                del self.parked[identity]
                replies.append((identity, batch))
        return replies

    # --- the correction-staleness guard (docs/algorithm.md, "Staleness") -------------------------------

    def _guard_on(self) -> bool:
        return self.algo.correction_guard and corrections_on(self.algo.updates) and self.algo.mode == "async"

    def _length_estimate(self) -> int:
        """How long a trajectory still being generated may get: the longest finished so far, and before any has
        finished, model.max_seq_len (at the start every trajectory is short; the first groups must not overfill)."""
        if self.counters.trajectories_finished == 0:
            return self.config.model.max_seq_len
        return max(1, self.longest_trajectory)

    def _packed(self) -> bool:
        return self.config.learner.batch_budget == "packed"

    def _by_sum(self) -> bool:
        """Pending work is counted by its expected sum (replay/lengths.py): packed budgets, once a trajectory has
        finished; otherwise every member is as long as `_length_estimate`."""
        return self._packed() and len(self.length_model) > 0

    def _correction_work(self, skip: frozenset[int] = frozenset()) -> Work:
        """Every correction still to be served: the queued ones (but the item ids in `skip`), and the pending groups'
        (one per member not abandoned; a group with no record yet from its lease version, its worker's weights). The
        deadline is the last learner version at which it is trainable: oldest token version + the bound. A member
        still being generated is sized by `_pending_sizes`. One pass over the groups; O(groups + queued
        corrections)."""
        queued = [q for q in self.queue.corrections() if q.item_id not in skip]
        oldest: list[int] = []
        parts: list[tuple[np.ndarray, np.ndarray]] = []
        for group in self.groups.values():
            if not group.finalized:
                oldest.append(group.leased_version if group.oldest_version is None else group.oldest_version)
                parts.append(self._member_tokens(group))
        members = np.fromiter((len(so_far) for so_far, _ in parts), dtype=np.int64, count=len(parts))
        tokens, longest, growing = self._pending_sizes(parts, members)
        queued_tokens = np.fromiter((q.num_tokens for q in queued), dtype=np.int64, count=len(queued))
        queued_oldest = np.fromiter((q.oldest_version for q in queued), dtype=np.int64, count=len(queued))
        bound = self.algo.max_correction_staleness
        return Work(np.concatenate([queued_oldest, np.asarray(oldest, dtype=np.int64)]) + bound,
                    np.concatenate([np.ones(len(queued), dtype=np.int64), members]),
                    np.concatenate([queued_tokens, tokens]), np.concatenate([queued_tokens, longest]),
                    np.concatenate([np.zeros(len(queued), dtype=np.int64), growing]))

    def _member_tokens(self, group: Group) -> tuple[np.ndarray, np.ndarray]:
        """(tokens so far, finished?) of the group's members not abandoned (cached in `member_tokens`)."""
        cached = self.member_tokens.get(group.group_id)
        if cached is None:
            ledger, trajectories = group.ledger, group.trajectories
            members = [i for i in range(group.group_size) if i not in ledger.abandoned]
            so_far = np.asarray([trajectories[i].num_tokens if i in trajectories else 0 for i in members],
                                dtype=np.float64)
            cached = self.member_tokens[group.group_id] = (so_far, np.asarray([i in ledger.outcomes for i in members],
                                                                              dtype=bool))
        return cached

    def _pending_sizes(self, parts: list[tuple[np.ndarray, np.ndarray]], members: np.ndarray,
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, longest, members still growing) of each pending group's corrections to come, from its members'
        (tokens so far, finished?) and their count. Padded budgets (and before any trajectory has finished): every
        member as long as `_length_estimate`. Packed budgets: a finished member at its length, a growing one at the
        mean length of the finished trajectories at least as long as it already is (replay/lengths.py); `_fits` adds
        the margin for the growing ones."""
        none = np.zeros_like(members)
        if not self._by_sum():
            estimate = self._length_estimate()
            return members * estimate, np.full(len(members), estimate, dtype=np.int64), none
        if not members.sum():
            return none, none, none
        tokens_so_far = np.concatenate([so_far for so_far, _ in parts])
        done = np.concatenate([finished for _, finished in parts])
        size = np.where(done, tokens_so_far, self.length_model.expected(tokens_so_far))
        owner = np.repeat(np.arange(len(members)), members)
        total = np.bincount(owner, weights=size, minlength=len(members))
        growing = np.bincount(owner, weights=~done, minlength=len(members))
        longest = np.zeros(len(members))
        np.maximum.at(longest, owner, size)
        return (np.ceil(total).astype(np.int64), np.ceil(longest).astype(np.int64),
                np.rint(growing).astype(np.int64))

    def _fits(self, work: Work, first_version: int, max_tokens: int) -> bool:
        """Earliest deadline first: can every correction in `work` be served by its deadline, one batch every
        ppo_epochs versions from `first_version` on? Padded budgets: a batch holds max_tokens // (its longest item)
        items. Packed: the corrections due by a deadline need their summed tokens (plus MARGIN_SD standard deviations
        for the members still growing) in batches of max_tokens less the longest item (a batch filled in order
        closes early by less than the item that did not fit), and at least one item a batch. Checked once per
        distinct deadline, over everything due by it (what is needed only grows within a deadline)."""
        if not len(work.deadline):
            return True
        if work.deadline.min() < first_version:
            return False
        deadlines, at = np.unique(work.deadline, return_inverse=True)
        items, tokens, growing = (np.cumsum(np.bincount(at, weights=column)) for column in
                                  (work.items, work.tokens, work.growing))
        longest = np.zeros(len(deadlines))
        np.maximum.at(longest, at, work.longest)
        longest = np.maximum.accumulate(longest)
        slots = (deadlines - first_version) // self.algo.ppo_epochs + 1
        if self._by_sum():
            room = max_tokens - np.maximum(longest, self.longest_trajectory)
            due = tokens + MARGIN_SD * self.length_model.sd * np.sqrt(growing)
            need = np.where(room <= 0, items, np.minimum(items, np.ceil(due / np.maximum(room, 1))))
        else:
            need = np.ceil(items / np.maximum(1, max_tokens // np.maximum(1, longest)))
        return bool(np.all(need <= slots))

    def _guard_blocker(self) -> Group | None:
        """The pending group (outcomes not all in) with the oldest tokens: what a held learner waits for."""
        pending = [g for g in self.groups.values() if not g.finalized and g.oldest_version is not None]
        return min(pending, key=lambda g: g.oldest_version, default=None)

    def _guard(self, request: BatchRequest) -> str:
        """'serve' (FIFO), 'corrections' (only corrections, earliest deadline first) or 'hold' (nothing).

        Serving a batch at version v moves the learner to v + ppo_epochs; every correction not in it is served
        there at the earliest. If what is left would not fit by its deadlines, the candidates are the queued
        corrections due no later than every pending group's (an earliest-deadline-first schedule serves them
        first whenever the pending outcomes arrive), the most urgent first, as many as one batch holds. They are
        served if they fill the batch (that schedule would fill this slot with them too: waiting could put nothing
        more urgent in it) or if everything else still fits after them. Otherwise the learner waits for the pending
        outcomes: a batch of only these would spend a slot their corrections may need, and waiting lets them share
        it (holding ages nothing: versions move only with batches).

        The rule before 2026-11-23 held whenever anything was pending; where the learner, not the judges, is the
        bottleneck, that kept it waiting behind a backlog it could not clear by waiting (docs/research/log.md,
        "cluster_sim")."""
        if not self._guard_on():
            return "serve"
        self.batch_tokens = request.max_tokens
        work = self._correction_work()
        next_version = self.policy_version + self.algo.ppo_epochs
        if self._fits(work, next_version, request.max_tokens):
            return "serve"
        bound = self.algo.max_correction_staleness
        first_pending = min((group.leased_version if group.oldest_version is None else group.oldest_version) + bound
                            for group in self.groups.values() if not group.finalized) if self._pending() else math.inf
        due = sorted((q for q in self.queue.corrections() if q.oldest_version + bound <= first_pending),
                     key=lambda q: (q.oldest_version, q.item_id))
        if not due:
            return "hold"
        batch = self._one_batch(due, request.max_tokens)
        if len(batch) < len(due) or self._fits(self._correction_work(skip=frozenset(q.item_id for q in batch)),
                                               next_version, request.max_tokens):
            self.queue.move_to_front(due)
            return "corrections"
        return "hold"

    def _one_batch(self, items: list[QueuedItem], max_tokens: int) -> list[QueuedItem]:
        """The first of `items` that one batch holds, counted as `_serve` counts (at least one)."""
        longest = total = 0
        for count, queued in enumerate(items):
            n = queued.num_tokens
            if count and self._cost(longest, total, count, n) > max_tokens:
                return items[:count]
            longest, total = max(longest, n), total + n
        return items

    def _cost(self, longest: int, total: int, count: int, n: int) -> int:
        """A batch's tokens as learner.batch_budget counts them, once an item of n tokens joins `count` items whose
        longest has `longest` tokens and whose sum is `total`."""
        return total + n if self._packed() else max(longest, n) * (count + 1)

    def _pending(self) -> bool:
        return any(not group.finalized for group in self.groups.values())

    def new_group_version(self, worker_id: str) -> int:
        """The oldest version a new group's tokens can have: the learner's, or the worker's weights if older."""
        return min(self.policy_version, self.worker_versions.get(worker_id, self.policy_version))

    def _guard_admits(self, worker_id: str) -> bool:
        """Admission by correction capacity: a new group (its tokens at the learner's version or later) must leave
        every correction still to come trainable in time, even after one more batch without any of them (the
        serving check's worst case). With none to come, any group is admitted."""
        if not self._guard_on():
            return True
        work = self._correction_work()
        if not len(work.deadline):
            return True
        size = self.config.rollout.group_size
        if self._by_sum():
            estimate, growing = int(np.ceil(self.length_model.expected(np.zeros(1))[0])), size
        else:
            estimate, growing = self._length_estimate(), 0
        deadline = self.new_group_version(worker_id) + self.algo.max_correction_staleness
        new = (deadline, size, size * estimate, estimate, growing)
        return self._fits(work.plus(new), self.policy_version + self.algo.ppo_epochs, self.batch_tokens)

    def _guard_hold(self, now: float) -> None:
        if self.guard_since is None:
            self.guard_since = now
            self.counters.guard_holds += 1
        if self.guard_abandon_at is None:
            self.guard_abandon_at = now + self.config.replay.guard_abandon_s

    def _guard_release(self, now: float) -> None:
        if self.guard_since is not None:
            self.counters.guard_held_s += now - self.guard_since
            self.guard_since = self.guard_abandon_at = None

    def _abandon_guard_blocker(self, now: float) -> bool:
        """A group that held the learner replay.guard_abandon_s: its unfinished trajectories are abandoned (as if
        their lease expired), so it finalizes over the finished ones and the guard lets go. True: state changed."""
        if self.guard_abandon_at is None or now < self.guard_abandon_at:
            return False
        self.guard_abandon_at = None if self.guard_since is None else now + self.config.replay.guard_abandon_s
        blocker = self._guard_blocker()
        if blocker is None:
            return True
        unfinished = blocker.unfinished_members()
        log.warning("group %s held the learner %.0f s for its outcomes: abandoning its %d unfinished trajectories",
                    blocker.group_id, self.config.replay.guard_abandon_s, len(unfinished))
        for i in unfinished:
            self._abandon(blocker, i, "its outcome held the learner past replay.guard_abandon_s")
        self.counters.guard_abandoned += len(unfinished)
        self._end_lease(blocker)
        self._advance(blocker, now)
        return True

    # --- lock-step rounds (algo.mode=sync) ----------------------------------------------------------

    def _round_generated(self) -> bool:
        """Every group of the current round has all its outcomes in (finalized or closed), and the round is full
        (or the env-step budget stopped it)."""
        budget = self.config.run.max_env_steps
        full = len(self.round_groups) >= self.algo.groups_per_step or (
            budget is not None and self.counters.env_steps >= budget
        )
        return full and bool(self.round_groups) and all(
            gid not in self.groups or self.groups[gid].finalized for gid in self.round_groups
        )

    def _round_open(self) -> bool:
        """May a group start in the current round? A round that is over (every item of it trained: its groups
        closed and their items acknowledged) is replaced by the next one first."""
        if len(self.round_groups) < self.algo.groups_per_step:
            return True
        if all(self._round_group_over(gid) for gid in self.round_groups):
            self.round_groups = set()
            self.counters.sync_rounds += 1
            return True
        return False

    def _round_group_over(self, group_id: str) -> bool:
        """No item of the group is left to train: closed, or finalized with nothing queued or in flight. A group
        held open only because its acks are above the learner's last checkpoint (`_confirmed`: a rollback could
        still take them back) is over for the round; waiting for its close would wait for the next checkpoint."""
        tally = self.item_tally.get(group_id)
        if tally is not None and tally[0] > 0:
            return False
        group = self.groups.get(group_id)
        if group is None:
            return True
        return group.finalized and not (group.queued_immediates or group.in_flight_immediates
                                        or group.open_corrections)

    def _serve(self, request: BatchRequest, now: float, corrections_only: bool = False) -> Batch | None:
        """Take items FIFO while the batch fits the token budget, counted as learner.batch_budget says (§4 bounds
        checked at the learner's v); with `corrections_only` (the guard), stop at the first item that is not a
        correction."""
        v, algo = self.policy_version, self.algo
        self.serves += 1
        served: list[QueuedItem] = []
        stale_groups: dict[str, Group] = {}  # a group held open for its immediates may close now (_confirmed)
        longest = total = 0
        while self.queue:
            queued = self.queue.pop_front()
            group = self.groups.get(queued.group_id)
            if queued.kind == "immediate" and not immediate_trainable(v, queued.oldest_version, algo.max_staleness):
                self.counters.immediate_skipped_stale += 1  # issued stays 0: the correction carries its credit
                if group is not None:
                    group.queued_immediates.discard(queued.item_id)
                    if algo.hold_immediates and not group.queued_immediates:
                        self._advance(group, now)  # its last held item: the correction may join this batch
                    elif self._retaining():
                        stale_groups[group.group_id] = group
                self._item_done(queued.group_id, trained=False)
                continue
            if queued.kind == "correction" and not correction_trainable(
                v, queued.oldest_version, algo.max_correction_staleness
            ):
                self._drop_correction(group, queued, now)
                continue
            n = queued.num_tokens
            over = served and self._cost(longest, total, len(served), n) > request.max_tokens
            if over or (corrections_only and queued.kind != "correction"):
                self.queue.push_front([queued])
                break
            longest, total = max(longest, n), total + n
            served.append(queued)
            if queued.kind == "immediate" and group is not None:
                group.queued_immediates.discard(queued.item_id)
                group.in_flight_immediates.add(queued.item_id)
        for group in stale_groups.values():
            if group.group_id in self.groups:
                self._advance(group, now)
        if not served:
            return None
        batch_id = next(self.batch_ids)
        self.in_flight[batch_id] = InFlightBatch(served, now)
        # The learner may train this batch (ppo_epochs steps) even if its ack never arrives.
        if self.version_ceiling is not None:
            self.version_ceiling = max(self.version_ceiling, min(request.policy_version, self.version_ceiling)
                                       + algo.ppo_epochs)
        stats = self.stats_snapshot()
        stats.immediate_before_outcome = sum(self._before_outcome(queued) for queued in served)
        self.counters.ledger_residual_max = 0.0  # reported once: the max since the previous batch
        return Batch(msg_id=request.msg_id, batch_id=batch_id, items=[q.item for q in served], stats=stats)

    def _empty_batch(self, request: BatchRequest, now: float) -> Batch:
        self.serves += 1
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
        if ack.batch_id not in self.in_flight:
            return self._reject(
                ack.msg_id, "bad_state", "batch_not_in_flight",
                f"batch {ack.batch_id} is not in flight (requeued after a timeout?): its ack is refused",
            )
        refused = self._learner_version(ack.msg_id, ack.policy_version, acked=True)
        if refused is not None:
            return refused
        batch = self.in_flight.pop(ack.batch_id)
        if not ack.trained:
            self._untrained(batch, now)
            return Ack(msg_id=ack.msg_id)
        self._journal_ack(ack.policy_version, batch.items)
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

    def _untrained(self, batch: InFlightBatch, now: float) -> None:
        """The learner refused the step (BatchAck.trained=False): no credit was trained. An immediate's credit goes
        to its correction (as for a stale one); a correction's credit is dropped and counted (docs/algorithm.md)."""
        if batch.items:
            log.warning("the learner did not train a batch of %d items: none of its credit counts", len(batch.items))
        touched: dict[str, Group] = {}
        for queued in batch.items:
            group = self.groups.get(queued.group_id)
            if queued.kind == "correction":
                self._drop_correction(group, queued, now)
                continue
            if group is not None:
                group.in_flight_immediates.discard(queued.item_id)
                touched[group.group_id] = group
            self._item_done(queued.group_id, trained=False)
        for group in touched.values():
            if group.group_id in self.groups:
                self._advance(group, now)

    def _requeue_unacked(self, now: float, everything: bool = False) -> bool:
        """Batches not acked within replay.batch_ack_timeout_s (`everything`: all of them, their learner restarted
        or the replay did) go back to the front of the queue."""
        timeout_s = self.config.replay.batch_ack_timeout_s
        expired = [batch_id for batch_id, batch in self.in_flight.items()
                   if everything or now - batch.sent_at >= timeout_s]
        touched: dict[str, Group] = {}
        for batch_id in reversed(expired):  # the oldest batch ends up first
            batch = self.in_flight.pop(batch_id)
            if everything:
                log.warning("batch %d was in flight to a learner (or a replay) that restarted: back to the front of "
                            "the queue",
                            batch_id)
            else:
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
        return bool(expired)

    # --- resume after a learner crash (docs/architecture.md, "Resume after a crash") -----------------------

    def _learner_session(self, request: BatchRequest, now: float) -> Error | None:
        """Take the learner's checkpoint report; on the first request of a new learner process, requeue what was in
        flight to the old one and, if it came back below the acked version, roll back to its checkpoint."""
        if request.session == 0 or request.session == self.learner_session:
            self._confirm_checkpoint(request.checkpoint, now)
            return None
        if request.session < self.learner_session:  # sessions are start times: a newer learner already spoke
            return self._reject(request.msg_id, "bad_state", "old_session",
                                f"learner session {request.session} is older than {self.learner_session}")
        r = request.policy_version
        if r < self.policy_version:
            problem = self._rollback_problem(r)
            if problem is not None:
                return self._reject(request.msg_id, "bad_state", "bad_resume", problem)
        log.info("learner session %d starts at version %d (the replay had %d, checkpoint %d)",
                 request.session, r, self.policy_version, self.checkpointed)
        self.learner_session = request.session
        self._requeue_unacked(now, everything=True)
        if r < self.policy_version:
            self._roll_back(r, now)
        self._confirm_checkpoint(request.checkpoint, now)
        return None

    def _rollback_problem(self, version: int) -> str | None:
        """Why a learner restarted at `version` (below the replay's) cannot be rolled back to, or None. The only
        target is the learner's latest reported checkpoint: a forged restart can at most undo the acks above it
        (they are trained again), never a group that closed."""
        if not self._retaining():
            return (f"the learner restarted at version {version} below {self.policy_version}, and with "
                    "learner.checkpoint_every 0 the replay keeps nothing to roll back: restart the replay as well")
        if version != self.checkpointed:
            return (f"the learner restarted at version {version}, but its latest reported checkpoint is "
                    f"{self.checkpointed}: the replay can only roll back to that one")
        return None

    def _retaining(self) -> bool:
        """Keep what a rollback needs: learner checkpoints are on, and the learner tells its session (a client that
        does not, e.g. a test driving the service by hand, gets the plain service: groups close at once)."""
        return self.checkpoints_on and self.learner_session != 0

    def _journal_ack(self, version: int, items: list[QueuedItem]) -> None:
        if not self._retaining() or not items:
            return
        self.journal.append((version, items))
        for queued in items:
            self.unconfirmed[queued.group_id] = max(version, self.unconfirmed.get(queued.group_id, version))

    def _confirmed(self, group: Group) -> bool:
        """May `group` close? Not while a rollback could still take back one of its acks, nor (immediate-only)
        while its immediate items wait: a rollback would requeue them into a group that is gone."""
        if not self._retaining():
            return True
        if group.queued_immediates or group.in_flight_immediates:
            return False
        return self.unconfirmed.get(group.group_id, -1) <= self.checkpointed

    def _confirm_checkpoint(self, version: int, now: float) -> None:
        """The learner's checkpoint at `version` is durable: acks at or below it are final."""
        if version <= self.checkpointed or version > self.policy_version:
            return
        self.checkpointed = version
        released: set[str] = set()
        while self.journal and self.journal[0][0] <= version:
            released.update(queued.group_id for queued in self.journal.popleft()[1])
        for group_id in released:
            if self.unconfirmed.get(group_id, -1) <= version:
                self.unconfirmed.pop(group_id, None)
                group = self.groups.get(group_id)
                if group is not None:
                    self._advance(group, now)

    def _roll_back(self, version: int, now: float) -> None:
        """Undo every trained ack above `version`: its credit leaves the ledger and its items go back to the front of
        the queue, to be trained once more by the resumed learner. A finalized group that loses an immediate's credit
        is finalized again (its corrections are withdrawn and C = A_final − issued recomputed)."""
        undone: list[QueuedItem] = []
        while self.journal and self.journal[-1][0] > version:
            undone[:0] = self.journal.pop()[1]
        refinalize: dict[str, Group] = {}
        touched: dict[str, Group] = {}
        kept: list[QueuedItem] = []
        for queued in undone:
            group = self.groups.get(queued.group_id)  # kept open by _confirmed
            if group is None:  # cannot happen (a bug if it does): the item is not requeued, its group is gone
                log.error("rollback: group %s of item %d is closed; not requeued", queued.group_id, queued.item_id)
                continue
            kept.append(queued)
            immediate = queued.kind == "immediate"
            for k, advantage in queued.credit.items():
                group.ledger.undo_trained(queued.member, k, advantage, immediate=immediate)
            tally = self._tally(queued.group_id)
            tally[0] += 1
            tally[1] -= 1
            if immediate:
                group.queued_immediates.add(queued.item_id)
                if group.finalized:
                    refinalize[group.group_id] = group
            else:
                group.open_corrections.add(queued.item_id)
            touched[group.group_id] = group
        self.queue.push_front(kept)
        for group in refinalize.values():
            for item_id in group.open_corrections:
                self.queue.remove(item_id)  # every correction came after the immediate's ack: none was final
            self._tally(group.group_id)[0] -= len(group.open_corrections)
            group.open_corrections.clear()
            group.dropped_stages.clear()
            group.finalized = False
            group.ledger.unfinalize()
        self.unconfirmed.clear()
        for ack_version, items in self.journal:
            for queued in items:
                self.unconfirmed[queued.group_id] = max(ack_version, self.unconfirmed.get(queued.group_id, ack_version))
        self.counters.rollbacks += 1
        self.counters.items_rolled_back += len(undone)
        log.warning("learner resumed at version %d below %d: rolled back %d trained item(s) (%d group(s) finalized "
                    "again)", version, self.policy_version, len(undone), len(refinalize))
        self.admission_offset += self.policy_version - version
        self.policy_version = version
        for group in touched.values():
            if group.group_id in self.groups:
                self._advance(group, now)

    # --- errors ---------------------------------------------------------------------------------------

    def _reject(self, msg_id: int, code: str, reason: str, detail: str) -> Error:
        """Count a refusal under `reason`, log it (rate-limited), and build the `Error` that answers it."""
        rejected = self.counters.rejected
        rejected[reason] = rejected.get(reason, 0) + 1
        self.reject_log(reason, logging.WARNING, "rejected message %d: %s: %s", msg_id, reason, detail)
        return Error(msg_id=msg_id, code=code, detail=f"{reason}: {detail}")

    def _refuse(
        self, identity: bytes, message: AnyMessage, code: str, reason: str, detail: str, now: float
    ) -> list[Reply]:
        """A message with a value out of range: nothing of it is stored, and its trajectory (if real) is abandoned."""
        error = self._reject(getattr(message, "msg_id", -1), code, reason, detail)
        if isinstance(message, StageRecord | Outcome):
            group = self.groups.get(message.group_id)
            if group is not None and message.member >= 0 and (
                group.member_problem(message.member, message.trajectory_id) is None
            ):
                self._abandon_refused(group, message.member, reason, now)
        return [(identity, error)] + self._answer_parked(now)

    def _abandon_refused(self, group: Group, member: int, reason: str, now: float) -> None:
        if member in group.unfinished_members():
            self._abandon(group, member, f"a message of it was refused ({reason})")
            self._renew(group.worker_id, now)
            if not group.unfinished_members():
                self._end_lease(group)
            self._advance(group, now)

    def _unexpected(self, message: AnyMessage) -> Error | None:
        """A message type the replay service never receives: count and log it, answer `bad_state`."""
        self.counters.bad_messages += 1
        name = type(message).__name__
        if isinstance(message, Error):
            self._reject(message.msg_id, "bad_state", "unexpected_error", f"a peer sent an Error: {message}")
            return None  # never answer an Error with an Error: two confused peers would ping-pong forever
        return self._reject(
            getattr(message, "msg_id", -1), "bad_state", "unexpected_type", f"the replay service does not accept {name}"
        )


# --- the socket loop ------------------------------------------------------------------------------------


def run(config: Config, stop: threading.Event | None = None, service: ReplayService | None = None) -> None:
    """Serve the replay ROUTER at `config.replay.endpoint` until `stop` is set (or SIGTERM / SIGINT).
    `service`: the core to serve (a test reads its counters afterwards); a fresh one by default.

    With `replay.durable` the service is first rebuilt from its log in `<run dir>/replay/` (replay/wal.py), and
    each poll round's inputs are written and fsynced before its replies are sent: started again with the same
    config after a crash, the replay goes on from the last acknowledged input. Every start begins a new epoch."""
    stop = stop if stop is not None else threading.Event()
    service = service if service is not None else ReplayService(config)
    wal, clock = open_log(config, service)
    previous_handlers = _stop_on_signals(stop)
    context = zmq.Context()
    metrics = RoleMetrics(config, "replay", histograms=("queue_staleness_hist",))
    next_metrics_at = time.monotonic() + config.run.metrics_every_s
    try:
        socket = bind_router(context, config.replay.endpoint, config.replay.max_message_bytes,
                             load_keys(config, "replay"))
        try:
            service.start_epoch(service.epoch + 1 if wal is not None else _volatile_epoch(), clock())
            if wal is not None:
                wal.compact(service, clock())  # the start is in a snapshot; a torn tail of the last run is gone
            log.info("replay service listening on %s (epoch %d, %s)", config.replay.endpoint, service.epoch,
                     f"log in {wal.directory}" if wal is not None else "not durable")
            # The replies of one round wait for its inputs to be in the log: one write + fsync per round.
            replies: list[Reply] = []
            while not stop.is_set():
                if time.monotonic() >= next_metrics_at:
                    next_metrics_at = time.monotonic() + config.run.metrics_every_s
                    metrics.write(metrics_line(service, clock()))
                ready, received = poll(socket, POLL_S), 0
                while ready and received < MAX_MESSAGES_PER_TICK:
                    replies += _receive_one(service, socket, clock, wal)
                    received += 1
                    ready = poll(socket, 0)
                now = clock()
                if isinstance(socket, CurveServerSocket):  # CURVE on: count the peers it kept out
                    for reason in socket.refused_handshakes():
                        if wal is not None:
                            wal.append(Refused(reason, now))
                        service.refuse_handshake(reason)
                replies += service.tick(now)
                if wal is not None:
                    if service.tick_changed:
                        wal.append(Ticked(now))
                    wal.commit()
                for identity, reply in replies:
                    send(socket, reply, identity)
                replies = []
                if wal is not None and wal.due():
                    wal.compact(service, clock())
        finally:
            socket.close(linger=0)
    finally:
        metrics.write(metrics_line(service, clock()))
        metrics.close()
        context.term()
        for signum, handler in previous_handlers.items():
            signal.signal(signum, handler)
        if wal is not None:
            wal.close()
        log.info("replay service stopped: %s", service.stats_snapshot())


def open_log(config: Config, service: ReplayService) -> tuple[ReplayLog | None, Callable[[], float]]:
    """With `replay.durable`: lock and replay the log in `<run dir>/replay/` into `service`. Returns the log (None
    when not durable) and the service clock: monotonic seconds that go on from the last logged input, so the
    timers of the rebuilt state (leases, stage groups, batches) resume where they stopped (the time the replay was
    down does not count: its peers could not reach it)."""
    wal, base = None, 0.0
    if config.replay.durable:
        wal = ReplayLog(config.run_dir / "replay", config.replay.fsync, config.replay.compact_every)
        service_log_disabled, log.disabled = log.disabled, True  # the rebuild repeats the log lines of the last run
        try:
            base = wal.recover(service, apply_entry)
        except BaseException:
            wal.close()
            raise
        finally:
            log.disabled = service_log_disabled
    started = time.monotonic()
    return wal, lambda: base + (time.monotonic() - started)


def _volatile_epoch() -> int:
    """A replay without a log cannot count its starts: the wall clock's seconds tell them apart."""
    return int(time.time()) % 2**31 or 1


def apply_entry(service: ReplayService, entry: Entry) -> None:
    """Replay one logged input exactly as the socket loop handed it over."""
    match entry:
        case Received():
            handle_safely(service, entry.identity, decode(entry.message), entry.now, entry.peer)
        case Refused():
            service.refuse_handshake(entry.reason)
        case Undecodable():
            service.reject_frame(entry.identity, entry.detail)
        case Ticked():
            service.tick(entry.now)


def _receive_one(
    service: ReplayService, socket: zmq.Socket, clock: Callable[[], float], wal: ReplayLog | None
) -> list[Reply]:
    try:
        identity, message, peer = receive_from(socket)
    except BadFrame as exc:
        if wal is not None:
            wal.append(Undecodable(exc.identity, str(exc), clock()))
        return service.reject_frame(exc.identity, str(exc))
    now = clock()
    if wal is not None:
        wal.append(Received(identity, now, encode(message), peer))
    return handle_safely(service, identity, message, now, peer)


def handle_safely(
    service: ReplayService, identity: bytes, message: AnyMessage, now: float, peer: str | None = None
) -> list[Reply]:
    """`handle`, except that a bug of ours must not take the service down for every other peer."""
    try:
        return service.handle(identity, message, now, peer)
    except Exception:  # a bug of ours must not take the service down for every other peer
        log.exception("internal error handling %s from %r", type(message).__name__, identity)
        service.counters.bad_messages += 1
        service.counters.rejected["internal_error"] = service.counters.rejected.get("internal_error", 0) + 1
        detail = "internal error in the replay service (see its log)"
        return [(identity, Error(msg_id=getattr(message, "msg_id", -1), code="bad_state", detail=detail))]


def _stop_on_signals(stop: threading.Event) -> dict[int, object]:
    """SIGTERM / SIGINT set `stop` (only the main thread may install handlers); returns the previous ones."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signum: signal.signal(signum, lambda *_: stop.set()) for signum in (signal.SIGTERM, signal.SIGINT)}
