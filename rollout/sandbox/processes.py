"""The host side of an execution's processes: its working directory, and every process of a sandbox uid found and
killed (in /proc), so that nothing an execution started outlives it (rollout/sandbox/parent.py uses these)."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time


def make_workdir(uid: int | None) -> tuple[str, str]:
    """A fresh temporary directory and the working directory inside it (owned by the slot uid, when one)."""
    base = tempfile.mkdtemp(prefix="async-rl-sbx-")
    workdir = os.path.join(base, "work")
    os.mkdir(workdir, 0o700)
    if uid is not None:
        os.chmod(base, 0o711)  # the slot uid can enter `base` but not write there: `..` is not writable
        os.chown(workdir, uid, uid)
    return base, workdir


def proc_uids(pid: str, skip_zombies: bool = False) -> tuple[int, ...]:
    """The real, effective, saved and fs uids of a process (empty if gone, or a zombie when `skip_zombies`)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if skip_zombies and line.startswith(b"State:") and line.split()[1:2] in ([b"Z"], [b"X"]):
                    return ()
                if line.startswith(b"Uid:"):
                    return tuple(int(x) for x in line.split()[1:])
    except (OSError, ValueError):
        pass
    return ()


def tasks_of_uid(uid: int) -> int:
    """Processes and threads whose real uid is `uid` (what RLIMIT_NPROC counts)."""
    count = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            uids = proc_uids(pid)
            if uids and uids[0] == uid:
                try:
                    count += len(os.listdir(f"/proc/{pid}/task"))
                except OSError:
                    count += 1
    return count


def kill_uid(uid: int, rounds: int = 50) -> int:
    """SIGKILL every process any of whose uids is `uid` until none is left; returns how many were signalled."""
    killed = 0
    for _ in range(rounds):
        found = [int(p) for p in os.listdir("/proc") if p.isdigit() and uid in proc_uids(p, True)]
        if not found:
            return killed
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.005)
    return killed


def force_rmtree(path: str) -> None:
    def onerror(func, p, exc):  # noqa: ARG001 - shutil's signature
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=onerror)
