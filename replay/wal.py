"""The replay's write-ahead log on disk: its entries, snapshots and segments (docs/architecture.md, "A durable
replay").

`ReplayService` is deterministic given its inputs (handle(identity, message, now), reject_frame, tick(now)), so
the log records the inputs, not the state: every message the service handled (with its `now`), every frame it
could not decode, and every tick that changed something. Replaying them into the state of the last snapshot
rebuilds groups, ledgers, queues, leases and counters exactly. The socket loop (`replay.server.run`) appends
the inputs of one poll round, writes and fsyncs them once (`commit`), and only then sends that round's replies:
nothing acknowledged can be lost; what a crash loses is a round whose replies were never sent, which the workers
and the learner send again.

On disk, in `<run dir>/replay/`:
  snapshot-N.msgpack  the whole service state when segment N began (`Snapshot`: the format, the clock and
                      replay/state.py's ReplayState as msgspec MessagePack, one framed entry)
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from async_rl.errors import AsyncRLError, ConfigError
from replay.state import ReplayState, decoder, encoder
from replay.state import comparable as comparable_state

log = logging.getLogger("async_rl.replay.wal")

# Of the snapshot (and the log's messages): bump when the state's layout or the protocol changes. 1: the replay
# before its split by job; 2: replay/state.py's ReplayState, protocol without TrainItem.first_trained.
FORMAT = 2
HEADER = struct.Struct("<II")  # payload length, zlib.crc32(payload)
SEGMENT = re.compile(r"wal-(\d{8})\.log")
SNAPSHOT = re.compile(r"snapshot-(\d{8})\.msgpack")


class WalError(AsyncRLError):
    """The log cannot be used: corrupt beyond a torn tail, from another format, or held by another replay."""


class LogFormatError(WalError, ConfigError):
    """The log is of another format: a restart would meet it again (a ConfigError: `async-rl train` does not restart
    the replay, and reports it by name)."""


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


class Snapshot(msgspec.Struct):
    """The service's whole state (replay/state.py) when a segment began. `now`: the service clock then."""

    format: int
    now: float
    state: ReplayState


class _Format(msgspec.Struct):
    """A snapshot's format alone, read before the rest (a snapshot of another format does not decode as ours)."""

    format: int


_snapshot_decoder = decoder(Snapshot)
_format_decoder = msgspec.msgpack.Decoder(_Format)
_entry_encoder = msgspec.msgpack.Encoder()
_entry_decoder = msgspec.msgpack.Decoder(Entry)


def format_problem(path: Path, written: int) -> str | None:
    """Why a snapshot of format `written` cannot be read by this build, or None."""
    if written == FORMAT:
        return None
    before = " (written before the replay was split by job)" if written < FORMAT else ""
    return (f"{path}: replay log format {written}{before}; this build reads format {FORMAT} only: "
            "resume it with the async-rl version that wrote it, or move its replay/ directory away to start the "
            "replay afresh")


def check_format(directory: Path) -> None:
    """Raise LogFormatError when the newest snapshot in `directory` is of a format this build does not read (a
    cheap look before a resume starts anything; `ReplayLog.recover` names any other problem)."""
    numbers = sorted(int(m.group(1)) for p in directory.iterdir() if (m := SNAPSHOT.fullmatch(p.name))) if (
        directory.is_dir()) else []
    if not numbers:
        return
    path = directory / f"snapshot-{numbers[-1]:08d}.msgpack"
    payloads, _ = read_frames(path.read_bytes())
    try:
        written = _format_decoder.decode(payloads[0]).format if payloads else FORMAT
    except msgspec.MsgspecError:
        return
    problem = format_problem(path, written)
    if problem is not None:
        raise LogFormatError(problem)


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


Apply = Callable[[Any, Entry], None]  # (service, entry): replay one input into the service


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

    def recover(self, service: Any, apply: Apply) -> float:
        """Rebuild `service` (a replay.service.ReplayService, fresh, same config) from the newest snapshot (its
        `restore` takes the state) and its segment (`apply` replays each input into it); return the service clock
        of the last input (0.0 for an empty log)."""
        snapshots = self._numbers(SNAPSHOT)
        if not snapshots:
            if self._numbers(SEGMENT):
                raise WalError(f"{self.directory}: log segments without a snapshot; move them away to start afresh")
            return 0.0
        state, now = self._snapshot()
        service.restore(state)
        count = 0
        for entry in self._entries(self.directory / f"wal-{self.segment:08d}.log"):
            apply(service, entry)
            now, count = entry.now, count + 1
        log.info("rebuilt the replay from snapshot %d and %d log entries (epoch %d)", self.segment, count, state.epoch)
        return now

    def _snapshot(self) -> tuple[ReplayState, float]:
        """The newest snapshot's state and clock."""
        snapshots = self._numbers(SNAPSHOT)
        self.segment = snapshots[-1]
        path = self.directory / f"snapshot-{self.segment:08d}.msgpack"
        data = path.read_bytes()
        payloads, end = read_frames(data)
        if len(payloads) != 1 or end != len(data):
            raise WalError(f"{path}: corrupt snapshot (checksum or length); it was written atomically, so the disk "
                           "changed it")
        try:
            problem = format_problem(path, _format_decoder.decode(payloads[0]).format)
            if problem is not None:
                raise LogFormatError(problem)
            snapshot = _snapshot_decoder.decode(payloads[0])
        except msgspec.MsgspecError as exc:
            raise WalError(f"{path}: not a replay snapshot of format {FORMAT}: {exc}") from None
        return snapshot.state, snapshot.now

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

    def compact(self, service: Any, now: float) -> None:
        """Snapshot the live state (`service.state`, every queued entry committed) as N+1, start segment N+1, delete
        the older."""
        assert not self._pending, "commit() first: the snapshot must follow every logged input"
        number = self.segment + 1
        snapshot = self.directory / f"snapshot-{number:08d}.msgpack"
        temporary = snapshot.with_suffix(".tmp")
        with open(temporary, "wb") as f:
            f.write(frame(encoder.encode(Snapshot(FORMAT, now, service.state))))
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


def comparable(service: Any) -> ReplayState:
    """A copy of the service's state that compares by value (dicts and sets unordered): tests compare two."""
    return comparable_state(service.state)
