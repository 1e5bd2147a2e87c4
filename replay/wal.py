"""The replay's write-ahead log: what a crash cannot take (docs/architecture.md, "A durable replay").

`ReplayService` is deterministic given its inputs (handle(identity, message, now), reject_frame, tick(now)), so
the log records the inputs, not the state: every message the service handled (with its `now`), every frame it
could not decode, and every tick that changed something. Replaying them into the state of the last snapshot
rebuilds groups, ledgers, queues, leases and counters exactly. The socket loop (`replay.service.run`) appends
the inputs of one poll round, writes and fsyncs them once (`commit`), and only then sends that round's replies:
nothing acknowledged can be lost; what a crash loses is a round whose replies were never sent, which the workers
and the learner send again.

On disk, in `<run dir>/replay/`:
  snapshot-N.msgpack  the whole service state when segment N began (msgspec MessagePack, one framed entry)
  wal-N.log           the inputs since then, one framed entry each
  lock                flock'ed by the live replay: a second replay on the same log refuses to start
A frame is <u32 length><u32 zlib.crc32> then the msgpack payload. A torn or corrupt frame ends the segment: it and
anything after it are dropped with a warning (a crash mid-write; it was never fsynced, so never acknowledged).
Compaction: every start, and every `replay.compact_every` entries, the live state is written as snapshot N+1
(write, fsync, rename), segment N+1 is started and everything older is deleted, so the log is bounded by the live
state plus compact_every entries.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import struct
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec

from async_rl.errors import AsyncRLError
from async_rl.ledger import GroupLedger, Stage
from async_rl.protocol import BatchRequest, LeaseGrant, ReplayStats
from replay.group import Group
from replay.lengths import LengthModel
from replay.queue import InFlightBatch, ItemQueue
from replay.store import QueuedItem

log = logging.getLogger("async_rl.replay.wal")

FORMAT = 1  # of the snapshot: bump when the state's layout changes
HEADER = struct.Struct("<II")  # payload length, zlib.crc32(payload)
SEGMENT = re.compile(r"wal-(\d{8})\.log")
SNAPSHOT = re.compile(r"snapshot-(\d{8})\.msgpack")


class WalError(AsyncRLError):
    """The log cannot be used: corrupt beyond a torn tail, from another format, or held by another replay."""


# --- entries: the service's inputs ---------------------------------------------------------------------


class Received(msgspec.Struct, tag="in", array_like=True):
    """A message `handle` answered: the sender's identity, the service clock, the message as encoded, and the
    sender's role as CURVE authenticated it (None without CURVE): the rebuild must refuse what the live replay did."""

    identity: bytes
    now: float
    message: bytes
    peer: str | None = None


class Undecodable(msgspec.Struct, tag="frame", array_like=True):
    """A frame that did not decode (`reject_frame`): it only counts, but counts are state."""

    identity: bytes | None
    detail: str
    now: float


class Refused(msgspec.Struct, tag="refused", array_like=True):
    """A connection CURVE refused (`refuse_handshake`): it only counts, but counts are state."""

    reason: str
    now: float


class Ticked(msgspec.Struct, tag="tick", array_like=True):
    """A `tick(now)` that changed the state (lease expiry, stage-group timeout, requeue, a parked request served)."""

    now: float


Entry = Received | Undecodable | Refused | Ticked


# --- the state: a snapshot -----------------------------------------------------------------------------


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


