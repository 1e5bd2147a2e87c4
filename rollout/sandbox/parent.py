"""Run untrusted Python (an agent's code) against tests: per execution, one fresh, limited, offline process for the
code and one for the tests.

`Sandbox.run(code, tests)` starts two new interpreters (no site, no user path): the agent's process,
`python -I -S -B rollout/sandbox/child.py`, which isolates itself before the agent's code runs (rlimits,
network/mount/pid namespaces, its own uid, no_new_privs, or an audit hook where namespaces are not allowed:
rollout/sandbox/isolation.py says how), and the judge, `python -I -S -B rollout/sandbox/judge.py`, which runs the
tests and calls the agent's functions over a pair of pipes, comparing plain values it decoded itself
(rollout/sandbox/values.py). Each gets its part of the spec on stdin; the judge alone writes the events (one JSON
line each) on a third pipe, which the agent's process never holds.

This parent gives every execution a wall-clock deadline and then kills both process groups, and, when the child
dropped to a slot uid (as root: `uid_base` + a slot claimed with a machine-wide lock file), every process of that
uid (found in /proc), so a process that left the group (setsid, a double fork) dies too. Output is capped on
both sides; the temporary directory is removed afterwards. Executions run concurrently up to `max_concurrent`
(a semaphore); `run` blocks only its calling thread.

This is process-level isolation, not a VM: the agent shares the kernel (a kernel exploit escapes it), can read
world-readable files, and can use the CPU and memory its limits allow. See docs/environments.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from async_rl.errors import AsyncRLError
from rollout.sandbox.processes import UidSlots, force_rmtree, kill_uid, make_workdir, tasks_of_uid
from rollout.sandbox.results import ExecutionResult, Limits, Test, assemble, parse_event

log = logging.getLogger("rollout.sandbox")

CHILD = str(Path(__file__).with_name("child.py"))  # run by path: the child imports nothing of the project
JUDGE = str(Path(__file__).with_name("judge.py"))
RESULT_FLOOD_BYTES = 16 << 20  # more than this on the result pipe without a newline: not the judge's doing
STRAGGLER_S = 0.2  # after the judge exits, how long a process still holding its pipes is waited for
NAMESPACES = ("netns", "mountns")  # what `require_namespaces` asks for (a pid namespace is taken where allowed)


class SandboxError(AsyncRLError):
    """The sandbox cannot give what it was asked for (namespaces on a host without them)."""


class _Counts:
    """Executions in this process, and those whose agent's process ran without namespaces (the rollout worker puts
    both on every metrics line: `sandbox_executions`, `sandbox_executions_without_namespaces`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.executions = 0
        self.without_namespaces = 0
        self.warned = False

    def count(self, isolation: list[str], notes: list[str]) -> None:
        if not isolation:
            return  # the agent's process never said (it died at once): nothing ran
        fallback = not all(n in isolation for n in NAMESPACES)
        with self.lock:
            self.executions += 1
            self.without_namespaces += fallback
            warn, self.warned = fallback and not self.warned, self.warned or fallback
        if warn:
            log.warning("sandbox: agent code runs WITHOUT namespaces here (%s; %s): the audit-hook fallback is no "
                        "security boundary; env.kwargs.require_namespaces=true refuses to run so",
                        "+".join(isolation), "; ".join(notes) or "isolation: basic")


COUNTS = _Counts()


def isolation_counts() -> dict[str, int]:
    """This process's sandbox executions so far, and how many of them ran without namespaces."""
    with COUNTS.lock:
        return {"sandbox_executions": COUNTS.executions,
                "sandbox_executions_without_namespaces": COUNTS.without_namespaces}


