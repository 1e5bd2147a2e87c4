"""The replay's write-ahead log on disk: its files, their recovery, writing and compaction (docs/architecture.md, "A
durable replay"; the entries, the snapshot and their framing as bytes: replay/log_format.py).

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
A frame is <u32 length><u32 zlib.crc32> then the msgpack payload. A torn or corrupt frame ends the last segment: it
and anything after it are dropped with a warning (a crash mid-write; it was never fsynced, so never acknowledged).
Compaction: every start, and every `replay.compact_every` entries, the live state is written as snapshot N+1
(write, fsync, rename), segment N+1 is started and everything older than N is deleted: the log is bounded by twice
the live state plus compact_every entries. Snapshot N and segment N stay so that a snapshot N+1 the disk corrupted
is not fatal: recovery falls back to snapshot N and replays segments N and N+1 (the start of an epoch is an entry,
`Started`, so N + segment N is exactly N+1).
A write the disk refuses (ENOSPC, EIO) raises `WalWriteError` naming the file and the errno, and counts for
nothing: the segment is cut back to its last durable byte and the entries stay queued for the next `commit`; a
snapshot that could not be written is removed and the log goes on in its segment (replay/server.py holds the
replay until the disk takes the log again).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from async_rl.durable import fsync_path
from replay.log_format import (
    FORMAT,
    SEGMENT,
    SNAPSHOT,
    CorruptSnapshot,
    Entry,
    LogFormatError,
    Snapshot,
    WalError,
    entry_decoder,
    entry_encoder,
    format_decoder,
    format_problem,
    frame,
    read_frames,
    snapshot_decoder,
)
from replay.state import ReplayState, encoder
from replay.state import comparable as comparable_state

log = logging.getLogger("async_rl.replay.wal")


class WalWriteError(WalError):
    """The disk refused a write of the log (ENOSPC, EIO, ...). `path`: the file; `errno`: the error's number."""

    def __init__(self, path: Path, exc: OSError, doing: str) -> None:
        self.path, self.errno = path, exc.errno
        name = errno.errorcode.get(exc.errno or 0, "an OS error")
        super().__init__(f"{path}: could not {doing}: {name} ({exc.strerror or exc})")


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
        self._fd: int | None = None  # the segment being written (None: no snapshot yet)
        self._end = 0  # its durable length: a failed write is cut back to it, the next one starts there
        self._pending: list[bytes] = []
        self._directory_dirty = False  # a rename not yet fsynced: the next commit syncs it before acking
        self._compact_after = 0  # after a failed compaction: the entry count of the next try

    def _path(self, pattern: re.Pattern, number: int) -> Path:
        name = "wal-{:08d}.log" if pattern is SEGMENT else "snapshot-{:08d}.msgpack"
        return self.directory / name.format(number)

    # --- recovery ---

    def _numbers(self, pattern: re.Pattern) -> list[int]:
        return sorted(int(m.group(1)) for p in self.directory.iterdir() if (m := pattern.fullmatch(p.name)))

    def recover(self, service: Any, apply: Apply) -> float:
        """Rebuild `service` (a replay.service.ReplayService, fresh, same config) from the newest snapshot (its
        `restore` takes the state) and the segments from its own on (`apply` replays each input into it); return
        the service clock of the last input (0.0 for an empty log). A corrupt newest snapshot is set aside (renamed
        `.corrupt`) and the one before it is used. The last segment is then open for appending."""
        snapshots = self._numbers(SNAPSHOT)
        if not snapshots:
            if self._numbers(SEGMENT):
                raise WalError(f"{self.directory}: log segments without a snapshot; move them away to start afresh")
            return 0.0
        try:
            first = snapshots[-1]
            state, now = self._snapshot(first)
        except CorruptSnapshot as exc:
            first, state, now = self._fall_back(snapshots, exc)
        service.restore(state)
        segments = [n for n in self._numbers(SEGMENT) if n >= first] or [first]
        if segments != list(range(first, segments[-1] + 1)):
            raise WalError(f"{self.directory}: log segments {segments} do not follow snapshot {first} without a gap; "
                           "the log is incomplete (restore the directory from a backup, or move it away to start "
                           "the replay afresh: what it acknowledged is then lost)")
        count = 0
        for number in segments:
            for entry in self._entries(number, last=number == segments[-1]):
                apply(service, entry)
                now, count = entry.now, count + 1
        self.segment = segments[-1]
        self._open_segment()
        log.info("rebuilt the replay from snapshot %d and %d log entries (epoch %d)", first, count, service.epoch)
        return now

    def _fall_back(self, snapshots: list[int], corrupt: CorruptSnapshot) -> tuple[int, ReplayState, float]:
        """When the newest snapshot is corrupt: the one before it, its state and clock (its segment must then be
        whole: the newest snapshot was written only after it was). The corrupt one is renamed `.corrupt`."""
        advice = (f"restore {self.directory} from a backup, or move it away to start the replay afresh (what it "
                  "acknowledged is then lost)")
        if len(snapshots) < 2:
            raise WalError(f"{corrupt}; there is no older snapshot to fall back to: {advice}")
        newest, previous = snapshots[-1], snapshots[-2]
        try:
            state, now = self._snapshot(previous)
        except CorruptSnapshot as again:
            raise WalError(f"{corrupt}; the snapshot before it is corrupt too ({again}): {advice}") from None
        path = self._path(SNAPSHOT, newest)
        path.rename(path.with_name(path.name + ".corrupt"))
        log.warning("%s; set aside as %s.corrupt: falling back to snapshot %d and the segments after it", corrupt,
                    path.name, previous)
        return previous, state, now

    def _snapshot(self, number: int) -> tuple[ReplayState, float]:
        """Snapshot `number`'s state and clock."""
        path = self._path(SNAPSHOT, number)
        data = path.read_bytes()
        payloads, end = read_frames(data)
        if len(payloads) != 1 or end != len(data):
            raise CorruptSnapshot(f"{path}: corrupt snapshot (checksum or length); it was written atomically, so the "
                                  "disk changed it")
        try:
            problem = format_problem(path, format_decoder.decode(payloads[0]).format)
            if problem is not None:
                raise LogFormatError(problem)
            snapshot = snapshot_decoder.decode(payloads[0])
        except msgspec.MsgspecError as exc:
            raise WalError(f"{path}: not a replay snapshot of format {FORMAT}: {exc}") from None
        return snapshot.state, snapshot.now

    def _entries(self, number: int, last: bool) -> list[Entry]:
        """Segment `number`'s entries. A torn or corrupt tail is dropped from the last segment (and `_end` set
        where it began); in an earlier one it is fatal: what follows it was acknowledged."""
        path = self._path(SEGMENT, number)
        data = path.read_bytes() if path.exists() else b""
        payloads, end = read_frames(data)
        if last:
            self._end = end
        if end != len(data) and not last:
            raise WalError(f"{path}: corrupt at offset {end} of {len(data)}, and later segments hold acknowledged "
                           "entries: the log cannot be replayed (restore the directory from a backup, or move it "
                           "away to start the replay afresh: what it acknowledged is then lost)")
        if end != len(data):
            self.dropped_bytes = len(data) - end
            log.warning("%s: dropped a torn or corrupt tail of %d bytes at offset %d (never acknowledged)",
                        path, self.dropped_bytes, end)
        entries = []
        for offset, payload in enumerate(payloads):
            try:
                entries.append(entry_decoder.decode(payload))
            except msgspec.MsgspecError as exc:
                raise WalError(f"{path}: entry {offset} has a valid checksum but does not decode: {exc}") from None
        return entries

    def _open_segment(self) -> None:
        """Open the recovered last segment for appending, its torn tail (if any) cut off."""
        path = self._path(SEGMENT, self.segment)
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            os.ftruncate(self._fd, self._end)
        except OSError as exc:
            raise WalWriteError(path, exc, "open the log's last segment") from None

    # --- writing ---

    def opened(self) -> bool:
        """Whether a segment takes entries (False before the first snapshot of a fresh log)."""
        return self._fd is not None

    def append(self, entry: Entry) -> None:
        """Queue an entry for the next `commit` (nothing is on disk before it)."""
        self._pending.append(frame(entry_encoder.encode(entry)))

    def commit(self) -> bool:
        """Write the queued entries and fsync (replay.fsync) once; True if there were any. WalWriteError when the
        disk refuses: nothing of the write is kept and the entries stay queued."""
        if not self._pending:
            return False
        assert self._fd is not None, "compact() first: it opens the segment"
        data = b"".join(self._pending)
        try:
            if self._directory_dirty:
                self._sync_directory()
                self._directory_dirty = False
            _write_at(self._fd, data, self._end)
            if self.fsync:
                os.fsync(self._fd)
        except OSError as exc:
            self._cut_back()
            raise WalWriteError(self._path(SEGMENT, self.segment), exc, f"write {len(self._pending)} entries "
                                f"({len(data)} bytes) to the replay's log") from None
        self._end += len(data)
        self.entries += len(self._pending)
        self._pending.clear()
        return True

    def _cut_back(self) -> None:
        """After a failed write: the segment back to its durable length (a shrink needs no space)."""
        if self._fd is None:  # closed: nothing to cut back
            return
        try:
            os.ftruncate(self._fd, self._end)
        except OSError as exc:  # the next write starts at _end all the same; recovery drops what follows it
            log.warning("%s: could not cut a failed write back: %s", self._path(SEGMENT, self.segment), exc)

    def due(self) -> bool:
        return self.entries >= max(self.compact_every, self._compact_after)

    def compact(self, service: Any, now: float) -> None:
        """Snapshot the live state (`service.state`, every queued entry committed) as N+1, start segment N+1,
        delete what is older than N. WalWriteError when the disk refuses: the new files are removed, the log goes
        on in segment N, and `due` waits another compact_every / 4 entries before the next try."""
        assert not self._pending, "commit() first: the snapshot must follow every logged input"
        number = self.segment + 1
        snapshot, segment = self._path(SNAPSHOT, number), self._path(SEGMENT, number)
        temporary, fd = snapshot.with_suffix(".tmp"), None
        try:
            self._write_file(temporary, frame(encoder.encode(Snapshot(FORMAT, now, service.state))))
            fd = os.open(segment, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # before the rename: see recover
            os.replace(temporary, snapshot)
        except OSError as exc:
            if fd is not None:
                os.close(fd)
                segment.unlink(missing_ok=True)
            temporary.unlink(missing_ok=True)
            self._compact_after = self.entries + max(1, self.compact_every // 4)
            raise WalWriteError(snapshot, exc, "write a snapshot of the replay") from None
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._end, self.segment, self.entries, self._compact_after = fd, 0, number, 0, 0
        self._directory_dirty = True
        try:
            self._sync_directory()
            self._directory_dirty = False
        except OSError as exc:  # the next commit syncs it before anything more is acknowledged
            log.warning("%s: could not fsync the directory after a snapshot: %s", self.directory, exc)
        for pattern in (SEGMENT, SNAPSHOT):
            for old in self._numbers(pattern):
                if old < number - 1:
                    self._path(pattern, old).unlink(missing_ok=True)
        for leftover in self.directory.glob("*.tmp"):  # a snapshot a crash interrupted before its rename
            leftover.unlink(missing_ok=True)

    def _write_file(self, path: Path, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_at(fd, data, 0)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.directory.iterdir() if p.name != "lock")

    def _sync_directory(self) -> None:
        if self.fsync:
            fsync_path(self.directory)

    def close(self) -> None:
        if self._fd is not None:
            try:
                self.commit()  # entries whose replies were never sent: nothing is lost without them
            except WalWriteError as exc:
                log.error("the last %d log entries were not written (their replies were never sent): %s",
                          len(self._pending), exc)
            os.close(self._fd)
            self._fd = None
        self._lock.close()  # releases the flock


def _write_at(fd: int, data: bytes, offset: int) -> None:
    """All of `data` at `offset` (os.pwrite may write less than asked)."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if not written:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view, offset = view[written:], offset + written


def comparable(service: Any) -> ReplayState:
    """A copy of the service's state that compares by value (dicts and sets unordered): tests compare two."""
    return comparable_state(service.state)
