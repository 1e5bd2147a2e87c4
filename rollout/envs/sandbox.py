"""Run untrusted Python (an agent's code) against tests: one fresh, limited, offline process per execution.

`Sandbox.run(code, tests)` starts a new interpreter (`python -I -S -B`) running the runner below, hands it the
code and the tests on stdin, and reads back one JSON line per event on a separate pipe. In that child, before the
agent's code runs, the runner (trusted, still privileged) applies, each where this machine allows it:

  rlimits           CPU seconds, address space, file size, processes (per uid), open files, no core files
  namespaces        a new network namespace (no interface up: no connection anywhere, 127.0.0.1 included); a
                    new mount namespace: the working directory, /tmp, /var/tmp, /dev/shm and /run/lock become
                    private size-capped tmpfs that vanish with the execution, /root and /home are hidden (the
                    interpreter's own prefix is bind-mounted back read-only); a new pid namespace with its own
                    /proc: the agent's code runs as its pid 1, sees and can signal only its own processes, and
                    when it exits the kernel kills whatever it left behind. Root: plain unshare(2); not root:
                    inside a new user namespace (where the kernel allows unprivileged ones)
  uid               as root: setgroups([]), setgid/setuid to a uid of its own (`uid_base` + a slot claimed with a
                    machine-wide lock file), so it can write nowhere it was not given, cannot signal the worker,
                    cannot read other processes' environments, and RLIMIT_NPROC counts only its processes
  no_new_privs      setuid binaries cannot raise it back; the parent-death signal kills it if the worker dies
  audit             fallback only (no network namespace): an audit hook refuses sockets, process spawning,
                    ctypes, signals to other processes, writes outside the working directory and reads of
                    /proc/<other pid>; best effort, documented as such in docs/environments.md

The parent (this module) gives every execution a wall-clock deadline and then kills the process group, and, when
it dropped to a slot uid, every process of that uid (found in /proc), so a process that left the group (setsid, a
double fork) dies too. Output is capped on both sides; the temporary directory is removed afterwards.
Executions run concurrently up to `max_concurrent` (a semaphore); `run` blocks only its calling thread.

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
from dataclasses import dataclass, field

PASSED, FAILED, ERROR, TIMEOUT, NOT_RUN = "passed", "failed", "error", "timeout", "not_run"


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0  # the whole execution (start to exit); then the process group and the uid are killed
    test_s: float = 3.0  # one test, or loading the code (SIGALRM in the child: a timeout, then the next test)
    cpu_s: int = 10  # RLIMIT_CPU of each process
    memory_mb: int = 512  # RLIMIT_AS (address space) of each process
    file_size_mb: int = 16  # RLIMIT_FSIZE: the largest file it can write
    disk_mb: int = 64  # size of the private tmpfs working directory (and 8 MiB for each private /tmp-like dir)
    nproc: int = 16  # RLIMIT_NPROC: processes and threads of its uid
    open_files: int = 64  # RLIMIT_NOFILE
    output_chars: int = 4096  # stdout and stderr each kept up to this; the rest is counted and dropped
    detail_chars: int = 800  # one test's failure detail (assertion, traceback) kept up to this
    nice: int = 10  # the child's niceness: agent code yields the CPU to the worker


@dataclass
class Test:
    __test__ = False  # not a pytest test class

    name: str
    source: str  # Python statements run in a copy of the solution's namespace; passes if it raises nothing


@dataclass
class TestOutcome:
    name: str
    status: str  # passed, failed (AssertionError), error (another exception), timeout, not_run
    detail: str = ""  # the failing assertion / exception and the last traceback lines (capped)
    seconds: float = 0.0


@dataclass
class ExecutionResult:
    status: str  # ok (the runner finished), load_error (the code raised), timeout (wall clock), crash (died early)
    tests: list[TestOutcome]
    load_error: str = ""  # the exception of loading the code (a SyntaxError, ...), capped
    stdout: str = ""
    stderr: str = ""
    output_dropped: int = 0  # characters of stdout/stderr over the caps
    exit_code: int | None = None  # of the runner; negative: killed by that signal
    wall_s: float = 0.0
    isolation: list[str] = field(default_factory=list)  # the mechanisms that were in force in the child
    notes: list[str] = field(default_factory=list)  # mechanisms that were asked for and could not be set

    @property
    def passed(self) -> int:
        return sum(t.status == PASSED for t in self.tests)

    @property
    def fraction(self) -> float:
        return self.passed / len(self.tests) if self.tests else 0.0


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
        limits = self.limits
        uid = claimed[0] if claimed else None
        base = tempfile.mkdtemp(prefix="async-rl-sbx-")
        workdir = os.path.join(base, "work")
        os.mkdir(workdir, 0o700)
        if uid is not None:
            os.chmod(base, 0o711)  # the slot uid can enter `base` but not write there: `..` is not writable
            os.chown(workdir, uid, uid)
        token = secrets.token_hex(16)
        spec = {
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
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": workdir}
        flags = ["-I", "-B"] if self.site_packages else ["-I", "-S", "-B"]
        read_end, write_end = os.pipe()
        started = time.monotonic()
        proc = None
        events: list[dict] = []
        out = {"stdout": bytearray(), "stderr": bytearray()}
        dropped = 0
        timed_out = False
        try:
            try:
                proc = subprocess.Popen(
                    [self.python, *flags, "-c", _RUNNER_SOURCE, "async-rl-sandbox"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    pass_fds=(write_end,),
                    env=env,
                    cwd="/",
                    process_group=0,
                )
            finally:
                os.close(write_end)
            spec["result_fd"] = write_end  # same number in the child (pass_fds keeps it)
            try:
                proc.stdin.write(json.dumps(spec).encode())
                proc.stdin.close()
            except OSError:
                pass  # it died at once; reported as a crash below
            deadline = started + limits.wall_s
            sel = selectors.DefaultSelector()
            sel.register(read_end, selectors.EVENT_READ, "result")
            sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
            sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
            buffer = b""
            cap = limits.output_chars * 4  # bytes, of UTF-8 text
            exited_at = None
            while sel.get_map():
                now = time.monotonic()
                if now >= deadline:
                    timed_out = proc.poll() is None
                    break
                if exited_at is None and proc.poll() is not None:
                    exited_at = now
                if exited_at is not None and now - exited_at > 0.2:
                    break  # the runner is gone; a straggler holding a pipe open is not waited for
                for key, _ in sel.select(timeout=min(0.05, deadline - now)):
                    fd = key.fd
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    if key.data == "result":
                        buffer += chunk
                        if len(buffer) > 16 << 20:
                            buffer = b""  # a flood on the result pipe: not the runner's doing
                        *lines, buffer = buffer.split(b"\n")
                        for line in lines:
                            event = _parse_event(line, token)
                            if event is not None:
                                events.append(event)
                    else:
                        kept = out[key.data]
                        room = max(0, cap - len(kept))
                        kept += chunk[:room]
                        dropped += len(chunk) - min(room, len(chunk))
            sel.close()
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
        return _assemble(events, tests, proc, out, dropped, timed_out, time.monotonic() - started, limits)

    def _kill_all(self, proc: subprocess.Popen, uid: int | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)  # reaped first: a zombie still shows its uid in /proc
        if uid is not None:
            _kill_uid(uid)


def _parse_event(line: bytes, token: str) -> dict | None:
    try:
        event = json.loads(line)
    except ValueError:
        return None
    if not isinstance(event, dict) or event.pop("token", None) != token:
        return None  # not the runner's (it signs each line with a token the agent's code never sees on stdin)
    return event


def _assemble(events, tests, proc, out, dropped, timed_out, wall_s, limits) -> ExecutionResult:
    isolation: list[str] = []
    notes: list[str] = []
    load_error = ""
    loaded = False
    done = False
    stdout = stderr = ""
    outcomes: dict[int, TestOutcome] = {}
    started: int | None = None
    for event in events:
        kind = event.get("event")
        if kind == "ready":
            isolation = [str(x) for x in event.get("isolation", [])]
            notes = [str(x) for x in event.get("notes", [])]
        elif kind == "load":
            loaded = event.get("ok") is True
            load_error = str(event.get("error", ""))[: limits.detail_chars * 2]
        elif kind == "start":
            started = event.get("index")
        elif kind == "test":
            i = event.get("index")
            if isinstance(i, int) and 0 <= i < len(tests):
                status = event.get("status")
                status = status if status in (PASSED, FAILED, ERROR, TIMEOUT) else ERROR
                detail = str(event.get("detail", ""))[: limits.detail_chars]
                outcomes[i] = TestOutcome(tests[i].name, status, detail, float(event.get("seconds", 0.0)))
        elif kind == "output":
            stdout = str(event.get("stdout", ""))
            stderr = str(event.get("stderr", ""))
            dropped += int(event.get("dropped", 0))
        elif kind == "done":
            done = True
    fd_out = out["stdout"].decode("utf-8", "replace")[: limits.output_chars]
    fd_err = out["stderr"].decode("utf-8", "replace")[: limits.output_chars]
    stdout = (stdout + fd_out)[: limits.output_chars]
    stderr = (stderr + fd_err)[: limits.output_chars]
    exit_code = proc.returncode if proc is not None else None
    if done:
        status = "ok" if loaded else "load_error"
    elif timed_out:
        status = "timeout"
    else:
        status = "crash"
    results = []
    for i, test in enumerate(tests):
        if i in outcomes:
            results.append(outcomes[i])
        elif status == "timeout" and (started == i or (started is None and loaded and not outcomes and i == 0)):
            results.append(TestOutcome(test.name, TIMEOUT, f"killed after the {limits.wall_s:g} s wall-clock limit"))
        elif status == "crash" and started == i:
            why = f"the process died during this test ({_exit_text(exit_code)})"
            results.append(TestOutcome(test.name, ERROR, why))
        else:
            results.append(TestOutcome(test.name, NOT_RUN, "not run: " + _why_not_run(status, load_error, exit_code)))
    return ExecutionResult(status, results, load_error, stdout, stderr, dropped, exit_code, wall_s, isolation, notes)


def _why_not_run(status: str, load_error: str, exit_code: int | None) -> str:
    if status == "load_error":
        return "the code did not load"
    if status == "timeout":
        return "the execution was killed at its wall-clock limit"
    if status == "crash":
        return f"the process ended before this test ({_exit_text(exit_code)})"
    return "no result"


def _exit_text(code: int | None) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


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


# The program of the child: `python -I -S -B -c _RUNNER_SOURCE`. Standard library only; it reads its spec (code,
# tests, limits) from stdin, isolates itself, drops privileges, and only then runs the agent's code.
_RUNNER_SOURCE = r"""
import ast, ctypes, io, json, linecache, os, resource, signal, sys, time, traceback

