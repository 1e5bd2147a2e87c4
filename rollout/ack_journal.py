"""A rollout worker's journal of what it sent and what the replay acknowledged: evidence from outside the replay.

Two kinds of JSON line in `<run_dir>/acks/<worker_id>.jsonl`, appended across the worker's restarts:

    {"m": msg_id, "k": "stage", "g": group_id, "t": trajectory_id, "i": member, "s": stage_index,
     "o": observation token count, "a": action token count, "h": token hash}      (written before it is first sent)
    {"m": msg_id, "k": "outcome", "g": ..., "t": ..., "i": member, "n": num_stages, "x": abandoned}   (likewise)
    {"m": msg_id, "k": "ack"}                                 (the replay acknowledged it: its first ack, once)

A message is journalled as sent before its first send (a resend is not journalled again) and as acked when its
first ack is handled. Both matter: the replay may store a record, serve it and have it trained before its ack
reaches a worker that is then killed (a record sent, trained, never acked); and only an acked record is one the
replay promised to keep. `h` is `token_hash(action_tokens)` (async_rl/evidence.py): the learner's trained-item log
(`learner.log_item_ids`) hashes the trained span of each item the same way, so benchmarks/chaos_check.py can join
the two without the replay's word.

Durability: each line is written with one unbuffered `write` before the worker acts on it (sends the message, or
drops it from its resend list), so it is in the kernel's page cache and survives a kill of the worker (SIGKILL,
OOM) at any point after; it is fsynced at most every `FSYNC_EVERY_S` and on close, so a crash of the node (power,
kernel) can lose at most the last `FSYNC_EVERY_S` of lines. A kill mid-write can leave a partial last line: a
restart cuts it off before appending (the checker counts unreadable lines). A disk that refuses a line (ENOSPC) is
counted in `dropped`, not raised: the journal is evidence, not part of delivery.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import msgspec

from async_rl.evidence import token_hash
from async_rl.protocol import Outcome, StageRecord

log = logging.getLogger("async_rl.rollout")

FSYNC_EVERY_S = 1.0
_encode = msgspec.json.Encoder().encode  # compact JSON, as json.dumps(separators=(",", ":")), at a fraction of its CPU


def journal_path(run_dir: Path, worker_id: str) -> Path:
    return run_dir / "acks" / f"{worker_id}.jsonl"


def entry(message: StageRecord | Outcome) -> dict | None:
    """The journal line of an acked message (None for what the join does not need: an EvalReport)."""
    if isinstance(message, StageRecord):
        return {"m": message.msg_id, "k": "stage", "g": message.group_id, "t": message.trajectory_id,
                "i": message.member, "s": message.stage_index, "o": len(message.observation_tokens) // 4,
                "a": len(message.action_tokens) // 4, "h": token_hash(message.action_tokens)}
    if isinstance(message, Outcome):
        return {"m": message.msg_id, "k": "outcome", "g": message.group_id, "t": message.trajectory_id,
                "i": message.member, "n": message.num_stages, "x": message.abandoned}
    return None


def _cut_partial_line(path: Path) -> int:
    """Cut a last line with no newline (a kill mid-write); returns the bytes cut."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
        os.truncate(path, keep)
    return len(data) - keep


class AckJournal:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.cut = _cut_partial_line(path)
        if self.cut:
            log.warning("%s: cut a partial last line of %d bytes (a kill mid-write)", path, self.cut)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._synced_at = time.monotonic()
        self._dirty = False
        self.written = 0
        self.dropped = 0

    def sent(self, message: StageRecord | Outcome) -> None:
        """`message` is about to be sent for the first time."""
        line = entry(message)
        if line is not None:
            self._write(_encode(line) + b"\n")

    def acked(self, *messages: StageRecord | Outcome) -> None:
        """The replay acknowledged `messages` (their first acks), one line each in one write: the bytes json.dumps
        writes for {"m": id, "k": "ack"}, without building the message's own line (its token hash) to learn that it
        has one (4 lines a trajectory: the journal was an eighth of a worker's CPU on a one-token task)."""
        lines = [b'{"m":%d,"k":"ack"}\n' % m.msg_id for m in messages if isinstance(m, StageRecord | Outcome)]
        if lines:
            self._write(b"".join(lines), len(lines))

    def _write(self, data: bytes, lines: int = 1) -> None:
        if self._fd < 0:
            return
        try:
            written = os.write(self._fd, data)
            if written < len(data):  # a disk that took part of the line: cut it, so the next one starts whole
                os.ftruncate(self._fd, os.fstat(self._fd).st_size - written)
                raise OSError(f"short write ({written} of {len(data)} bytes)")
            self.written += lines
            self._dirty = True
            if time.monotonic() - self._synced_at >= FSYNC_EVERY_S:
                self.sync()
        except OSError as exc:
            before, self.dropped = self.dropped, self.dropped + lines
            if before == 0 or before // 1000 != self.dropped // 1000:
                log.warning("ack journal %s: %d line(s) dropped (%s)", self.path, self.dropped, exc)

    def sync(self) -> None:
        if self._dirty and self._fd >= 0:
            try:
                os.fsync(self._fd)
            except OSError as exc:
                log.warning("ack journal %s: fsync failed (%s)", self.path, exc)
            self._dirty = False
        self._synced_at = time.monotonic()

    def close(self) -> None:
        if self._fd >= 0:
            self.sync()
            os.close(self._fd)
            self._fd = -1


def read_journal(path: Path) -> tuple[list[dict], int]:
    """(the journal's lines, how many lines could not be read: a partial last line)."""
    lines, bad = [], 0
    for raw in path.read_bytes().split(b"\n"):
        if not raw:
            continue
        try:
            lines.append(json.loads(raw))
        except ValueError:
            bad += 1
    return lines, bad
