"""The replay's whole state as one msgspec Struct, one sub-struct per component, and its codec: a snapshot is
`encode(state)` (replay/wal.py names no field of it).

Everything the replay's next answers depend on is here, and nothing it derives (its config, logger, caches and
windowed stats). Each component reads and writes its own part: `leases` (replay/leases.py), `learner` and `serving`
(replay/edge.py, replay/serving.py), `guard` (replay/guard.py), `rounds` (replay/rounds.py), `rollback`
(replay/rollback.py), `outcomes` (the success windows, replay/service.py). The groups, the counters, the ids and
the items' tallies are shared.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import msgspec

from async_rl.ledger import GroupLedger, Stage
from async_rl.protocol import BatchRequest, LeaseGrant, ReplayStats
from replay.group import Group
from replay.hold import HoldState
from replay.lengths import LengthModel
from replay.queue import InFlightBatch, ItemQueue
from replay.store import QueuedItem

EPOCH_SHIFT = 32  # item and batch ids are epoch << 32 | n
ID_MASK = 2**EPOCH_SHIFT - 1


class Ids(msgspec.Struct):
    """The ids of one kind a replay epoch hands out: epoch << 32 | n for n = 0, 1, ... (`next_n` is the next n)."""

    epoch: int = 0
    next_n: int = 0

    def __iter__(self) -> Ids:
        return self

    def __next__(self) -> int:
        n, self.next_n = self.next_n, self.next_n + 1
        if n > ID_MASK:
            raise OverflowError(f"epoch {self.epoch} ran out of ids (2**{EPOCH_SHIFT})")
        return self.epoch << EPOCH_SHIFT | n


class LeaseState(msgspec.Struct):
    """Leases, admission and worker sessions (replay/leases.py)."""

    leases: dict[str, set[str]] = {}  # worker id -> its groups still waiting for outcomes
    worker_seen: dict[str, float] = {}  # worker id -> last message (workers holding leases)
    last_grant: dict[str, LeaseGrant] = {}  # worker id -> its last grant, for a resent LeaseRequest
    worker_sessions: dict[str, int] = {}  # worker id -> the newest session seen
    worker_versions: dict[str, int] = {}  # worker id -> the newest token version of its latest record
    # Versions rollbacks took back: admission counts them as steps taken (replay/rollback.py).
    admission_offset: int = 0


class LearnerState(msgspec.Struct):
    """The learner's version as the replay saw it (replay/edge.py)."""

    policy_version: int = 0  # the learner's latest version (BatchRequest / BatchAck)
    # What the learner's version can honestly be: the first version a learner told us, then + ppo_epochs per batch
    # served or acked (None: no learner has spoken since this replay started).
    version_ceiling: int | None = None


class ServeState(msgspec.Struct):
    """The queue, the batches in flight and the parked batch requests (replay/serving.py)."""

    queue: ItemQueue = msgspec.field(default_factory=ItemQueue)
    in_flight: dict[int, InFlightBatch] = {}
    parked: dict[bytes, tuple[BatchRequest, float]] = {}  # learner identity -> (request, arrival)
    serves: int = 0  # batches served (empty ones too), so `tick` can tell whether it changed anything
    # batch id -> its item ids, for the latest batches requeued after replay.batch_ack_timeout_s (a frozen learner's
    # late ack takes the items still queued: replay/serving.py), oldest first, at most REQUEUED_KEPT
    requeued: dict[int, list[int]] = {}
    # item id -> a queued immediate of a group whose outcomes are all in, that a requeued batch's late ack may still
    # claim: out of the queue, and in its group's in_flight_immediates, so the group finalizes only once that ack
    # (its credit issued) or the end of its window (the correction carries it) settles it (replay/serving.py)
    held: dict[int, QueuedItem] = {}


