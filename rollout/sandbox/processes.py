"""The host side of an execution's processes: its working directory, its uid slot (claimed machine-wide), and every
process of a sandbox uid found and killed (in /proc), so that nothing an execution started outlives it
(rollout/sandbox/parent.py and shell.py use these)."""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import signal
import tempfile
import threading
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


class UidSlots:
    """Sandbox uids for a root parent: one per concurrent execution, machine-wide (a flock per uid in a root-owned
    directory), so that a sweep of a uid's processes kills only that execution's."""

    def __init__(self, uid_base: int, uid_count: int) -> None:
        self._uid_lock = threading.Lock()
        self._uids_here: set[int] = set()
        self._uid_range = range(uid_base, uid_base + uid_count)
        self._lock_dir = os.path.join(tempfile.gettempdir(), "async-rl-sandbox-uids")
        os.makedirs(self._lock_dir, mode=0o700, exist_ok=True)
        st = os.lstat(self._lock_dir)
        if not os.path.isdir(self._lock_dir) or os.path.islink(self._lock_dir) or st.st_uid != 0:
            raise RuntimeError(f"sandbox: {self._lock_dir} is not a root-owned directory; refusing to use it")

    def claim(self) -> tuple[int, int]:
        start = secrets.randbelow(len(self._uid_range))
        for i in range(len(self._uid_range)):
            uid = self._uid_range[(start + i) % len(self._uid_range)]
            with self._uid_lock:
                if uid in self._uids_here:
                    continue
                self._uids_here.add(uid)
            fd = os.open(os.path.join(self._lock_dir, str(uid)), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                with self._uid_lock:
                    self._uids_here.discard(uid)
                continue
            kill_uid(uid)  # leftovers of an owner that died
            return uid, fd
        raise RuntimeError(f"sandbox: all {len(self._uid_range)} sandbox uids are in use")

    def release(self, claimed: tuple[int, int]) -> None:
        uid, fd = claimed
        os.close(fd)  # releases the flock
        with self._uid_lock:
            self._uids_here.discard(uid)
