"""A fork server for a local run's roles: one process imports torch, transformers and DeepSpeed once, and every
learner, rollout worker and final evaluation of `async-rl train` is forked from it, instead of each being a fresh
interpreter that spends ~6 CPU-s on the same imports (the quick start's roles, the suite's hundreds of runs).

A forked role is the command a pod runs (`launch.cli.main([ROLE, ..., "--config", PATH])`) in its own session, its
output appended to its log, its environment the launcher's, with fresh random seeds; it ends the way a process
does (its atexit handlers run). The server reports each child's pid and exit code on a pipe (JSON lines); the
launcher holds a `ForkedProcess` with the part of `subprocess.Popen` the supervisor uses. The kernel ends the
server when the launcher dies and each role when the server dies (PR_SET_PDEATHSIG), so no role outlives the run.

Not used where forking after the imports is unsafe or impossible: a machine with an NVIDIA device (a CUDA driver
initialised before fork breaks the child's CUDA), a platform without fork, a server that did not start, or with
ASYNC_RL_FORK_SERVER=0 in the environment; the roles then start as fresh interpreters, as a pod does.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PRELOAD = ("torch", "transformers", "deepspeed", "rollout.worker", "learner.trainer", "rollout.evaluate")
READY_TIMEOUT_S = 300.0  # the server's imports (seconds; minutes on a machine at a load of 10)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def usable() -> bool:
    """Whether roles are forked from a server here: Linux, no NVIDIA device (see the module's docstring), and not
    turned off with ASYNC_RL_FORK_SERVER=0 (every role a new interpreter, as a pod starts it)."""
    return (sys.platform.startswith("linux") and not glob.glob("/dev/nvidia[0-9]*")
            and os.environ.get("ASYNC_RL_FORK_SERVER", "1") != "0")


def die_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when its parent dies (at once if it already has)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGTERM)


class ForkedProcess:
    """A role forked by the server: pid, poll, wait, send_signal, kill, returncode (as `subprocess.Popen`'s)."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server, self.pid = server, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it exited; the server reports its code
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The launcher's side: starts the server (`python -m launch.fork_serve`) and asks it for roles."""

    def __init__(self, env: dict[str, str], log_path: Path | None = None) -> None:
        """`log_path`: where the server's own output goes (its imports' warnings; not the launcher's terminal)."""
        launcher = os.getpid()
        log = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115 - the child holds it
        self.process = subprocess.Popen([sys.executable, "-m", "launch.fork_serve"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True,
                                        preexec_fn=lambda: die_with_parent(launcher))
        if log is not None:
            log.close()
        self._requests = itertools.count()
        self._started: queue.SimpleQueue[dict] = queue.SimpleQueue()
        self._exits: dict[int, int] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name="forkserver-replies", daemon=True).start()

    def alive(self) -> bool:
        return self.process.poll() is None

    def start(self, args: list[str], log_path: str, env: dict[str, str], stdout_path: str | None = None,
              timeout_s: float = READY_TIMEOUT_S) -> ForkedProcess:
        """Fork `async-rl ARGS` with stderr (and stdout, unless `stdout_path`) appended to `log_path`. OSError when
        the server is gone or does not answer (the caller starts the role as a fresh interpreter)."""
        request = {"id": next(self._requests), "args": args, "log": log_path, "stdout": stdout_path or log_path,
                   "env": env}
        deadline = time.monotonic() + timeout_s
        try:
            assert self.process.stdin is not None
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
            reply = self._started.get(timeout=timeout_s)
            while reply.get("id", request["id"]) != request["id"]:  # skip the late answer to a request given up on
                reply = self._started.get(timeout=max(0.0, deadline - time.monotonic()))
        except (OSError, ValueError, queue.Empty) as exc:
            raise OSError(f"the fork server did not start {args[0]}: {exc or 'no answer'}") from None
        if "pid" not in reply:
            raise OSError(f"the fork server did not start {args[0]}: {reply.get('error', 'it stopped')}")
        return ForkedProcess(self, reply["pid"])

    def exit_code(self, pid: int) -> int | None:
        with self._lock:
            return self._exits.get(pid)

    def close(self) -> None:
        """End the server (its roles have been stopped by then)."""
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            reply = json.loads(line)
            if "exit" in reply:
                with self._lock:
                    self._exits[reply["exit"]] = reply["code"]
            else:
                self._started.put(reply)
        self._started.put({"error": f"the fork server exited ({self.process.wait()})"})
