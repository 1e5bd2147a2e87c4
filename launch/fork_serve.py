"""The fork server's own process (`python -m launch.fork_serve`, started by launch/forkserver.py): import what the
roles need, then fork a role per request line on stdin, answering its pid and, when it ends, its exit code on
stdout (JSON lines)."""

from __future__ import annotations

import json
import os
import select
import signal
import sys

from launch.forkserver import PRELOAD, die_with_parent


def _reply(fd: int, message: dict) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


def _exit_code(status: int) -> int:
    """Popen's convention: the exit status, or -N for a process ended by signal N."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _child(request: dict, server_pid: int, protocol_fds: tuple[int, int]) -> int:
    """In the forked child: become the role and run it; returns its exit code."""
    os.setsid()
    die_with_parent(server_pid)
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
