"""A learner checkpoint's files on disk: its manifest, the `latest` pointer, and the choice of the one to resume from
(docs/architecture.md, "Resume after a crash").

DeepSpeed writes a checkpoint's files into `<dir>/v<N>/` (learner/engine.py `save_checkpoint`, with DeepSpeed's own
`latest` turned off: it is written in place, not atomically). Then rank 0 reads every file back, fsyncs it and
records its size and crc32 in `v<N>/manifest.json`, and only then points `latest` at `v<N>` (a temporary, fsynced,
renamed). A node crash, a bad disk or a full one can leave a checkpoint torn or changed: `resumable` checks the one
`latest` names against its manifest, and when it fails (or `latest` itself is torn) falls back to the newest older
one that passes, with a warning naming each one skipped. A checkpoint with no manifest is trusted only when
`latest` names it (one written before manifests existed).
"""

from __future__ import annotations

import json
import logging
import os
import re
import zlib
from pathlib import Path

from async_rl.errors import AsyncRLError

log = logging.getLogger("async_rl.learner")

MANIFEST = "manifest.json"
LATEST = "latest"
TAG = re.compile(r"v(\d+)")
CHUNK = 1 << 22


class CheckpointError(AsyncRLError):
    """A checkpoint that exists but cannot be resumed from."""


def _crc32(path: Path, sync: bool) -> tuple[int, int]:
    """(size, zlib.crc32) of a file, read in chunks; `sync`: fsync it too."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
        if sync:
            os.fsync(f.fileno())
    return size, crc


def write_atomically(path: Path, text: str) -> None:
    """`path` holds `text` or what it held before, even across a crash: a temporary, fsynced, renamed, the directory
    fsynced. OSError when the disk refuses (the temporary is removed)."""
    staging = path.with_name(path.name + ".tmp")
    try:
        with open(staging, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(staging, path)
    except OSError:
        staging.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(directory: Path, version: int) -> None:
    """Checkpoint v`version`'s files are all written (every rank's): fsync them, record them in its manifest, then
    point `latest` at it. OSError when the disk refuses (`latest` then still names the one before)."""
    tag = directory / f"v{version}"
    files = {str(p.relative_to(tag)): list(_crc32(p, sync=True))
             for p in sorted(tag.rglob("*")) if p.is_file() and p.name != MANIFEST}
    write_atomically(tag / MANIFEST, json.dumps({"version": version, "files": files}, indent=1))
    write_atomically(directory / LATEST, f"v{version}")


def problem(tag: Path) -> str | None:
    """Why checkpoint directory `tag` does not match its manifest (None: it does)."""
    try:
        files = json.loads((tag / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return "no manifest"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its manifest cannot be read ({exc})"
    for name, (size, crc) in sorted(files.items()):
        path = tag / name
        try:
            actual = _crc32(path, sync=False)
        except OSError as exc:
            return f"{name}: {exc.strerror or exc}"
        if actual[0] != size:
            return f"{name} has {actual[0]} bytes, its manifest {size} (torn)"
        if actual[1] != crc:
            return f"{name} does not match its checksum (changed after it was written)"
    return None


def latest(directory: Path) -> tuple[bool, int | None]:
    """(whether `latest` exists, the version it names when it names one that reads)."""
    try:
        text = (directory / LATEST).read_text().strip()
    except FileNotFoundError:
        return False, None
    except OSError:
        return True, None
    return True, (int(match[1]) if (match := TAG.fullmatch(text)) else None)


def resumable(directory: Path) -> int | None:
    """The version of the checkpoint in `directory` to resume from: the one `latest` names if it matches its
    manifest, else the newest older one that does (a warning names each one skipped). None: a fresh start (no
    `latest`, and no checkpoint that passes). CheckpointError when `latest` exists but no checkpoint passes."""
    tags = sorted((int(m[1]) for p in directory.iterdir() if p.is_dir() and (m := TAG.fullmatch(p.name))),
                  reverse=True) if directory.is_dir() else []
    exists, named = latest(directory)
    if not exists and not tags:
        return None
    order = [named, *(v for v in tags if v < named)] if named is not None else tags
    skipped = [f"{directory / LATEST}: names no checkpoint (torn or changed)"] if exists and named is None else []
    for version in order:
        tag = directory / f"v{version}"
        found = problem(tag) if tag.is_dir() else "missing"
        if found is None or (found == "no manifest" and version == named):  # the latter: written before manifests
            if skipped:
                log.warning("resuming from checkpoint v%d; skipped: %s", version, "; ".join(skipped))
            return version
        skipped.append(f"{tag}: {found}")
    if not exists:  # none was ever complete: a save cut short before the first `latest`
        log.warning("no complete checkpoint in %s (%s): starting from v0", directory, "; ".join(skipped))
        return None
    raise CheckpointError(f"no checkpoint in {directory} can be resumed from: {'; '.join(skipped)}. Restore the "
                          "directory from a backup, or move it away to start this learner again from v0")
