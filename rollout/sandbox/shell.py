"""Run a shell command in a directory of the host, isolated: the swe env's `bash` and `run_tests` tools and its judge.

`ShellSandbox.run(command, workdir)` starts `python -I -S -B rollout/sandbox/shell_child.py`, which isolates itself
with the same mechanisms as the Python sandbox (rollout/sandbox/isolation.py: rlimits on CPU, memory, file size,
processes and open files; new network, mount and pid namespaces; as root, a uid of its own for the call) and
becomes `bash -c COMMAND` in `workdir`. Inside, the host's files are read-only to it (its uid owns only `workdir`),
`/tmp`-like directories are private size-capped tmpfs, `/root` and `/home` are hidden (the interpreter's own
directories bound back read-only), and there is no network, the host's loopback included. Every call has a
wall-clock limit; then the process group, the call's uid and, with the pid namespace, everything the command left
behind are killed. Output (stdout and stderr, merged) is kept up to a cap, the rest counted.

`require_namespaces` (the default) fails closed: a host that gives no network and mount namespaces runs nothing
and `run` raises SandboxError naming the capability and the opt-out.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rollout.sandbox.parent import NAMESPACES, SandboxError
from rollout.sandbox.processes import UidSlots, kill_uid

SHELL_CHILD = str(Path(__file__).with_name("shell_child.py"))


@dataclass(frozen=True)
class ShellLimits:
    wall_s: float = 30.0  # the whole command; then everything it started is killed
    cpu_s: int = 60  # RLIMIT_CPU of each process
    memory_mb: int = 2048  # RLIMIT_AS of each process
    file_size_mb: int = 32  # RLIMIT_FSIZE: the largest file it can write
    nproc: int = 64  # RLIMIT_NPROC: processes and threads of the call's uid (as root)
    open_files: int = 256  # RLIMIT_NOFILE
    output_chars: int = 16384  # stdout and stderr (merged) kept up to this; the rest counted
    nice: int = 10


@dataclass
class ShellResult:
    exit_code: int | None  # bash's; negative: killed by that signal; None: timed out
    output: str
    output_dropped: int = 0  # bytes over the cap
    timed_out: bool = False
    wall_s: float = 0.0
    isolation: list[str] = field(default_factory=list)  # the mechanisms in force
    notes: list[str] = field(default_factory=list)  # those that could not be set


class ShellSandbox:
    """Isolated `bash -c` calls in host directories; thread-safe (each call claims its own uid as root)."""

    def __init__(self, limits: ShellLimits | None = None, require_namespaces: bool = True, python: str | None = None,
                 uid_base: int = 62000, uid_count: int = 512) -> None:
        self.limits = limits or ShellLimits()
        self.require_namespaces = require_namespaces
        self.python = python or sys.executable  # the interpreter the commands find first on PATH
        self.is_root = os.geteuid() == 0
        self._uids = UidSlots(uid_base, uid_count) if self.is_root else None
        paths = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
        paths.add(os.path.dirname(os.path.realpath(self.python)))
        self._expose = sorted(p for p in paths if not any(p.startswith(q + "/") for q in paths))

    def check(self) -> None:
        """One empty call: raises SandboxError where namespaces are required and this host gives none."""
        workdir = tempfile.mkdtemp(prefix="async-rl-shell-")
        try:
            self.run("true", workdir)
        finally:
            os.rmdir(workdir)

    def run(self, command: str, workdir: str, env: dict[str, str] | None = None, wall_s: float | None = None,
            pass_fds: tuple[int, ...] = (), binds: tuple[str, ...] = (), readonly: bool = False) -> ShellResult:
        """`bash -c command` in `workdir` (which it may write, unless `readonly`); `env` adds to a bare
        environment; `binds`: more host directories it sees read-only (under a hidden or private directory too);
        `pass_fds`: descriptors it inherits (a results pipe)."""
        claimed = self._uids.claim() if self._uids is not None else None
        uid = claimed[0] if claimed else None
        try:
            if uid is not None and not readonly:
                _chown_tree(workdir, uid)
            result = self._run(command, os.path.realpath(workdir), env or {}, wall_s or self.limits.wall_s,
                               pass_fds, binds, readonly, uid)
        finally:
            if claimed is not None:
                self._uids.release(claimed)
        if self.require_namespaces and not all(n in result.isolation for n in NAMESPACES):
            raise SandboxError(
                "namespaces are required and this host refused them: the shell sandbox needs new network and mount "
                "namespaces (unshare CLONE_NEWNET|CLONE_NEWNS" + ("" if self.is_root else ", in a new user namespace: "
                "CLONE_NEWUSER") + "), and got none (" + ("; ".join(result.notes) or result.output[-300:]) + "). "
                "Run the worker as root, or where unprivileged user namespaces are allowed; or set "
                "require_namespaces: false, the explicit opt-out, to run commands with rlimits and a uid only, which "
                "is no security boundary (unsafe)")
        return result

    def _spec(self, command: str, workdir: str, env: dict[str, str], binds: tuple[str, ...], readonly: bool,
              uid: int | None, report_fd: int) -> dict:
        limits = self.limits
        path = f"{os.path.dirname(self.python)}:/usr/local/bin:/usr/bin:/bin"
        return {
            "command": command,
            "env": {"PATH": path, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": workdir, "TMPDIR": "/tmp",
                    "PYTHONDONTWRITEBYTECODE": "1", **env},
            "workdir": workdir,
            "uid": uid,
            "namespaces": True,
            "require_namespaces": self.require_namespaces,
            "audit": False,
            "expose": self._expose,
            "hide": ["/root", "/home"],
            "private_dirs": ["/tmp", "/var/tmp", "/dev/shm", "/run/lock"],
            "binds": [[workdir, not readonly]] + [[os.path.realpath(b), False] for b in binds],
            "limits": {"cpu_s": limits.cpu_s, "memory": limits.memory_mb << 20, "fsize": limits.file_size_mb << 20,
                       "nofile": limits.open_files, "nproc": limits.nproc, "nice": limits.nice, "disk_mb": 0},
            "report_fd": report_fd,
        }

    def _run(self, command: str, workdir: str, env: dict[str, str], wall_s: float, pass_fds: tuple[int, ...],
             binds: tuple[str, ...], readonly: bool, uid: int | None) -> ShellResult:
        report_r, report_w = os.pipe()
        spec = self._spec(command, workdir, env, binds, readonly, uid, report_w)
        started = time.monotonic()
        try:
            proc = subprocess.Popen([self.python, "-I", "-S", "-B", SHELL_CHILD], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=(report_w, *pass_fds),
                                    env={"PATH": "/usr/bin:/bin"}, cwd="/", process_group=0)
        finally:
            os.close(report_w)
        with contextlib.suppress(OSError):
            proc.stdin.write(json.dumps(spec).encode())
            proc.stdin.close()
        output, report, dropped, timed_out = bytearray(), b"", 0, False
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(proc.stdout, selectors.EVENT_READ, "out")
                sel.register(report_r, selectors.EVENT_READ, "report")
                deadline, exited_at = started + wall_s, None
                while sel.get_map():
                    now = time.monotonic()
                    if now >= deadline:
                        timed_out = True
                        break
                    if exited_at is None and proc.poll() is not None:
                        exited_at = now
                    if exited_at is not None and now - exited_at > 0.2:
                        break  # a straggler outside a pid namespace holds the pipe: not waited for
                    left = deadline - now
                    for key, _ in sel.select(timeout=min(left, 0.05)):
                        chunk = os.read(key.fd, 65536)
                        if not chunk:
                            sel.unregister(key.fileobj)
                        elif key.data == "report":
                            report += chunk
                        else:
                            room = max(0, self.limits.output_chars * 4 - len(output))
                            output += chunk[:room]
                            dropped += len(chunk) - min(room, len(chunk))
        finally:
            exit_code = proc.poll()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            if uid is not None:
                kill_uid(uid)
            proc.stdout.close()
            os.close(report_r)
        if exit_code is None and not timed_out:
            exit_code = proc.returncode
        try:
            state = json.loads(report.splitlines()[0]) if report else {}
        except ValueError:
            state = {}
        return ShellResult(None if timed_out else exit_code, output.decode("utf-8", "replace"), dropped, timed_out,
                           time.monotonic() - started, list(state.get("isolation", [])), list(state.get("notes", [])))


def _chown_tree(root: str, uid: int) -> None:
    """Give the call's uid the directory it works in (files it or an earlier call's uid made included)."""
    os.lchown(root, uid, uid)
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            with contextlib.suppress(OSError):
                os.lchown(os.path.join(directory, name), uid, uid)
