"""One role of a run on a Ray node (launch/ray_run.py places them): an actor that runs `async-rl ROLE --config
<run dir>/config.yaml` (the command a pod runs) as its child process, with the CURVE keys the driver handed it written
to a private directory on its node, and that dies when the child fails so that Ray restarts it (`max_restarts`), on
another node if its own is gone. Imports no torch: the child does."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import ray

from async_rl.errors import CONFIG_EXIT_CODE
from launch.forkserver import die_with_parent


def free_port(host: str) -> int:
    """A port free on `host` now (the role binds it a moment later; another process could take it first, and the
    role then fails and is restarted)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def interface_of(address: str) -> str | None:
    """The network interface holding `address` (gloo and NCCL bind to an interface, not an address)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addresses):
            return name
    return None


class RoleActor:
    """`name` (replay, learner, learner-1, rollout-3, evaluate) running `argv` on this node. `keys`: file name ->
    bytes of the CURVE key files this role reads (security.role_files), or None (the config's own curve_dir, or
    none). `endpoint`: the config key this role binds on this node (`replay.endpoint`, the learner rank 0's
    `learner.publish_endpoint`), given a free port here unless
    a restarted actor on the same node finds its old one in `<run dir>/ray/<name>.endpoint`. `start`: False for
    a learner rank, which `start` starts once the driver knows every rank's node."""

    def __init__(self, name: str, argv: list[str], config_path: str, env: dict[str, str],
                 keys: dict[str, bytes] | None = None, endpoint: str | None = None, start: bool = True,
                 stdout_path: str | None = None) -> None:
        self.name, self.argv, self.config_path = name, list(argv), Path(config_path)
        self.env, self.stdout_path = dict(env), stdout_path
        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.overrides: list[str] = []
        self.key_dir: tempfile.TemporaryDirectory | None = None
        if keys is not None:
            self.key_dir = tempfile.TemporaryDirectory(prefix=f"async-rl-{name}-curve-")
            os.chmod(self.key_dir.name, 0o700)
            for file, content in keys.items():
                path = Path(self.key_dir.name) / file
                path.write_bytes(content)
                path.chmod(0o600)
            self.overrides.append(f"security.curve_dir={self.key_dir.name}")
        self.endpoint = None
        if endpoint is not None:
            self.endpoint = self._endpoint_here()
            self.overrides.append(f"{endpoint}={self.endpoint}")
        self.process: subprocess.Popen | None = None
        self.stopping = False
        self.started_at = time.time()
        if start:
            self.start([], {})

    def _endpoint_here(self) -> str:
        """tcp://<this node>:<port>: the port this role had on this node before a restart if it is still free
        (its peers keep their endpoint), else a free one; remembered in the run directory."""
        record = self.config_path.parent / "ray" / f"{self.name}.endpoint"
        previous = record.read_text().strip() if record.exists() else ""
        if previous.startswith(f"tcp://{self.node_ip}:"):
            with socket.socket() as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds: TIME_WAIT is no bar
                try:
                    probe.bind((self.node_ip, int(previous.rsplit(":", 1)[1])))
                    return previous
                except OSError:
                    pass
        endpoint = f"tcp://{self.node_ip}:{free_port(self.node_ip)}"
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(endpoint + "\n")
        return endpoint

    def place(self) -> dict:
        """Where this actor runs, and (for a learner rank 0) a free port there for torch.distributed's store."""
        return {"node_ip": self.node_ip, "node_id": self.node_id, "interface": interface_of(self.node_ip),
                "free_port": free_port(self.node_ip), "endpoint": self.endpoint}

    def start(self, overrides: list[str], env: dict[str, str]) -> None:
        """Start the role's process: the config's path, this actor's overrides and `overrides`, `env` on top of the
        actor's. Its output goes to <run dir>/logs/<name>.log; it gets SIGTERM when this actor dies."""
        log_path = self.config_path.parent / "logs" / f"{self.name}.log"
        command = [sys.executable, "-m", "launch.cli", *self.argv, "--config", str(self.config_path),
                   *self.overrides, *overrides]
        parent = os.getpid()
        with open(log_path, "ab") as log:
            out = open(self.stdout_path, "wb") if self.stdout_path else log  # noqa: SIM115 - closed below
            try:
                self.process = subprocess.Popen(command, stdout=out, stderr=log, env={**os.environ, **self.env, **env},
                                                cwd=str(self.config_path.parent), start_new_session=True,
                                                preexec_fn=lambda: die_with_parent(parent))
            finally:
                if out is not log:
                    out.close()
        threading.Thread(target=self._watch, name=f"watch-{self.name}", daemon=True).start()

    def _watch(self) -> None:
        """A role that failed ends this actor's process, so Ray starts the actor (and the role) again within its
        max_restarts. A clean exit, or a config error (it would fail the same way again), is left for the driver
        to read in `info`."""
        assert self.process is not None
        code = self.process.wait()
        if code not in (0, CONFIG_EXIT_CODE) and not self.stopping:
            os._exit(1)

    def info(self) -> dict:
        """This actor's node and process id, and its role's exit code (None while it runs or before `start`)."""
        code = None if self.process is None else self.process.poll()
        return {"node_ip": self.node_ip, "node_id": self.node_id, "pid": os.getpid(), "exit": code,
                "endpoint": self.endpoint, "started_at": self.started_at}

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM the role (the learner writes its summary, a worker delivers what it sent), SIGKILL after
        `grace_s`; its exit code."""
        self.stopping = True
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode
