"""A disk that fills, for the tests of a full disk: `fill` writes until ENOSPC (the `small_disk` fixture in
conftest.py mounts the small tmpfs it fills)."""

import errno
from pathlib import Path


def fill(disk: Path) -> Path:
    """Write a file until the disk is full; returns it (unlink it to free the space)."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        for chunk in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    return filler