spec = json.loads(sys.stdin.buffer.read())
sys.stdin = io.StringIO("")
os.close(0)
os.open(os.devnull, os.O_RDONLY)
L = spec["limits"]
TOKEN = spec["token"]
OUT = spec["result_fd"]
WORK = spec["workdir"]
ISOLATION, NOTES = [], []


def emit(**event):
    event["token"] = TOKEN
    data = (json.dumps(event) + "\n").encode()
    try:
        while data:
            data = data[os.write(OUT, data):]
    except OSError:
        pass


def cap(text, n):
    text = str(text)
    return text if len(text) <= n else text[: n - 20] + " ...[truncated]"


libc = ctypes.CDLL(None, use_errno=True)


def call(name, *args):
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, name + ": " + os.strerror(err))


CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWUSER, CLONE_NEWPID = 0x20000, 0x40000000, 0x10000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18


def mount(source, target, fstype, flags, data):
    enc = lambda s: None if s is None else s.encode()
    call("mount", enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))


def traversable(path):
    path = os.path.realpath(path)
    while path != "/":
        try:
            if not os.stat(path).st_mode & 0o001:
                return False
        except OSError:
            return False
        path = os.path.dirname(path)
    return True


root = os.geteuid() == 0
uid = spec["uid"]
owner = uid if uid is not None else os.getuid()