class GuardState(msgspec.Struct):
    """The correction-staleness guard (replay/guard.py)."""

    since: float | None = None  # when the current hold began (None: not holding)
    abandon_at: float | None = None  # when the group holding it is abandoned (replay.guard_abandon_s)
    batch_tokens: int = 0  # the learner's token budget (its latest BatchRequest)
    longest_trajectory: int = 0  # tokens of the longest trajectory stored so far (the size estimate)
    lengths: LengthModel = msgspec.field(default_factory=LengthModel)  # finished trajectories' lengths
    # algo.max_correction_staleness=auto (Guard.bound): the outcome delays, in learner versions, of the latest
    # groups (oldest first), and the bound in use (also a fixed one) with the version it was set at (-1: not yet)
    outcome_lags: list[int] = []
    auto_bound: int = 0
    auto_bound_version: int = -1


class RoundState(msgspec.Struct):
    """Lock-step rounds, algo.mode=sync (replay/rounds.py): the current round's groups."""

    groups: set[str] = set()


class RollbackState(msgspec.Struct):
    """Resume after a learner crash (replay/rollback.py)."""

    session: int = 0  # the learner process the replay last heard from (BatchRequest.session)
    checkpointed: int = 0  # the learner's latest reported durable checkpoint
    journal: list[tuple[int, list[QueuedItem]]] = []  # (ack version, items) above `checkpointed`, oldest first
    unconfirmed: dict[str, int] = {}  # group id -> its newest trained ack version above `checkpointed`


class OutcomeState(msgspec.Struct):
    """The success windows and the newest evaluation, for the stats the learner logs."""

    window: int = 64  # replay.success_window
    long_window: int = 2048  # replay.long_success_window
    finished: deque = msgspec.field(default_factory=deque)  # (success, summed stage rewards, stages), newest last
    finished_long: deque = msgspec.field(default_factory=deque)  # success of the last long_window
    successes_long: int = 0  # successes in finished_long, kept as a running count (the window is long)
    latest_eval: dict[str, float] = {}  # the newest EvalReport's metrics

    def __post_init__(self) -> None:
        self.finished = deque(self.finished, maxlen=self.window)
        self.finished_long = deque(self.finished_long, maxlen=self.long_window)


class ReplayState(msgspec.Struct):
    """Everything a ReplayService holds that its next answers depend on."""

    counters: ReplayStats = msgspec.field(default_factory=ReplayStats)  # cumulative; windowed fields by `stats`
    epoch: int = 0
    group_ids: Ids = msgspec.field(default_factory=Ids)
    item_ids: Ids = msgspec.field(default_factory=Ids)
    batch_ids: Ids = msgspec.field(default_factory=Ids)
    groups: dict[str, Group] = {}
    stage_group_deadlines: deque = msgspec.field(default_factory=deque)  # (deadline, group, k), in time order
    # group id -> [items queued or in flight, items trained]: a group that ends with nothing trained (no item, or
    # every item skipped as stale) is counted in groups_empty and no longer holds admission back.
    item_tally: dict[str, list[int]] = {}
    leases: LeaseState = msgspec.field(default_factory=LeaseState)
    learner: LearnerState = msgspec.field(default_factory=LearnerState)
    serving: ServeState = msgspec.field(default_factory=ServeState)
    guard: GuardState = msgspec.field(default_factory=GuardState)
    rounds: RoundState = msgspec.field(default_factory=RoundState)
    rollback: RollbackState = msgspec.field(default_factory=RollbackState)
    outcomes: OutcomeState = msgspec.field(default_factory=OutcomeState)
    hold: HoldState = msgspec.field(default_factory=HoldState)

    # --- the items' tallies (shared by serving, rollback and the group dispatch) ---

    def tally(self, group_id: str) -> list[int]:
        return self.item_tally.setdefault(group_id, [0, 0])

    def item_done(self, group_id: str, trained: bool) -> None:
        tally = self.tally(group_id)
        tally[0] -= 1
        tally[1] += trained
        self.settle(group_id)

    def settle(self, group_id: str) -> None:
        """A closed group with no item left in the queue or in flight is over: empty if nothing was trained."""
        tally = self.tally(group_id)
        if group_id not in self.groups and tally[0] == 0:
            del self.item_tally[group_id]
            self.counters.groups_empty += tally[1] == 0

    def stats(self, now: float | None = None) -> ReplayStats:
        """The cumulative counters with the windowed fields filled in (a copy); at `now`, the guard's hold still
        running counts in `guard_held_s` too (`guard_hold_running_s`), not only the holds released."""
        windows = self.outcomes
        since = self.guard.since
        running = max(now - since, 0.0) if now is not None and since is not None else 0.0
        finished = windows.finished
        successes = sum(success for success, _, _ in finished)
        reward_sum = sum(rewards for _, rewards, _ in finished)
        stages = sum(num_stages for _, _, num_stages in finished)
        return msgspec.structs.replace(
            self.counters,
            eval_metrics=dict(windows.latest_eval),
            success_rate=successes / len(finished) if finished else 0.0,
            success_rate_long=windows.successes_long / len(windows.finished_long) if windows.finished_long else 0.0,
            stage_reward_mean=reward_sum / stages if stages else 0.0,
            items_queued=len(self.serving.queue),
            correction_bound=self.guard.auto_bound,
            rejected=dict(self.counters.rejected),
            guard_held_s=self.counters.guard_held_s + running,
            guard_hold_running_s=running,
        )


