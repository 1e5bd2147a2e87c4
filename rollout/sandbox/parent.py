"""Run untrusted Python (an agent's code) against tests: one fresh, limited, offline process per execution.

`Sandbox.run(code, tests)` starts a new interpreter, `python -I -S -B rollout/sandbox/child.py` (no site, no
user path), hands it the code, the tests and the limits on stdin, and reads back one JSON line per event on a
separate pipe. The child isolates itself before the agent's code runs (rlimits, network/mount/pid namespaces,
its own uid, no_new_privs, or an audit hook where namespaces are not allowed: rollout/sandbox/child.py says how).

This parent gives every execution a wall-clock deadline and then kills the process group, and, when the child
dropped to a slot uid (as root: `uid_base` + a slot claimed with a machine-wide lock file), every process of that
uid (found in /proc), so a process that left the group (setsid, a double fork) dies too. Output is capped on
both sides; the temporary directory is removed afterwards. Executions run concurrently up to `max_concurrent`
(a semaphore); `run` blocks only its calling thread.

This is process-level isolation, not a VM: the agent shares the kernel (a kernel exploit escapes it), can read
world-readable files, and can use the CPU and memory its limits allow. See docs/environments.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from rollout.sandbox.results import ExecutionResult, Limits, Test, assemble, parse_event

CHILD = str(Path(__file__).with_name("child.py"))  # run by path: the child imports nothing of the project
RESULT_FLOOD_BYTES = 16 << 20  # more than this on the result pipe without a newline: not the child's doing
STRAGGLER_S = 0.2  # after the child exits, how long a process still holding its pipes is waited for


class Sandbox:
    """Runs code against tests in a fresh limited process; thread-safe, at most `max_concurrent` at once.

    isolation: "auto" (namespaces where the kernel allows, else the audit fallback) or "basic" (never
    namespaces: rlimits, uid, process group and the audit hook only; for tests and for hosts that forbid unshare).
    """

    def __init__(
        self,
        limits: Limits | None = None,
        max_concurrent: int = 4,
        isolation: str = "auto",
        uid_base: int = 61000,
        uid_count: int = 512,
        site_packages: bool = False,
        python: str | None = None,
    ) -> None:
        if isolation not in ("auto", "basic"):
            raise ValueError(f"isolation: expected 'auto' or 'basic', got {isolation!r}")
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent: expected >= 1, got {max_concurrent}")
        self.limits = limits or Limits()
        self.max_concurrent = max_concurrent
        self.isolation = isolation
        self.site_packages = site_packages
        self.python = python or sys.executable
        self.is_root = os.geteuid() == 0
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self._uid_lock = threading.Lock()
        self._uids_here: set[int] = set()
        self._uid_range = range(uid_base, uid_base + uid_count)
        self._lock_dir = ""
        if self.is_root:
            self._lock_dir = os.path.join(tempfile.gettempdir(), "async-rl-sandbox-uids")
            os.makedirs(self._lock_dir, mode=0o700, exist_ok=True)
            st = os.lstat(self._lock_dir)
            if not os.path.isdir(self._lock_dir) or os.path.islink(self._lock_dir) or st.st_uid != 0:
                raise RuntimeError(f"sandbox: {self._lock_dir} is not a root-owned directory; refusing to use it")
        # The interpreter's directories: bind-mounted back (read-only) when /root or /home is hidden.
        paths = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
        paths.add(os.path.dirname(os.path.realpath(self.python)))
        self._expose = sorted(p for p in paths if not any(p.startswith(q + "/") for q in paths))

    def run(self, code: str, tests: Sequence[Test], setup: str = "", explain: bool = True) -> ExecutionResult:
        """Load `setup` then `code` as one module, run each test in a copy of its namespace; never raises for
        anything the code does. `explain`: on a failed `assert a == b`, evaluate `a` and report what it gave."""
        with self._slots:
            uid = self._claim_uid() if self.is_root else None
            try:
                return self._run(code, list(tests), setup, explain, uid)
            finally:
                if uid is not None:
                    self._release_uid(uid)

    # -- uid slots: one uid per concurrent execution, machine-wide (a flock per uid), so a sweep kills only ours

    def _claim_uid(self) -> tuple[int, int]:
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
            _kill_uid(uid)  # leftovers of an owner that died
            return uid, fd
        raise RuntimeError(f"sandbox: all {len(self._uid_range)} sandbox uids are in use")

    def _release_uid(self, claimed: tuple[int, int]) -> None:
        uid, fd = claimed
        os.close(fd)  # releases the flock
        with self._uid_lock:
            self._uids_here.discard(uid)

    # -- one execution

    def _run(
        self, code: str, tests: list[Test], setup: str, explain: bool, claimed: tuple[int, int] | None
    ) -> ExecutionResult:
        uid = claimed[0] if claimed else None
        base, workdir = _make_workdir(uid)
        token = secrets.token_hex(16)
        spec = self._spec(code, tests, setup, explain, workdir, uid, token)
        read_end, write_end = os.pipe()
        started = time.monotonic()
        proc = None
        watch = _Watch(token, self.limits.output_chars * 4)  # bytes, of UTF-8 text
        try:
            try:
                proc = self._start(workdir, write_end)
            finally:
                os.close(write_end)
            spec["result_fd"] = write_end  # same number in the child (pass_fds keeps it)
            try:
                proc.stdin.write(json.dumps(spec).encode())
                proc.stdin.close()
            except OSError:
                pass  # it died at once; reported as a crash
            watch.follow(proc, read_end, started + self.limits.wall_s)
        finally:
            if proc is not None:
                self._kill_all(proc, uid)
                for stream in (proc.stdin, proc.stdout, proc.stderr):
                    if stream is not None:
                        stream.close()
            os.close(read_end)
            shutil.rmtree(base, ignore_errors=True)
            if os.path.exists(base):  # a directory the agent made unreadable (basic mode, not root)
                _force_rmtree(base)
        wall_s = time.monotonic() - started
        return assemble(watch.events, tests, proc, watch.out, watch.dropped, watch.timed_out, wall_s, self.limits)

    def _spec(
        self, code: str, tests: list[Test], setup: str, explain: bool, workdir: str, uid: int | None, token: str
    ) -> dict:
        """What the child reads on stdin (rollout/sandbox/child.py), but for the result pipe's number."""
        limits = self.limits
        return {
            "token": token,
            "code": code,
            "setup": setup,
            "tests": [{"name": t.name, "source": t.source} for t in tests],
            "explain": explain,
            "workdir": workdir,
            "uid": uid,
            "namespaces": self.isolation == "auto",
            "expose": self._expose,
            "hide": ["/root", "/home"],
            "private_dirs": ["/tmp", "/var/tmp", "/dev/shm", "/run/lock"],
            "limits": {
                "test_s": limits.test_s,
                "cpu_s": limits.cpu_s,
                "memory": limits.memory_mb << 20,
                "fsize": limits.file_size_mb << 20,
                "disk_mb": limits.disk_mb,
                "nproc": limits.nproc if uid is not None else limits.nproc + _tasks_of_uid(os.getuid()),
                "nofile": limits.open_files,
                "output_chars": limits.output_chars,
                "detail_chars": limits.detail_chars,
                "nice": limits.nice,
            },
        }

    def _start(self, workdir: str, result_fd: int) -> subprocess.Popen:
        """The child, in a process group of its own, with a bare environment and the result pipe's write end."""
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": workdir}
        flags = ["-I", "-B"] if self.site_packages else ["-I", "-S", "-B"]
        return subprocess.Popen(
            [self.python, *flags, CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(result_fd,),
            env=env,
            cwd="/",
            process_group=0,
        )

    def _kill_all(self, proc: subprocess.Popen, uid: int | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)  # reaped first: a zombie still shows its uid in /proc
        if uid is not None:
            _kill_uid(uid)



class _Watch:
    """One execution's pipes, read until the child's pipes close, it has exited (stragglers are not waited for) or
    the deadline passes: its signed events, and its stdout/stderr up to a cap (the rest counted)."""

    def __init__(self, token: str, cap_bytes: int) -> None:
        self.token = token
        self.cap = cap_bytes
        self.events: list[dict] = []
        self.out = {"stdout": bytearray(), "stderr": bytearray()}
        self.dropped = 0
        self.timed_out = False
        self._buffer = b""

    def follow(self, proc: subprocess.Popen, result_fd: int, deadline: float) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(result_fd, selectors.EVENT_READ, "result")
            sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
            sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
            exited_at = None
            while sel.get_map():
                now = time.monotonic()
                if now >= deadline:
                    self.timed_out = proc.poll() is None
                    return
                if exited_at is None and proc.poll() is not None:
                    exited_at = now
                if exited_at is not None and now - exited_at > STRAGGLER_S:
                    return  # the child is gone; a straggler holding a pipe open is not waited for
                for key, _ in sel.select(timeout=min(0.05, deadline - now)):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                    elif key.data == "result":
                        self._result(chunk)
                    else:
                        self._output(self.out[key.data], chunk)

    def _result(self, chunk: bytes) -> None:
        self._buffer += chunk
        if len(self._buffer) > RESULT_FLOOD_BYTES:
            self._buffer = b""  # a flood on the result pipe: not the child's doing
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            event = parse_event(line, self.token)
            if event is not None:
                self.events.append(event)

    def _output(self, kept: bytearray, chunk: bytes) -> None:
        room = max(0, self.cap - len(kept))
        kept += chunk[:room]
        self.dropped += len(chunk) - min(room, len(chunk))


def _make_workdir(uid: int | None) -> tuple[str, str]:
    """A fresh temporary directory and the working directory inside it (owned by the slot uid, when one)."""
    base = tempfile.mkdtemp(prefix="async-rl-sbx-")
    workdir = os.path.join(base, "work")
    os.mkdir(workdir, 0o700)
    if uid is not None:
        os.chmod(base, 0o711)  # the slot uid can enter `base` but not write there: `..` is not writable
        os.chown(workdir, uid, uid)
    return base, workdir


def _proc_uids(pid: str, skip_zombies: bool = False) -> tuple[int, ...]:
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


def _tasks_of_uid(uid: int) -> int:
    """Processes and threads whose real uid is `uid` (what RLIMIT_NPROC counts)."""
    count = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            uids = _proc_uids(pid)
            if uids and uids[0] == uid:
                try:
                    count += len(os.listdir(f"/proc/{pid}/task"))
                except OSError:
                    count += 1
    return count


def _kill_uid(uid: int, rounds: int = 50) -> int:
    """SIGKILL every process any of whose uids is `uid` until none is left; returns how many were signalled."""
    killed = 0
    for _ in range(rounds):
        found = [int(p) for p in os.listdir("/proc") if p.isdigit() and uid in _proc_uids(p, True)]
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


def _force_rmtree(path: str) -> None:
    def onerror(func, p, exc):  # noqa: ARG001 - shutil's signature
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=onerror)