for name, value in (
    ("RLIMIT_CORE", (0, 0)),
    ("RLIMIT_CPU", (L["cpu_s"], L["cpu_s"] + 1)),
    ("RLIMIT_AS", (L["memory"], L["memory"])),
    ("RLIMIT_FSIZE", (L["fsize"], L["fsize"])),
    ("RLIMIT_NOFILE", (L["nofile"], L["nofile"])),
    ("RLIMIT_NPROC", (L["nproc"], L["nproc"])),
):
    try:
        resource.setrlimit(getattr(resource, name), value)
    except (ValueError, OSError) as exc:
        NOTES.append("rlimit " + name + ": " + str(exc))
ISOLATION.append("rlimits")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write fails with EFBIG instead of killing

namespaces = False
pidns = False
if spec["namespaces"]:
    base = CLONE_NEWNS | CLONE_NEWNET | (0 if root else CLONE_NEWUSER)
    try:
        try:
            call("unshare", base | CLONE_NEWPID)
            pidns = True
        except OSError:
            call("unshare", base)
            NOTES.append("no pid namespace: background processes are killed by the parent only")
        if not root:
            gid = os.getgid()
            with open("/proc/self/setgroups", "w") as f:
                f.write("deny")
            with open("/proc/self/uid_map", "w") as f:
                f.write("%d %d 1" % (owner, owner))
            with open("/proc/self/gid_map", "w") as f:
                f.write("%d %d 1" % (gid, gid))
        namespaces = True
        ISOLATION += ["netns", "mountns"] + ([] if root else ["userns"])
    except OSError as exc:
        NOTES.append("namespaces unavailable (" + str(exc) + "): audit-hook fallback")