class State(msgspec.Struct):
    """Everything a ReplayService holds that its next answers depend on (not its config, logger or windowed stats,
    which it derives). `now`: the service clock when the state was taken."""

    format: int
    now: float
    epoch: int
    next_ids: tuple[int, int, int]  # the next n of group, item and batch ids in this epoch
    serves: int
    policy_version: int
    version_ceiling: int | None
    counters: ReplayStats
    groups: list[Group]
    leases: dict[str, set[str]]
    worker_seen: dict[str, float]
    last_grant: dict[str, LeaseGrant]
    queue: list[QueuedItem]
    in_flight: dict[int, InFlightBatch]
    item_tally: dict[str, list[int]]
    parked: list[tuple[bytes, BatchRequest, float]]
    stage_group_deadlines: list[tuple[float, str, int]]
    finished: list[tuple[bool, float, int]]
    finished_long: list[bool]
    successes_long: int
    latest_eval: dict[str, float]
    # the correction-staleness guard and lock-step rounds (docs/algorithm.md)
    guard_since: float | None = None
    guard_abandon_at: float | None = None
    batch_tokens: int = 0
    longest_trajectory: int = 0
    finished_lengths: list[int] = []
    worker_versions: dict[str, int] = {}
    round_groups: set[str] = set()
    # resume after a learner crash (docs/architecture.md, "Resume after a crash")
    learner_session: int = 0
    checkpointed: int = 0
    journal: list[tuple[int, list[QueuedItem]]] = []
    unconfirmed: dict[str, int] = {}
    worker_sessions: dict[str, int] = {}
    admission_offset: int = 0


def _enc_hook(value: object) -> object:
    if isinstance(value, GroupLedger):
        return LedgerState(**{name: getattr(value, name) for name in LedgerState.__struct_fields__})
    raise NotImplementedError(f"cannot encode {type(value).__name__} in a replay snapshot")


def _dec_hook(kind: type, value: object) -> object:
    if kind is GroupLedger:
        state = msgspec.convert(value, LedgerState)
        ledger = GroupLedger(state.group_size)
        for name in LedgerState.__struct_fields__:
            setattr(ledger, name, getattr(state, name))
        return ledger
    raise NotImplementedError(f"cannot decode {kind.__name__} in a replay snapshot")


_state_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_state_decoder = msgspec.msgpack.Decoder(State, dec_hook=_dec_hook)
_entry_encoder = msgspec.msgpack.Encoder()
_entry_decoder = msgspec.msgpack.Decoder(Entry)


def capture(service, now: float) -> State:  # noqa: ANN001 - replay.service.ReplayService (it imports this module)
    """The service's state as a State (shares its objects: encode it before the service moves on)."""
    return State(
        format=FORMAT, now=now, epoch=service.epoch,
        next_ids=(service.group_ids.next_n, service.item_ids.next_n, service.batch_ids.next_n),
        serves=service.serves, policy_version=service.policy_version, version_ceiling=service.version_ceiling,
        counters=service.counters, groups=list(service.groups.values()), leases=service.leases,
        worker_seen=service.worker_seen, last_grant=service.last_grant, queue=list(service.queue),
        in_flight=service.in_flight, item_tally=service.item_tally,
        parked=[(identity, request, since) for identity, (request, since) in service.parked.items()],
        stage_group_deadlines=list(service.stage_group_deadlines), finished=list(service.finished),
        finished_long=list(service.finished_long), successes_long=service.successes_long,
        latest_eval=service.latest_eval,
        guard_since=service.guard_since, guard_abandon_at=service.guard_abandon_at, batch_tokens=service.batch_tokens,
        longest_trajectory=service.longest_trajectory, finished_lengths=list(service.length_model.lengths),
        worker_versions=service.worker_versions,
        round_groups=service.round_groups, learner_session=service.learner_session,
        checkpointed=service.checkpointed, journal=list(service.journal), unconfirmed=service.unconfirmed,
        worker_sessions=service.worker_sessions, admission_offset=service.admission_offset,
    )