# --- the codec: the few types of the state that are not Structs or builtins -------------------------------------


class LedgerState(msgspec.Struct, array_like=True):
    """A GroupLedger's fields (async_rl/ledger.py), in the order its dicts were filled."""

    group_size: int
    rewards: dict[int, dict[int, float | None]]
    num_stages: dict[int, int]
    outcomes: dict[int, float]
    abandoned: set[int]
    issued: dict[Stage, float]
    trained: dict[Stage, float]
    a_final: dict[Stage, float] | None
    updates: str
    immediate_done: set[int]


def _enc_hook(value: object) -> object:
    if isinstance(value, GroupLedger):
        return LedgerState(**{name: getattr(value, name) for name in LedgerState.__struct_fields__})
    if isinstance(value, ItemQueue | deque):
        return list(value)
    if isinstance(value, LengthModel):
        return list(value.lengths)
    raise NotImplementedError(f"cannot encode {type(value).__name__} in the replay's state")


def _ledger(value: object) -> GroupLedger:
    state = msgspec.convert(value, LedgerState)
    ledger = GroupLedger(state.group_size)
    for name in LedgerState.__struct_fields__:
        setattr(ledger, name, getattr(state, name))
    return ledger


def _dec_hook(kind: type, value: Any) -> object:
    if kind is GroupLedger:
        return _ledger(value)
    if kind is ItemQueue:
        queue = ItemQueue()
        for queued in msgspec.convert(value, list[QueuedItem]):
            queue.append(queued)
        return queue
    if kind is LengthModel:
        return LengthModel(value)
    if kind is deque:  # of tuples (as lists on the wire) or of bools
        return deque(tuple(entry) if isinstance(entry, list) else entry for entry in value)
    raise NotImplementedError(f"cannot decode {kind.__name__} in the replay's state")


encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def decoder(kind: type) -> msgspec.msgpack.Decoder:
    """A decoder of `kind` (a Struct holding a ReplayState) that rebuilds the state's own types."""
    return msgspec.msgpack.Decoder(kind, dec_hook=_dec_hook)


# --- a copy that compares by value (tests compare two) ---------------------------------------------------------


class _ComparableLedger(GroupLedger):
    def __eq__(self, other: object) -> bool:
        return isinstance(other, GroupLedger) and vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]


class _ComparableQueue(ItemQueue):
    def __eq__(self, other: object) -> bool:
        return isinstance(other, ItemQueue) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]


class _ComparableLengths(LengthModel):
    def __eq__(self, other: object) -> bool:
        return isinstance(other, LengthModel) and self.lengths == other.lengths

    __hash__ = None  # type: ignore[assignment]


_COMPARABLE = {GroupLedger: _ComparableLedger, ItemQueue: _ComparableQueue, LengthModel: _ComparableLengths}


def _comparable_hook(kind: type, value: Any) -> object:
    decoded = _dec_hook(kind, value)
    if kind in _COMPARABLE:
        decoded.__class__ = _COMPARABLE[kind]
    return decoded


def comparable(state: ReplayState) -> ReplayState:
    """A copy of `state` that compares by value (dicts and sets unordered; queues and windows as lists)."""
    return msgspec.msgpack.Decoder(ReplayState, dec_hook=_comparable_hook).decode(encoder.encode(state))
