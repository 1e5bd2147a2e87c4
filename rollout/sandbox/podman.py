"""The swe env's container runtime: each command in a fresh podman container of the task's `image`.

`PodmanShell(limits).for_image(image).run(command, workdir, ...)` has the shell sandbox's signature
(rollout/sandbox/shell.py) and runs `bash -c COMMAND` in `podman run --rm` of the image: no network, a read-only
root file system with a private `/tmp`, every capability dropped, no new privileges, limits on memory, processes
and open files, and `workdir` (the trajectory's copy) bind-mounted at its own path as the working directory; the
other `binds` read-only. Descriptors in `pass_fds` (the test outcomes' pipe) reach the container as 3, 4, ...
(`--preserve-fds`); an environment value naming one is renumbered to match. At the wall-clock limit the container
is removed (`podman rm -f`), not only its client killed.

Podman's settings come from a containers.conf written here (`CONTAINERS_CONF`): the OCI runtime (`runc` by
default; crun fails on some kernels) and the containers' default ulimits. The image must exist locally: this
project pulls nothing (docs/environments.md, "swe", says how to build one with debootstrap and `podman import`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import selectors
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from async_rl.errors import AsyncRLError
from rollout.sandbox.shell import ShellLimits, ShellResult

CONTAINERS_CONF = """[engine]
runtime = "{runtime}"

[containers]
default_ulimits = ["nofile={nofile}:{nofile}", "nproc=32768:32768"]
"""


class PodmanShell:
    """Commands in containers; one per call, removed afterwards."""

    def __init__(self, limits: ShellLimits | None = None, runtime: str = "runc", podman: str = "podman") -> None:
        self.limits = limits or ShellLimits()
        self.podman = shutil.which(podman)
        if self.podman is None:
            raise AsyncRLError("swe env: a task names an image, and podman is not installed (apt-get install podman "
                               "runc), or set env.kwargs.runtime: namespace")
        self.conf_dir = tempfile.mkdtemp(prefix="async-rl-podman-")
        self.conf = os.path.join(self.conf_dir, "containers.conf")
        Path(self.conf).write_text(CONTAINERS_CONF.format(runtime=runtime, nofile=max(1024, self.limits.open_files)))
        self.checked: set[str] = set()

    def close(self) -> None:
        shutil.rmtree(self.conf_dir, ignore_errors=True)

    def environ(self) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CONTAINERS_CONF": self.conf,
                "HOME": os.environ.get("HOME", "/root")}

    def for_image(self, image: str) -> ImageShell:
        if image not in self.checked:
            done = subprocess.run([self.podman, "image", "exists", image], env=self.environ(), capture_output=True,
                                  timeout=60)
            if done.returncode != 0:
                raise AsyncRLError(f"swe env: image {image!r} is not in podman's local store (this project pulls "
                                   "nothing: build it, e.g. debootstrap + podman import; docs/environments.md, 'swe')")
            self.checked.add(image)
        return ImageShell(self, image)


class ImageShell:
    def __init__(self, podman: PodmanShell, image: str) -> None:
        self.podman, self.image, self.limits = podman, image, podman.limits

    def run(self, command: str, workdir: str, env: dict[str, str] | None = None, wall_s: float | None = None,
            pass_fds: tuple[int, ...] = (), binds: tuple[str, ...] = (), readonly: bool = False) -> ShellResult:
        wall_s = wall_s or self.limits.wall_s
        name = "async-rl-swe-" + secrets.token_hex(6)
        workdir = os.path.realpath(workdir)
        renumber = {str(fd): str(3 + i) for i, fd in enumerate(pass_fds)}
        variables = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/tmp",
                     "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        variables.update({k: renumber.get(v, v) for k, v in (env or {}).items()})
        argv = [self.podman.podman, "run", "--rm", "--name", name, "--network=none", "--read-only",
                "--tmpfs", "/tmp:rw,size=64m", "--cap-drop=all", "--security-opt=no-new-privileges",
                f"--memory={self.limits.memory_mb}m", f"--pids-limit={self.limits.nproc}",
                "-v", f"{workdir}:{workdir}:{'ro' if readonly else 'rw'}", "-w", workdir,
                *[a for b in binds for a in ("-v", f"{os.path.realpath(b)}:{os.path.realpath(b)}:ro")],
                *[a for k, v in variables.items() for a in ("-e", f"{k}={v}")],
                *(["--preserve-fds", str(len(pass_fds))] if pass_fds else []),
                self.image, "bash", "-c", command]
        started = time.monotonic()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=self.podman.environ(), pass_fds=(), preexec_fn=_fds_from_3(pass_fds),
                                close_fds=False)
        output, dropped, timed_out = bytearray(), 0, False
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(proc.stdout, selectors.EVENT_READ)
                while True:
                    left = started + wall_s - time.monotonic()
                    if left <= 0:
                        timed_out = True
                        break
                    if not sel.select(timeout=min(left, 0.1)):
                        continue
                    chunk = os.read(proc.stdout.fileno(), 65536)
                    if not chunk:
                        break
                    room = max(0, self.limits.output_chars * 4 - len(output))
                    output += chunk[:room]
                    dropped += len(chunk) - min(room, len(chunk))
        finally:
            if timed_out or proc.poll() is None:
                subprocess.run([self.podman.podman, "rm", "-f", "-t", "0", name], env=self.podman.environ(),
                               capture_output=True, timeout=60)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            proc.stdout.close()
        return ShellResult(None if timed_out else proc.returncode, output.decode("utf-8", "replace"), dropped,
                           timed_out, time.monotonic() - started,
                           ["podman", "netns", "mountns", "pidns", "read-only-root", "cap-drop"], [])


def _fds_from_3(fds: tuple[int, ...]):
    """In podman's child, before exec: `fds` as 3, 4, ... (what --preserve-fds hands the container); the rest
    closed."""

    def arrange() -> None:
        moved = [os.dup(fd) for fd in fds]  # first out of the way of 3, 4, ...
        for i, fd in enumerate(moved):
            os.dup2(fd, 3 + i)  # dup2 leaves the new descriptor inheritable
        os.closerange(3 + len(fds), 65536)

    return arrange