def restore(service, state: State) -> None:  # noqa: ANN001 - replay.service.ReplayService
    """Put a snapshot's state into a service built from the same config (fresh, or to be overwritten)."""
    from replay.service import Ids

    group_n, item_n, batch_n = state.next_ids
    service.epoch = state.epoch
    service.group_ids = Ids(state.epoch, group_n)
    service.item_ids = Ids(state.epoch, item_n)
    service.batch_ids = Ids(state.epoch, batch_n)
    service.serves = state.serves
    service.policy_version, service.version_ceiling = state.policy_version, state.version_ceiling
    service.counters = state.counters
    service.groups = {group.group_id: group for group in state.groups}
    service.member_tokens = {}
    service.leases, service.worker_seen, service.last_grant = state.leases, state.worker_seen, state.last_grant
    service.queue = ItemQueue()
    for queued in state.queue:
        service.queue.append(queued)
    service.in_flight, service.item_tally = state.in_flight, state.item_tally
    service.parked = {identity: (request, since) for identity, request, since in state.parked}
    service.stage_group_deadlines = deque(state.stage_group_deadlines)
    service.finished.clear()
    service.finished.extend(state.finished)
    service.finished_long.clear()
    service.finished_long.extend(state.finished_long)
    service.successes_long, service.latest_eval = state.successes_long, state.latest_eval
    service.guard_since, service.guard_abandon_at = state.guard_since, state.guard_abandon_at
    service.batch_tokens, service.longest_trajectory = state.batch_tokens, state.longest_trajectory
    service.length_model = LengthModel(state.finished_lengths)
    service.worker_versions, service.round_groups = state.worker_versions, state.round_groups
    service.learner_session, service.checkpointed = state.learner_session, state.checkpointed
    service.journal = deque(state.journal)
    service.unconfirmed, service.worker_sessions = state.unconfirmed, state.worker_sessions
    service.admission_offset = state.admission_offset


class _ComparableLedger(GroupLedger):
    def __eq__(self, other: object) -> bool:
        return isinstance(other, GroupLedger) and vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]


def _comparable_hook(kind: type, value: object) -> object:
    ledger = _dec_hook(kind, value)
    ledger.__class__ = _ComparableLedger
    return ledger


def comparable(service) -> State:  # noqa: ANN001 - replay.service.ReplayService
    """A copy of the service's state that compares by value (dicts and sets unordered): tests compare two."""
    decoder = msgspec.msgpack.Decoder(State, dec_hook=_comparable_hook)
    return decoder.decode(_state_encoder.encode(capture(service, 0.0)))


# --- framing -------------------------------------------------------------------------------------------


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def read_frames(data: bytes) -> tuple[list[bytes], int]:
    """The payloads of the whole frames in `data`, and the offset where a torn or corrupt frame began (len(data)
    when there is none)."""
    payloads, offset = [], 0
    while offset < len(data):
        if len(data) - offset < HEADER.size:
            break
        length, crc = HEADER.unpack_from(data, offset)
        start = offset + HEADER.size
        payload = data[start : start + length]
        if len(payload) < length or zlib.crc32(payload) != crc:
            break
        payloads.append(payload)
        offset = start + length
    return payloads, offset


# --- the log -------------------------------------------------------------------------------------------


Apply = Callable[[object, Entry], None]  # (service, entry): replay one input into the service