if pidns:
    # The agent runs as pid 1 of a new pid namespace: it cannot signal (or, with its own /proc, see) anything
    # outside, and when it exits the kernel kills every process left in the namespace. This process only waits.
    child = os.fork()
    if child:
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        while True:
            try:
                _, status = os.waitpid(child, 0)
                break
            except ChildProcessError:
                os._exit(1)
            except InterruptedError:
                continue
        os._exit(os.waitstatus_to_exitcode(status) % 256)
    ISOLATION.append("pidns")

if namespaces:
    mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    expose = [p for p in spec["expose"] if any(p == h or p.startswith(h + "/") for h in spec["hide"])]
    handles = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in expose if os.path.isdir(p)}
    for d in spec["hide"]:
        if os.path.isdir(d) and not os.path.islink(d):
            mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for p, fd in handles.items():
        os.makedirs(p, exist_ok=True)
        mount("/proc/self/fd/%d" % fd, p, None, MS_BIND | MS_REC, None)
        mount(None, p, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
        os.close(fd)
    for d in spec["private_dirs"]:
        if os.path.isdir(d) and not os.path.islink(d):
            mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "size=8m,mode=1777")
    os.makedirs(WORK, exist_ok=True)
    options = "size=%dm,mode=0700,uid=%d,gid=%d" % (L["disk_mb"], owner, owner if uid is not None else os.getgid())
    mount("tmpfs", WORK, "tmpfs", MS_NOSUID | MS_NODEV, options)
    ISOLATION.append("private-tmp")
    if pidns:
        try:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
            ISOLATION.append("own-proc")
        except OSError as exc:
            NOTES.append("/proc of the host stays visible (" + str(exc) + ")")

