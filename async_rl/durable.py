"""Files that survive a crash of the node: fsync a file or a directory, and write a small file atomically (a
temporary, fsynced, renamed, its directory fsynced), so that a reader finds the old content or the new, never half;
a directory's manifest (each file's size and crc32), so that a reader can tell it torn or changed."""

from __future__ import annotations

import json
import os
import zlib
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


MANIFEST = "manifest.json"  # in a directory written whole (a checkpoint, an hf-v<N>/): each file's size and crc32
CHUNK = 1 << 22


def file_crc32(path: Path, sync: bool = False) -> tuple[int, int]:
    """(size, zlib.crc32) of a file, read in chunks; `sync`: fsync it too."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
        if sync:
            os.fsync(f.fileno())
    return size, crc


def write_manifest(directory: Path, extra: dict | None = None, durable: bool = True) -> None:
    """Record the size and crc32 of every file under `directory` (but the manifest) in `directory/manifest.json`
    (`extra`: more keys beside "files"); `durable`: the files fsynced first, the manifest written atomically and
    fsynced. `manifest_problem` checks the directory against it."""
    files = {str(p.relative_to(directory)): list(file_crc32(p, sync=durable))
             for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST}
    write_atomically(directory / MANIFEST, json.dumps({**(extra or {}), "files": files}, indent=1), durable)


def manifest_problem(directory: Path) -> str | None:
    """Why `directory` does not match its manifest (a file torn, changed or gone; no manifest), or None."""
    try:
        files = json.loads((directory / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return "no manifest"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its manifest cannot be read ({exc})"
    for name, (size, crc) in sorted(files.items()):
        try:
            actual = file_crc32(directory / name)
        except OSError as exc:
            return f"{name}: {exc.strerror or exc}"
        if actual[0] != size:
            return f"{name} has {actual[0]} bytes, its manifest {size} (torn)"
        if actual[1] != crc:
            return f"{name} does not match its checksum (changed after it was written)"
    return None
