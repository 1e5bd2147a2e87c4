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
import signal
import threading
import time
from collections import deque
from collections.abc import Callable

import msgspec
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
from async_rl.staleness import admission_allowed, correction_trainable, immediate_trainable
from async_rl.transport import BadFrame, bind_router, poll, receive, send
from replay.group import Group
from replay.queue import InFlightBatch, ItemQueue
from replay.store import QueuedItem
from replay.wal import Entry, Received, ReplayLog, Ticked, Undecodable

log = logging.getLogger("async_rl.replay")

Reply = tuple[bytes, Message]

STALENESS_RETRY_S = 0.05  # admission reopens as soon as the learner steps; ask again soon
BUDGET_RETRY_S = 1.0  # the env-step budget never reopens; the worker is told to wind down
POLL_S = 0.02
MAX_MESSAGES_PER_TICK = 1000  # timers still run under a flood of messages
REJECT_LOG_EVERY_S = 10.0  # at most one warning per rejection reason this often (a flood must not fill the log)
EPOCH_SHIFT = 32  # item and batch ids are epoch << 32 | n
ID_MASK = 2**EPOCH_SHIFT - 1


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
        # Ids carry the epoch of the replay start that made them (docs/architecture.md, "A durable replay"), so an id
        # made before a restart is never made again after it: group ids `e<epoch>.g<n>`, item and batch ids
        # epoch << 32 | n. The core starts at epoch 0; `run` starts a new epoch on every start.
        self.epoch = 0
        self.group_ids = Ids(0)
        self.item_ids = Ids(0)
        self.batch_ids = Ids(0)
        self.serves = 0  # calls of _serve / _empty_batch, so `tick` can tell whether it changed anything
        self.tick_changed = False  # whether the last tick changed the state (only such ticks need logging)

    # --- the two entry points ---------------------------------------------------------------------

    def handle(self, identity: bytes, message: AnyMessage, now: float) -> list[Reply]:
        """Answer one decoded message from peer `identity`; also answers parked batch requests it unblocks."""
        problem = value_problem(message)
        if problem is not None:
            return self._refuse(identity, message, "malformed", *problem, now)
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
        """Run the timers: lease expiry, stage-group timeouts, unacked batches, parked batch requests. Sets
        `tick_changed` when any of them changed the state (the write-ahead log records only those ticks)."""
        changed = self._expire_leases(now)
        changed |= self._time_out_stage_groups(now)
        changed |= self._requeue_unacked(now)
        serves = self.serves
        replies = self._answer_parked(now)
        self.tick_changed = changed or self.serves != serves
        return replies

    def start_epoch(self, epoch: int, now: float) -> None:
        """A (re)start of the replay: every batch still in flight goes back to the front of the queue (its learner
        may never ack it, and a late ack is refused: `batch_not_in_flight`), parked batch requests are dropped (a
        batch sent before its learner reconnected would be lost: the learner re-sends after
        learner.request_timeout_s), and ids made from now on carry `epoch`. Groups, ledgers, queues and leases
        rebuilt from the log stay as they are: their ids stay valid."""
        if not self.epoch < epoch < 2**31:
            raise ValueError(f"epoch {epoch}: expected in (current epoch {self.epoch}, 2**31)")
        self._requeue_unacked(now, everything=True)
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
        if not admission_allowed(admitted + 1, v, algo.max_staleness, algo.groups_per_step):
            self.counters.leases_denied += 1
            return LeaseDenied(
                msg_id=request.msg_id, reason="staleness", retry_after_s=STALENESS_RETRY_S, policy_version=v
            )
        group_id = f"e{self.epoch}.g{next(self.group_ids) & ID_MASK}"
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
        if group.add_stage(record, now, track_stage_group=immediate_updates_on(self.algo.updates)):
            deadline = now + self.config.replay.stage_group_timeout_s
            self.stage_group_deadlines.append((deadline, group.group_id, record.stage_index))
        self.counters.env_steps += 1
        self._advance(group, now)
        return Ack(msg_id=record.msg_id)

    def _outcome(self, message: Outcome, now: float) -> Ack | Error:
        group = self.groups.get(message.group_id)
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

    def _expire_leases(self, now: float) -> bool:
        timeout_s = self.config.replay.lease_timeout_s
        expired = False
        for worker_id, group_ids in list(self.leases.items()):
            if now - self.worker_seen[worker_id] < timeout_s:
                continue
            expired = True
            log.warning("worker %s silent for %.1f s: abandoning its unfinished trajectories", worker_id, timeout_s)
            # Sorted, not in set order: a str's hash differs between processes, and a replay rebuilt from its log
            # must make the same items in the same order (docs/architecture.md, "A durable replay").
            for group_id in sorted(group_ids):
                group = self.groups[group_id]
                for i in group.unfinished_members():
                    self._abandon(group, i, f"lease of worker {worker_id} expired")
                self._end_lease(group)
                self._advance(group, now)
        return expired

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
            residual = group.residual()
            if not residual <= self.counters.ledger_residual_max:  # NaN-aware: a NaN residual must show, not vanish
                self.counters.ledger_residual_max = residual
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
        self.serves += 1
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
        """Batches not acked within batch_ack_timeout_s (or all in flight) go back to the front of the queue."""
        timeout_s = self.config.replay.batch_ack_timeout_s
        expired = [batch_id for batch_id, batch in self.in_flight.items()
                   if everything or now - batch.sent_at >= timeout_s]
        touched: dict[str, Group] = {}
        for batch_id in reversed(expired):  # the oldest batch ends up first
            batch = self.in_flight.pop(batch_id)
            if everything:
                log.warning("batch %d was in flight when the replay restarted: back to the front of the queue",
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
    try:
        socket = bind_router(context, config.replay.endpoint, config.replay.max_message_bytes)
        try:
            service.start_epoch(service.epoch + 1 if wal is not None else _volatile_epoch(), clock())
            if wal is not None:
                wal.compact(service, clock())  # the start is in a snapshot; a torn tail of the last run is gone
            log.info("replay service listening on %s (epoch %d, %s)", config.replay.endpoint, service.epoch,
                     f"log in {wal.directory}" if wal is not None else "not durable")
            # The replies of one round wait for its inputs to be in the log: one write + fsync per round.
            replies: list[Reply] = []
            while not stop.is_set():
                ready, received = poll(socket, POLL_S), 0
                while ready and received < MAX_MESSAGES_PER_TICK:
                    replies += _receive_one(service, socket, clock, wal)
                    received += 1
                    ready = poll(socket, 0)
                now = clock()
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
            handle_safely(service, entry.identity, decode(entry.message), entry.now)
        case Undecodable():
            service.reject_frame(entry.identity, entry.detail)
        case Ticked():
            service.tick(entry.now)


def _receive_one(
    service: ReplayService, socket: zmq.Socket, clock: Callable[[], float], wal: ReplayLog | None
) -> list[Reply]:
    try:
        identity, message = receive(socket)
    except BadFrame as exc:
        if wal is not None:
            wal.append(Undecodable(exc.identity, str(exc), clock()))
        return service.reject_frame(exc.identity, str(exc))
    now = clock()
    if wal is not None:
        wal.append(Received(identity, now, encode(message)))
    return handle_safely(service, identity, message, now)


def handle_safely(service: ReplayService, identity: bytes, message: AnyMessage, now: float) -> list[Reply]:
    """`handle`, except that a bug of ours must not take the service down for every other peer."""
    try:
        return service.handle(identity, message, now)
    except Exception:
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
