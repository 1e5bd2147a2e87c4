"""Files that survive a crash of the node: fsync a file or a directory, and write a small file atomically (a
temporary, fsynced, renamed, its directory fsynced), so that a reader finds the old content or the new, never half."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory: so that a rename in it survives a power cut)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, text: str, durable: bool = True) -> None:
    """`path` holds `text` or what it held before, even across a crash of the machine (`durable`: fsynced) or of
    the process (`durable=False`: renamed into place, not fsynced). OSError when the disk refuses (the temporary,
    `<name>.tmp`, is removed)."""
    staging = path.with_name(path.name + ".tmp")
    try:
        with open(staging, "w") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(staging, path)
    except OSError:
        staging.unlink(missing_ok=True)
        raise
    if durable:
        fsync_path(path.parent)
