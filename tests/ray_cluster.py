"""A real Ray cluster on one machine for tests/test_ray.py: a head and worker nodes, each `ray start --block` in its
own network namespace (tests/netns.py) with its own address, as separate machines would be. Every node shares one
Ray temp dir of this cluster's own (the session's files, never /tmp/ray, so other Ray users of the machine are left
alone); `close` ends each node's `ray start` process and then any process of this session that is left, by pid.

Ray's health checks run every second (RAY_health_check_period_ms; Ray's default is 3 s) so that a node whose raylet
was killed (its port refuses at once) is declared dead in about 4 s rather than 15: the tests kill one. Their
timeout stays Ray's own (10 s), so a raylet slow to answer on a loaded machine is not declared dead. Ray's memory
monitor is off (RAY_memory_monitor_refresh_ms=0): it counts the whole machine's memory, and on a machine shared with
other jobs it killed the run's actors for memory those jobs used."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
from netns import Network

ROOT = Path(__file__).resolve().parents[1]
GCS_PORT = 6379
DASHBOARD_PORT = 8265


def node_env(**extra: str) -> dict[str, str]:
    """What every node (and so every actor and role process) runs with: this checkout first on the path, one thread
    per process, Ray's health checks shortened."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0",
               PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
               RAY_health_check_initial_delay_ms="1000", RAY_health_check_period_ms="1000",
               RAY_health_check_failure_threshold="4", RAY_memory_monitor_refresh_ms="0", **extra)
    for key in ("RAY_ADDRESS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


class RayCluster:
    """`RayCluster({"head": cpus, "node-1": cpus, ...}, logs).open()`: the first host is the head (with the dashboard
    and the job server); `head_address` is its GCS (HOST:6379), `dashboard` its job API's URL."""

    def __init__(self, cpus: dict[str, float], logs: Path, head_command: str = "ray start --head --port=6379",
                 worker_command: str = "ray start --address=HEAD:6379") -> None:
        self.cpus, self.logs = dict(cpus), logs
        self.head_command, self.worker_command = head_command.split(), worker_command.split()  # HEAD: its address
        self.net = Network({host: [] for host in cpus})
        self.temp_dir = Path(f"/tmp/arl-ray-{uuid.uuid4().hex[:8]}")
        self.nodes: dict[str, subprocess.Popen] = {}
        self.head = next(iter(cpus))

    @property
    def head_address(self) -> str:
        return f"{self.net.address(self.head)}:{GCS_PORT}"

    @property
    def dashboard(self) -> str:
        return f"http://{self.net.address(self.head)}:{DASHBOARD_PORT}"

    def in_namespace(self, host: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.net.ns(host), *argv]

    def open(self, timeout_s: float = 120) -> RayCluster:
        self.net.open()
        self.logs.mkdir(parents=True, exist_ok=True)
        try:
            for host in self.cpus:  # one at a time: on a loaded 2-core machine a burst of joins overloads the GCS
                for attempt in range(3):
                    if self._start(host, attempt, time.monotonic() + timeout_s):
                        break
                else:
                    raise RuntimeError(f"ray node {host} did not start (3 tries):\n"
                                       f"{(self.logs / f'ray-{host}.log').read_text(errors='replace')[-3000:]}")
        except BaseException:
            self.close()
            raise
        return self

    def _start(self, host: str, attempt: int, deadline: float) -> bool:
        """Start `host`'s node; False if its `ray start` gave up (Ray waits a fixed 30 s for a joining raylet to
        register, which a machine at load 15 sometimes exceeds: it is then started again)."""
        address, cpus = self.net.address(host), self.cpus[host]
        common = [f"--node-ip-address={address}", f"--num-cpus={cpus:g}", "--num-gpus=0",
                  "--object-store-memory=80000000", "--block", "--disable-usage-stats"]
        if host == self.head:  # the command as given, then what this machine needs (its own temp dir, ...)
            argv = [*self.head_command, f"--temp-dir={self.temp_dir}", "--include-dashboard=true",
                    "--dashboard-host=0.0.0.0", f"--dashboard-port={DASHBOARD_PORT}", *common]
        else:
            argv = [part.replace("HEAD", self.net.address(self.head)) for part in self.worker_command] + common
        log = self.logs / f"ray-{host}.log"
        with log.open("a") as out:
            out.write(f"--- attempt {attempt + 1}\n")
            out.flush()
            self.nodes[host] = subprocess.Popen(self.in_namespace(host, argv), stdout=out, stderr=subprocess.STDOUT,
                                                env=node_env(), start_new_session=True)
        started = f"--- attempt {attempt + 1}\n"
        while time.monotonic() < deadline:
            if "Ray runtime started" in log.read_text(errors="replace").rsplit(started, 1)[-1]:
                return True
            if self.nodes[host].poll() is not None:
                return False
            time.sleep(0.5)
        raise RuntimeError(f"ray node {host} did not start in time:\n{log.read_text(errors='replace')[-3000:]}")

    def raylet(self, host: str) -> psutil.Process:
        """The raylet of `host` (a child of its `ray start` process)."""
        for child in psutil.Process(self.nodes[host].pid).children(recursive=True):
            if child.name() == "raylet":
                return child
        raise RuntimeError(f"{host}: no raylet among its ray start's children")

    def session_processes(self) -> list[psutil.Process]:
        """Every process that names this cluster's temp dir on its command line (Ray's daemons and workers)."""
        found = []
        for process in psutil.process_iter(["cmdline"]):
            if any(str(self.temp_dir) in part for part in process.info["cmdline"] or []):
                found.append(process)
        return found

    def close(self) -> None:
        """SIGKILL every node's processes (a test cluster has nothing to drain; `ray start`'s SIGTERM drains for up
        to 30 s), then whatever of this session is left; then the namespaces and the temp dir."""
        for process in self.nodes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        for process in self.session_processes():
            with contextlib.suppress(psutil.Error):
                process.kill()
        self.net.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
