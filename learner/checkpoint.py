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
import shutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from async_rl.durable import write_atomically
from async_rl.errors import AsyncRLError

log = logging.getLogger("async_rl.learner")

MANIFEST = "manifest.json"
LATEST = "latest"
TAG = re.compile(r"v(\d+)")
WRITTEN = re.compile(r"v(\d+)(?:\.corrupt)?")  # a checkpoint directory, or one set aside
SET_ASIDE = re.compile(r"v(\d+)\.corrupt")
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


@dataclass
class Resume:
    """What a resume loads, and the version it goes on at (`resumable`)."""

    version: int  # the checkpoint to load
    at: int  # `version`, or the newest checkpoint written when that one failed its check (see `resumable`)
    skipped: list[Path]  # checkpoint directories that failed it: `set_aside` once the load is done


def resumable(directory: Path) -> Resume | None:
    """The checkpoint in `directory` to resume from: the one `latest` names if it matches its manifest, else the
    newest other one that does (a warning names each one skipped and why). None: a fresh start (no `latest`, and no
    checkpoint that passes). CheckpointError when `latest` exists but no checkpoint passes.

    A resume from an older checkpoint than the newest one written goes on at the newest one's version N: the replay
    may have been told of N, and can roll back only to it (docs/architecture.md, "Resume after a crash"). The
    weights, optimizer and RNG are the older checkpoint's: the updates of the versions between are lost, and their
    items stay trained once (nothing is trained twice, versions stay continuous)."""
    tags = versions(directory)
    exists, named = latest(directory)
    if not exists and not tags:
        return None
    written = versions(directory, WRITTEN, lambda p: (p / MANIFEST).exists())  # manifests: each was complete once
    order = sorted({v for v in tags if named is None or v <= named or v in written} | ({named} - {None}),
                   reverse=True)
    reasons = [f"{directory / LATEST}: names no checkpoint (torn or changed)"] if exists and named is None else []
    skipped = []
    for version in order:
        tag = directory / f"v{version}"
        found = problem(tag) if tag.is_dir() else "missing"
        if found is None or (found == "no manifest" and version == named):  # the latter: written before manifests
            at = max([version, *written, *({named} - {None})])
            if reasons:
                log.warning("resuming from checkpoint v%d%s; skipped: %s", version, "" if at == version else (
                    f" as version {at}: the updates of versions {version + 1}..{at} are lost from the weights, "
                    "their items stay trained once"), "; ".join(reasons))
            return Resume(version, at, skipped)
        reasons.append(f"{tag}: {found}")
        skipped += [tag] if tag.is_dir() else []
    if not exists:  # none was ever complete: a save cut short before the first `latest`
        log.warning("no complete checkpoint in %s (%s): starting from v0", directory, "; ".join(reasons))
        return None
    raise CheckpointError(f"no checkpoint in {directory} can be resumed from: {'; '.join(reasons)}. Restore the "
                          "directory from a backup, or move it away to start this learner again from v0")


def versions(directory: Path, pattern: re.Pattern = TAG, keep: Callable[[Path], bool] = Path.is_dir) -> list[int]:
    """The versions of the entries of `directory` whose names match `pattern` and that `keep`, newest first."""
    if not directory.is_dir():
        return []
    return sorted((int(m[1]) for p in directory.iterdir() if (m := pattern.fullmatch(p.name)) and keep(p)),
                  reverse=True)


def set_aside(tags: list[Path]) -> None:
    """Rename checkpoint directories that failed their check to `v<N>.corrupt` (kept to look at, the newest
    `learner.keep_checkpoints` of them: `prune`; no longer counted as checkpoints, nor tried again)."""
    for tag in tags:
        target = tag.with_name(tag.name + ".corrupt")
        shutil.rmtree(target, ignore_errors=True)
        tag.rename(target)


def prune(directory: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints, and all but the newest `keep` set aside: a disk whose
    checkpoints are torn again and again does not fill up with the damaged ones (benchmarks/chaos.py's learner
    volume did)."""
    for old in versions(directory)[keep:]:  # newest first
        shutil.rmtree(directory / f"v{old}", ignore_errors=True)
    for old in versions(directory, SET_ASIDE)[keep:]:
        shutil.rmtree(directory / f"v{old}.corrupt", ignore_errors=True)
