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
import select
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


def _die_with_parent(parent_pid: int) -> None:
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
    """The launcher's side: starts the server (`python -m launch.forkserver`) and asks it for roles."""

    def __init__(self, env: dict[str, str], log_path: Path | None = None) -> None:
        """`log_path`: where the server's own output goes (its imports' warnings; not the launcher's terminal)."""
        launcher = os.getpid()
        log = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115 - the child holds it
        self.process = subprocess.Popen([sys.executable, "-m", "launch.forkserver"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True,
                                        preexec_fn=lambda: _die_with_parent(launcher))
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
            while reply.get("id", request["id"]) != request["id"]:  # the late answer to a request given up on
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


# --- the server --------------------------------------------------------------------------------------------------


def _reply(fd: int, message: dict) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


def _exit_code(status: int) -> int:
    """Popen's convention: the exit status, or -N for a process ended by signal N."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _child(request: dict, server_pid: int, protocol_fds: tuple[int, int]) -> int:
    """In the forked child: become the role and run it; returns its exit code."""
    os.setsid()
    _die_with_parent(server_pid)
    for fd in protocol_fds:
        os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    out = log if request["stdout"] == request["log"] else os.open(request["stdout"], os.O_WRONLY | os.O_CREAT |
                                                                   os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(log, 2)
    for fd in {log, out, null}:
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    print(f"async-rl {request['args'][0]}: forked by the fork server (pid {server_pid})", file=sys.stderr, flush=True)
    import random

    import numpy as np
    import torch

    random.seed()  # the server's generators would repeat in every child (a restarted worker's draws included)
    np.random.seed()
    torch.seed()
    sys.argv = ["async-rl", *request["args"]]
    from launch.cli import main

    return main(request["args"])


def serve() -> int:
    """Import what the roles need, then fork a role per request line until stdin closes."""
    requests, replies = os.dup(0), os.dup(1)  # the protocol's pipes, kept off fds 0 and 1 (a child reuses those)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(2, 1)  # anything the imports print goes to the launcher's stderr, not into the protocol
    for module in PRELOAD:
        try:
            __import__(module)
        except Exception as exc:  # a role that needs it reports the error itself
            print(f"fork server: import {module} failed: {exc}", file=sys.stderr)
    server_pid, buffered = os.getpid(), b""
    while True:
        while True:  # reap every child that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _reply(replies, {"exit": pid, "code": _exit_code(status)})
        if not select.select([requests], [], [], 0.05)[0]:
            continue
        chunk = os.read(requests, 65536)
        if not chunk:
            return 0  # the launcher closed the pipe: the run is over
        buffered += chunk
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = _child(request, server_pid, (requests, replies))
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else 1
                except BaseException:
                    import traceback

                    traceback.print_exc()
                raise SystemExit(code)  # the child ends as a process does: atexit handlers, buffers flushed
            _reply(replies, {"id": request["id"], "pid": pid})


if __name__ == "__main__":
    sys.exit(serve())
