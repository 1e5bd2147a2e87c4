"""A learner checkpoint's files on disk: its manifest, the `latest` pointer, and the choice of the one to resume from
(docs/architecture.md, "Resume after a crash").

DeepSpeed writes a checkpoint's files into `<dir>/v<N>/` (learner/engine.py `save_checkpoint`, with DeepSpeed's own
`latest` turned off: it is written in place, not atomically). Then rank 0 reads every file back, fsyncs it and
records its size and crc32 in `v<N>/manifest.json`, and only then points `latest` at `v<N>` (a temporary, fsynced,
renamed). A node crash, a bad disk or a full one can leave a checkpoint torn or changed: `resumable` checks the one
`latest` names against its manifest, and when it fails (or `latest` itself is torn) falls back to the newest older
one that passes, with a warning naming each one skipped, and the learner goes on at THAT checkpoint's version. A
checkpoint with no manifest is trusted only when `latest` names it and none in the directory has one (a directory
written before manifests existed). A resume that fell back points `latest` at the one it resumed from.

So that the replay can roll back to any checkpoint a resume may fall back to, the learner reports as durable not its
newest checkpoint but the oldest one it keeps (`rollback_point`): the acks at or below it are final, the ones above
it stay undoable (replay/rollback.py).
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from async_rl.durable import MANIFEST, manifest_problem, write_atomically, write_manifest
from async_rl.errors import AsyncRLError

log = logging.getLogger("async_rl.learner")

LATEST = "latest"
TAG = re.compile(r"v(\d+)")
WRITTEN = re.compile(r"v(\d+)(?:\.corrupt)?")  # a checkpoint directory, or one set aside
SET_ASIDE = re.compile(r"v(\d+)\.corrupt")


class CheckpointError(AsyncRLError):
    """A checkpoint that exists but cannot be resumed from."""


def commit(directory: Path, version: int) -> None:
    """Checkpoint v`version`'s files are all written (every rank's): fsync them, record them in its manifest, then
    point `latest` at it. OSError when the disk refuses (`latest` then still names the one before)."""
    write_manifest(directory / f"v{version}", {"version": version})
    write_atomically(directory / LATEST, f"v{version}")


def point_latest(directory: Path, version: int) -> None:
    """Point `latest` at checkpoint v`version` (a resume that fell back past damaged ones: `latest` must never name
    a checkpoint that was set aside, or a later save under its name would be kept and trusted)."""
    write_atomically(directory / LATEST, f"v{version}")


def problem(tag: Path) -> str | None:
    """Why checkpoint directory `tag` does not match its manifest (None: it does)."""
    return manifest_problem(tag)


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
    """What a resume loads, and what it skipped (`resumable`)."""

    version: int  # the checkpoint to load, and the version the learner goes on at
    skipped: list[Path]  # checkpoint directories that failed their check: `set_aside` once the load is done
    damage: str = ""  # each checkpoint (or `latest`) skipped and why ("": none)


def resumable(directory: Path) -> Resume | None:
    """The checkpoint in `directory` to resume from: the one `latest` names if it matches its manifest, else the
    newest other one that does (a warning names each one skipped and why). None: a fresh start (no `latest`, and no
    checkpoint that passes). CheckpointError when `latest` exists but no checkpoint passes.

    A resume from an older checkpoint than the newest one written goes on at the older one's version: its weights,
    optimizer and RNG, and its version numbering, so the versions after it are trained again. The replay rolls back
    to it: the learner reported it (or an older one) as its rollback point (`rollback_point`); a replay that cannot
    roll back that far refuses the resume (`bad_resume`), and the learner stops naming `damage`."""
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
        # A checkpoint without a manifest is trusted only as one written before manifests existed: `latest` names it
        # and no checkpoint of the directory has a manifest (else it is a save cut short, e.g. by a full disk).
        if found is None or (found == "no manifest" and version == named and not written):
            newest = max([version, *written, *({named} - {None})])
            # a restart after an earlier resume set them aside still names them (the replay may refuse it too)
            earlier = [f"{directory / f'v{v}.corrupt'}: set aside as damaged" for v in versions(directory, SET_ASIDE)
                       if v > version]
            damage = "; ".join(reasons + earlier)
            if reasons:
                log.warning("resuming from checkpoint v%d at version %d%s; skipped: %s", version, version,
                            "" if newest == version else f" (versions {version + 1}..{newest} are trained again)",
                            "; ".join(reasons))
            return Resume(version, skipped, damage)
        reasons.append(f"{tag}: {found}")
        skipped += [tag] if tag.is_dir() else []
    if not exists:  # none was ever complete: a save cut short before the first `latest`
        log.warning("no complete checkpoint in %s (%s): starting from v0", directory, "; ".join(reasons))
        return None
    raise CheckpointError(f"no checkpoint in {directory} can be resumed from: {'; '.join(reasons)}. Restore the "
                          "directory from a backup, or move it away to start this learner again from v0")


def rollback_point(directory: Path, version: int, keep: int) -> int:
    """The version the learner at `version` reports to the replay as its durable checkpoint: the oldest of the newest
    `keep` checkpoints at or below `version` (a resume may fall back to any of them when a newer one is damaged), or
    `version` when there is none on disk (a checkpoint whose directory is gone cannot be fallen back to either)."""
    below = [v for v in versions(directory) if v <= version][:max(keep, 1)]  # as `prune` keeps them
    kept = [v for v in below if (directory / f"v{v}" / MANIFEST).exists()]  # each complete once
    return kept[-1] if kept else version


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
