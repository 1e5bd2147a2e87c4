"""The replay's write-ahead log as bytes: its entries (the service's inputs), its snapshot (the service's state),
the framing of both, and the errors of reading them. replay/wal.py keeps them in files (docs/architecture.md, "A
durable replay")."""

from __future__ import annotations

import re
import struct
import zlib
from pathlib import Path

import msgspec

from async_rl.errors import AsyncRLError, ConfigError
from replay.state import ReplayState, decoder

# Of the snapshot (and the log's messages): bump when the state's layout or the protocol changes. 1: the replay
# before its split by job; 2: replay/state.py's ReplayState, protocol without TrainItem.first_trained.
FORMAT = 2
HEADER = struct.Struct("<II")  # payload length, zlib.crc32(payload)
SEGMENT = re.compile(r"wal-(\d{8})\.log")
SNAPSHOT = re.compile(r"snapshot-(\d{8})\.msgpack")

class WalError(AsyncRLError):
    """The log cannot be used: corrupt beyond a torn tail, from another format, or held by another replay."""


class CorruptSnapshot(WalError):
    """A snapshot whose checksum or length is wrong: the disk changed it after it was written."""

class LogFormatError(WalError, ConfigError):
    """The log is of another format: a restart would meet it again (a ConfigError: `async-rl train` does not restart
    the replay, and reports it by name)."""


# --- entries: the service's inputs ---------------------------------------------------------------------


class Received(msgspec.Struct, tag="in", array_like=True):
    """A message `handle` answered: the sender's routing identity, the service clock, the message as encoded, and
    the identity its CURVE key authenticated (`learner`, `rollout-3`; `rollout` in a log of the shared-key layout;
    None without CURVE): the rebuild must refuse what the live replay did."""

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


class Started(msgspec.Struct, tag="start", array_like=True):
    """A start of the replay (`start_epoch`): its epoch is state, and logging it makes the snapshot of the start
    equal to the snapshot before it plus its segment (the fallback from a corrupt snapshot needs that)."""

    epoch: int
    now: float


Entry = Received | Undecodable | Refused | Ticked | Started


# --- the state: a snapshot -----------------------------------------------------------------------------


class Snapshot(msgspec.Struct):
    """The service's whole state (replay/state.py) when a segment began. `now`: the service clock then."""

    format: int
    now: float
    state: ReplayState


class _Format(msgspec.Struct):
    """A snapshot's format alone, read before the rest (a snapshot of another format does not decode as ours)."""

    format: int


snapshot_decoder = decoder(Snapshot)
format_decoder = msgspec.msgpack.Decoder(_Format)
entry_encoder = msgspec.msgpack.Encoder()
entry_decoder = msgspec.msgpack.Decoder(Entry)


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
        written = format_decoder.decode(payloads[0]).format if payloads else FORMAT
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