class Sandbox:
    """Runs code against tests in a fresh limited process; thread-safe, at most `max_concurrent` at once.

    isolation: "auto" (namespaces where the kernel allows, else the audit fallback) or "basic" (never
    namespaces: rlimits, uid, process group and the audit hook only; for tests and for hosts that forbid unshare).
    require_namespaces: no fallback: the constructor runs one empty execution and raises SandboxError if it got no
    network and mount namespaces, and an execution that gets none later never loads the code and raises too.
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
        require_namespaces: bool = False,
    ) -> None:
        if isolation not in ("auto", "basic"):
            raise ValueError(f"isolation: expected 'auto' or 'basic', got {isolation!r}")
        if require_namespaces and isolation == "basic":
            raise ValueError("require_namespaces: 'basic' isolation never uses namespaces; use 'auto'")
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent: expected >= 1, got {max_concurrent}")
        self.limits = limits or Limits()
        self.max_concurrent = max_concurrent
        self.isolation = isolation
        self.site_packages = site_packages
        self.python = python or sys.executable
        self.is_root = os.geteuid() == 0
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self._uids = UidSlots(uid_base, uid_count) if self.is_root else None
        # The interpreter's directories: bind-mounted back (read-only) when /root or /home is hidden.
        paths = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
        paths.add(os.path.dirname(os.path.realpath(self.python)))
        self._expose = sorted(p for p in paths if not any(p.startswith(q + "/") for q in paths))
        self.require_namespaces = require_namespaces
        if require_namespaces:
            self.run("", [])  # raises SandboxError where this host gives no namespaces

    def run(
        self,
        code: str,
        tests: Sequence[Test],
        setup: str = "",
        explain: bool = True,
        entry_points: Sequence[str] | None = None,
    ) -> ExecutionResult:
        """Load `setup` then `code` as one module in the agent's process; the judge runs `setup` too, then each
        test in a copy of its namespace where each of `entry_points` (default: every function the code defines)
        calls the agent's function of that name. Never raises for anything the code does (SandboxError: namespaces
        required and not given). `explain`: on a failed `assert a == b`, evaluate `a` and report what it gave."""
        names = None if entry_points is None else [str(n) for n in entry_points]
        with self._slots:
            uid = self._uids.claim() if self._uids is not None else None
            try:
                result = self._run(code, list(tests), setup, explain, names, uid)
            finally:
                if uid is not None:
                    self._uids.release(uid)
        COUNTS.count(result.isolation, result.notes)
        if self.require_namespaces and not all(n in result.isolation for n in NAMESPACES):
            raise SandboxError(
                "namespaces are required and this host refused them: the sandbox needs new network and mount "
                "namespaces (unshare CLONE_NEWNET|CLONE_NEWNS" + ("" if self.is_root else ", in a new user namespace: "
                "CLONE_NEWUSER") + "), and got none ("
                + ("; ".join(result.notes) or f"the agent's process ended: {result.status}, {result.stderr[-300:]}")
                + "). Run the worker as root, or where unprivileged user namespaces are allowed (sysctl "
                "kernel.unprivileged_userns_clone / AppArmor, a seccomp profile that allows unshare); or set "
                "require_namespaces: false, the explicit opt-out, to accept the audit-hook fallback, which is no "
                "security boundary (unsafe)"
            )
        return result

    # -- one execution

    def _run(
        self,
        code: str,
        tests: list[Test],
        setup: str,
        explain: bool,
        entry_points: list[str] | None,
        claimed: tuple[int, int] | None,
    ) -> ExecutionResult:
        uid = claimed[0] if claimed else None
        base, workdir = make_workdir(uid)
        token = secrets.token_hex(16)
        request_r, request_w = os.pipe()  # judge -> agent: calls
        reply_r, reply_w = os.pipe()  # agent -> judge: the isolation in force, the load, replies, output
        result_r, result_w = os.pipe()  # judge -> here: the events
        agent_spec = self._agent_spec(code, setup, workdir, uid, request_r, reply_w)
        judge_spec = self._judge_spec(tests, setup, explain, entry_points, token, reply_r, request_w, result_w)
        started = time.monotonic()
        agent = judge = None
        watch = _Watch(token, self.limits.output_chars * 4)  # bytes, of UTF-8 text
        try:
            try:
                agent = self._start(CHILD, workdir, (request_r, reply_w), subprocess.PIPE)
                judge = self._start(JUDGE, workdir, (reply_r, request_w, result_w), subprocess.DEVNULL)
            finally:
                for fd in (request_r, request_w, reply_r, reply_w, result_w):
                    os.close(fd)
            _hand(agent, agent_spec)
            _hand(judge, judge_spec)
            watch.follow(judge, agent, result_r, started + self.limits.wall_s)
        finally:
            agent_exit = agent.poll() if agent is not None else None  # before the kill: its own end, if it ended
            for proc in (agent, judge):
                if proc is not None:
                    self._kill_all(proc, uid)
            os.close(result_r)
            shutil.rmtree(base, ignore_errors=True)
            if os.path.exists(base):  # a directory the agent made unreadable (basic mode, not root)
                force_rmtree(base)
        if judge.returncode not in (0, -signal.SIGKILL) and not watch.timed_out:
            log.error("sandbox: the judge exited with %s: %s", judge.returncode, bytes(watch.out["judge"][-2000:]))
        wall_s = time.monotonic() - started
        return assemble(watch.events, tests, agent_exit, watch.out, watch.dropped, watch.timed_out, wall_s,
                        self.limits)

    def _limits(self) -> dict:
        limits = self.limits
        return {
            "test_s": limits.test_s,
            "cpu_s": limits.cpu_s,
            "memory": limits.memory_mb << 20,
            "fsize": limits.file_size_mb << 20,
            "disk_mb": limits.disk_mb,
            "nofile": limits.open_files,
            "output_chars": limits.output_chars,
            "detail_chars": limits.detail_chars,
            "nice": limits.nice,
            "value_bytes": limits.value_bytes,
        }

    def _nproc(self, uid: int | None) -> int:
        """RLIMIT_NPROC counts every process of the uid: the worker's own, when the code runs as the worker's uid."""
        return self.limits.nproc if uid is not None else self.limits.nproc + tasks_of_uid(os.getuid())

    def _agent_spec(self, code: str, setup: str, workdir: str, uid: int | None, request_fd: int,
                    reply_fd: int) -> dict:
        """What the agent's process reads on stdin (rollout/sandbox/child.py): no test, no token."""
        return {
            "code": code,
            "setup": setup,
            "workdir": workdir,
            "uid": uid,
            "namespaces": self.isolation == "auto",
            "require_namespaces": self.require_namespaces,
            "expose": self._expose,
            "hide": ["/root", "/home"],
            "private_dirs": ["/tmp", "/var/tmp", "/dev/shm", "/run/lock"],
            "limits": {**self._limits(), "nproc": self._nproc(uid)},
            "request_fd": request_fd,  # the same numbers in the child (pass_fds keeps them)
            "reply_fd": reply_fd,
        }

    def _judge_spec(self, tests: list[Test], setup: str, explain: bool, entry_points: list[str] | None, token: str,
                    reply_fd: int, request_fd: int, result_fd: int) -> dict:
        """What the judge reads on stdin (rollout/sandbox/judge.py)."""
        return {
            "token": token,
            "setup": setup,
            "tests": [{"name": t.name, "source": t.source} for t in tests],
            "entry_points": entry_points,
            "explain": explain,
            "limits": self._limits(),
            "reply_fd": reply_fd,
            "request_fd": request_fd,
            "result_fd": result_fd,
        }

    def _start(self, script: str, workdir: str, fds: tuple[int, ...], stdout: int) -> subprocess.Popen:
        """`script` in a process group of its own, with a bare environment and its ends of the pipes."""
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": workdir}
        flags = ["-I", "-B"] if self.site_packages else ["-I", "-S", "-B"]
        return subprocess.Popen(
            [self.python, *flags, script],
            stdin=subprocess.PIPE,
            stdout=stdout,
            stderr=subprocess.PIPE,
            pass_fds=fds,
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
            kill_uid(uid)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def _hand(proc: subprocess.Popen, spec: dict) -> None:
    """A process's spec on its stdin, then EOF."""
    try:
        proc.stdin.write(json.dumps(spec).encode())
        proc.stdin.close()
    except OSError:
        pass  # it died at once; reported as a crash


class _Watch:
    """One execution's pipes, read until they close, the judge has exited (stragglers are not waited for) or the
    deadline passes: the judge's signed events, and the agent's stdout/stderr (and the judge's stderr) up to a cap
    (the agent's rest counted)."""

    def __init__(self, token: str, cap_bytes: int) -> None:
        self.token = token
        self.cap = cap_bytes
        self.events: list[dict] = []
        self.out = {"stdout": bytearray(), "stderr": bytearray(), "judge": bytearray()}
        self.dropped = 0
        self.timed_out = False
        self._buffer = b""

    def follow(self, judge: subprocess.Popen, agent: subprocess.Popen, result_fd: int, deadline: float) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(result_fd, selectors.EVENT_READ, "result")
            sel.register(agent.stdout, selectors.EVENT_READ, "stdout")
            sel.register(agent.stderr, selectors.EVENT_READ, "stderr")
            sel.register(judge.stderr, selectors.EVENT_READ, "judge")
            exited_at = None
            while sel.get_map():
                now = time.monotonic()
                if now >= deadline:
                    self.timed_out = judge.poll() is None
                    return
                if exited_at is None and judge.poll() is not None:
                    exited_at = now
                if exited_at is not None and now - exited_at > STRAGGLER_S:
                    return  # the judge is done; the agent's process (or a straggler) holding a pipe is not waited for
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
        if kept is not self.out["judge"]:
            self.dropped += len(chunk) - min(room, len(chunk))