if root and uid is not None:
    if not namespaces and not traversable(os.path.dirname(os.__file__)):
        # The standard library is not readable by other uids and cannot be bind-mounted here: import the common
        # modules now; an agent's import of anything else fails once the uid is dropped.
        for m in ("math", "cmath", "re", "collections", "itertools", "functools", "heapq", "bisect", "string",
                  "random", "statistics", "fractions", "decimal", "copy", "typing", "hashlib", "operator", "datetime",
                  "shutil", "struct", "array", "zlib", "textwrap", "unicodedata", "dataclasses", "enum", "pathlib"):
            try:
                __import__(m)
            except ImportError:
                pass
        NOTES.append("the stdlib is not readable by the sandbox uid: only preloaded modules importable")
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    ISOLATION.append("uid")
if not root and namespaces:
    class Caps(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    data = (ctypes.c_uint32 * 6)()
    try:
        call("capset", ctypes.byref(Caps(0x20080522, 0)), data)  # drop the user namespace's capabilities
    except OSError as exc:
        NOTES.append("capset: " + str(exc))
try:
    zero = ctypes.c_ulong(0)
    call("prctl", 38, ctypes.c_ulong(1), zero, zero, zero)  # PR_SET_NO_NEW_PRIVS
    call("prctl", 1, ctypes.c_ulong(signal.SIGKILL), zero, zero, zero)  # PR_SET_PDEATHSIG (cleared by setuid)
    if os.getppid() == 1:
        os._exit(1)  # the worker died before the death signal was armed
    ISOLATION.append("no_new_privs")
except OSError as exc:
    NOTES.append("prctl: " + str(exc))
os.chdir(WORK)
try:
    os.nice(L["nice"])
except OSError:
    pass

if not namespaces:
    BLOCKED_IMPORTS = {"_socket", "socket", "_ssl", "ssl", "_posixsubprocess", "subprocess", "_ctypes", "ctypes",
                       "multiprocessing", "_multiprocessing", "asyncio", "pty"}
    SPAWN = {"os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.fork", "os.forkpty", "subprocess.Popen",
             "os.startfile", "pty.spawn"}
    PATHS = {"open": 0, "os.remove": 0, "os.rmdir": 0, "os.mkdir": 0, "os.rename": (0, 1), "os.replace": (0, 1),
             "os.symlink": (0, 1), "os.link": (0, 1), "os.chmod": 0, "os.chown": 0, "os.truncate": 0,
             "shutil.rmtree": 0, "os.utime": 0, "os.chdir": None, "os.chroot": None}
    me = os.getpid()
    work_real = os.path.realpath(WORK)

    def inside(path):
        try:
            if isinstance(path, int):
                return True
            path = os.fsdecode(path)
        except TypeError:
            return True
        real = os.path.realpath(path)
        return real == work_real or real.startswith(work_real + "/")

    def hook(event, args):
        if event == "import" and args[0] in BLOCKED_IMPORTS:
            raise ImportError("sandbox: importing " + args[0] + " is blocked (no network, no processes)")
        if event.startswith("socket.") or event.startswith("ctypes.") or event in SPAWN:
            raise PermissionError("sandbox: " + event + " is blocked")
        if event in ("os.kill", "os.killpg") and args[0] not in (me, 0):
            raise PermissionError("sandbox: signalling another process is blocked")
        if event == "open":
            path, mode = args[0], args[1]
            if isinstance(path, (str, bytes)) and os.fsdecode(path).startswith("/proc/"):
                parts = os.fsdecode(path).split("/")
                if len(parts) > 2 and parts[2] not in ("self", "thread-self", str(me)):
                    raise PermissionError("sandbox: reading another process's /proc entry is blocked")
            flags = args[2] if len(args) > 2 else 0
            writing = (mode and any(c in str(mode) for c in "wax+")) or (flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            if writing and not inside(path):
                raise PermissionError("sandbox: writing outside the working directory is blocked")
            return
        if event in PATHS:
            which = PATHS[event]
            if which is None:
                raise PermissionError("sandbox: " + event + " is blocked")
            for i in (which if isinstance(which, tuple) else (which,)):
                if i < len(args) and not inside(args[i]):
                    raise PermissionError("sandbox: " + event + " outside the working directory is blocked")

    for m in [m for m in sys.modules if m in BLOCKED_IMPORTS or m.startswith("ctypes.")]:
        del sys.modules[m]
    del ctypes, libc, call, mount
    sys.addaudithook(hook)
    ISOLATION.append("audit")

emit(event="ready", isolation=ISOLATION, notes=NOTES, pid=os.getpid())


class Capped(io.TextIOBase):
    def __init__(self):
        self.parts, self.size, self.dropped = [], 0, 0

    def writable(self):
        return True

    def write(self, s):
        s = str(s)
        room = L["output_chars"] - self.size
        if room > 0:
            self.parts.append(s[:room])
            self.size += min(room, len(s))
        self.dropped += max(0, len(s) - max(room, 0))
        return len(s)

    def value(self):
        return "".join(self.parts)


class TestTimeout(BaseException):
    pass


def on_alarm(signum, frame):
    raise TestTimeout()


signal.signal(signal.SIGALRM, on_alarm)
stdout, stderr = Capped(), Capped()
sys.stdout, sys.stderr = stdout, stderr


def limited(fn):
    signal.setitimer(signal.ITIMER_REAL, L["test_s"])
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def tb_text(exc, skip_runner=True):
    frames = traceback.extract_tb(exc.__traceback__)
    frames = [f for f in frames if f.filename != "<string>"] if skip_runner else frames
    lines = traceback.format_list(frames[-3:]) + traceback.format_exception_only(type(exc), exc)
    return "".join(lines).rstrip()


def register(name, source):
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)


# The agent's code gets a fresh __main__ module of its own (pickle, dataclasses and `import __main__` find it); the
# runner's globals (its token among them) are then not one import away, though still reachable through frames.
main = type(sys)("__main__")
main.__builtins__ = __builtins__
sys.modules["__main__"] = main
namespace = main.__dict__
load_error = None
try:
    register("setup.py", spec["setup"])
    register("solution.py", spec["code"])
    limited(lambda: exec(compile(spec["setup"], "setup.py", "exec"), namespace))
    limited(lambda: exec(compile(spec["code"], "solution.py", "exec"), namespace))
except TestTimeout:
    load_error = "TimeoutError: loading the code took more than %g s" % L["test_s"]
except SyntaxError as exc:
    load_error = "".join(traceback.format_exception_only(type(exc), exc)).rstrip()
except BaseException as exc:
    load_error = tb_text(exc)
emit(event="load", ok=load_error is None, error=cap(load_error or "", L["detail_chars"] * 2))


def explain(source, ns):
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return ""
    test = tree.body[0].test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return ""
    try:
        got = limited(lambda: eval(compile(ast.Expression(test.left), "<test>", "eval"), ns))
        return "\n  got: " + cap(repr(got), 300)
    except TestTimeout:
        return ""
    except BaseException as exc:
        return "\n  raised: " + cap(type(exc).__name__ + ": " + str(exc), 300)


if load_error is None:
    for i, test in enumerate(spec["tests"]):
        emit(event="start", index=i)
        ns = dict(namespace)
        t0 = time.perf_counter()
        status, detail = "passed", ""
        try:
            name = "test_%d.py" % i
            register(name, test["source"])
            limited(lambda: exec(compile(test["source"], name, "exec"), ns))
        except TestTimeout:
            status, detail = "timeout", "took more than %g s" % L["test_s"]
        except AssertionError as exc:
            status = "failed"
            detail = tb_text(exc)
            if spec["explain"]:
                detail += explain(test["source"], dict(namespace))
        except BaseException as exc:
            status, detail = "error", tb_text(exc)
        emit(event="test", index=i, status=status, detail=cap(detail, L["detail_chars"]),
             seconds=time.perf_counter() - t0)

sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
emit(event="output", stdout=stdout.value(), stderr=stderr.value(), dropped=stdout.dropped + stderr.dropped)
emit(event="done")
os._exit(0)
"""