class ReplayLog:
    """The log of one replay in `directory`. `recover` rebuilds a service from it, `append` + `commit` make a
    round's inputs durable, `compact` starts a new segment from a snapshot."""

    def __init__(self, directory: Path, fsync: bool = True, compact_every: int = 20_000) -> None:
        self.directory = Path(directory)
        self.fsync = fsync
        self.compact_every = compact_every
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock = open(self.directory / "lock", "a+b")  # noqa: SIM115 - held until close()
        except OSError as exc:
            raise WalError(f"replay.durable: cannot keep the replay's log in {self.directory}: {exc.strerror} (set "
                           "run.dir to a writable directory, or replay.durable=false)") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise WalError(f"{self.directory}: another replay process is using this log (its lock is held)") from None
        self.segment = 0  # the number of the segment being written
        self.entries = 0  # entries in it
        self.dropped_bytes = 0  # of a torn tail found by `recover`
        self._file = None
        self._pending: list[bytes] = []

    # --- recovery ---

    def _numbers(self, pattern: re.Pattern) -> list[int]:
        return sorted(int(m.group(1)) for p in self.directory.iterdir() if (m := pattern.fullmatch(p.name)))

    def recover(self, service, apply: Apply) -> float:  # noqa: ANN001 - replay.service.ReplayService
        """Rebuild `service` (fresh, same config) from the newest snapshot and its segment; return the service
        clock of the last input (0.0 for an empty log)."""
        snapshots = self._numbers(SNAPSHOT)
        if not snapshots:
            if self._numbers(SEGMENT):
                raise WalError(f"{self.directory}: log segments without a snapshot; move them away to start afresh")
            return 0.0
        self.segment = snapshots[-1]
        path = self.directory / f"snapshot-{self.segment:08d}.msgpack"
        data = path.read_bytes()
        payloads, end = read_frames(data)
        if len(payloads) != 1 or end != len(data):
            raise WalError(f"{path}: corrupt snapshot (checksum or length); it was written atomically, so the disk "
                           "changed it")
        try:
            state = _state_decoder.decode(payloads[0])
        except msgspec.MsgspecError as exc:
            raise WalError(f"{path}: not a replay snapshot of format {FORMAT}: {exc}") from None
        if state.format != FORMAT:
            raise WalError(f"{path}: snapshot format {state.format}, this build reads {FORMAT}")
        restore(service, state)
        now, count = state.now, 0
        for entry in self._entries(self.directory / f"wal-{self.segment:08d}.log"):
            apply(service, entry)
            now, count = entry.now, count + 1
        log.info("rebuilt the replay from %s and %d log entries (epoch %d)", path.name, count, service.epoch)
        return now

    def _entries(self, path: Path) -> Iterator[Entry]:
        if not path.exists():
            return
        data = path.read_bytes()
        payloads, end = read_frames(data)
        if end != len(data):
            self.dropped_bytes = len(data) - end
            log.warning("%s: dropped a torn or corrupt tail of %d bytes at offset %d (never acknowledged)",
                        path, self.dropped_bytes, end)
        for offset, payload in enumerate(payloads):
            try:
                yield _entry_decoder.decode(payload)
            except msgspec.MsgspecError as exc:
                raise WalError(f"{path}: entry {offset} has a valid checksum but does not decode: {exc}") from None

    # --- writing ---

    def append(self, entry: Entry) -> None:
        """Queue an entry for the next `commit` (nothing is on disk before it)."""
        self._pending.append(frame(_entry_encoder.encode(entry)))

    def commit(self) -> bool:
        """Write the queued entries and fsync (replay.fsync) once; True if there were any."""
        if not self._pending:
            return False
        assert self._file is not None, "compact() first: it opens the segment"
        self._file.write(b"".join(self._pending))
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())
        self.entries += len(self._pending)
        self._pending.clear()
        return True

    def due(self) -> bool:
        return self.entries >= self.compact_every

    def compact(self, service, now: float) -> None:  # noqa: ANN001 - replay.service.ReplayService
        """Snapshot the live state (every queued entry committed) as N+1, start segment N+1, delete the older."""
        assert not self._pending, "commit() first: the snapshot must follow every logged input"
        number = self.segment + 1
        snapshot = self.directory / f"snapshot-{number:08d}.msgpack"
        temporary = snapshot.with_suffix(".tmp")
        with open(temporary, "wb") as f:
            f.write(frame(_state_encoder.encode(capture(service, now))))
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        os.replace(temporary, snapshot)
        if self._file is not None:
            self._file.close()
        self._file = open(self.directory / f"wal-{number:08d}.log", "wb")  # noqa: SIM115 - closed in close()
        self._sync_directory()
        self.segment, self.entries = number, 0
        for pattern, name in ((SEGMENT, "wal-{:08d}.log"), (SNAPSHOT, "snapshot-{:08d}.msgpack")):
            for old in self._numbers(pattern):
                if old < number:
                    (self.directory / name.format(old)).unlink(missing_ok=True)
        for leftover in self.directory.glob("*.tmp"):  # a snapshot a crash interrupted before its rename
            leftover.unlink(missing_ok=True)

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.directory.iterdir() if p.name != "lock")

    def _sync_directory(self) -> None:
        if self.fsync:
            fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def close(self) -> None:
        if self._file is not None:
            try:
                self.commit()  # entries whose replies were never sent: nothing is lost without them
            except OSError as exc:
                log.error("could not write the last %d log entries: %s", len(self._pending), exc)
            self._file.close()
            self._file = None
        self._lock.close()  # releases the flock
