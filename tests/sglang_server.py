"""Real SGLang servers for tests: build (or reuse) the isolated venv, start servers, stop them by process group;
the pool of two that the session shares (tests/conftest.py's `pool` fixture).

The server runs in its own venv (scripts/build_sglang_env.sh, cached under ~/.cache/async-rl) with that venv's
python; nothing of it is imported into the test process, which only speaks HTTP to it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import httpx

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def under_ci() -> bool:
    """Whether the tests run under CI: env CI set to true (what CI services set, and .ci/run itself), 1, yes or on."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes", "on")


def build_venv(script: str = "build_sglang_env.sh") -> tuple[Path | None, str]:
    """The venv path, or None and why it could not be built (SGLang's build takes 1-2 min when missing,
    build_vllm_env.sh's about 5)."""
    try:
        done = subprocess.run(["bash", str(SCRIPTS / script)], capture_output=True, text=True, timeout=1200)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"scripts/{script} could not run: {exc}"
    if done.returncode != 0:
        return None, f"scripts/{script} failed: {done.stderr.strip()[-1500:]}"
    return Path(done.stdout.strip().splitlines()[-1]), ""


@dataclass
class SGLangServer:
    START: ClassVar[str] = "start_sglang_server.py"
    NAME: ClassVar[str] = "sglang"
    ARGS: ClassVar[tuple[str, ...]] = ()  # more arguments of its start script
    url: str
    pgid: int
    log: Path
    model_dir: Path
    port: int

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Signal the server's process group and wait until every process of it is gone."""
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                os.killpg(self.pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        os.killpg(self.pgid, signal.SIGKILL)

    def alive(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        return True

    def load(self, model_path: Path, version: int) -> None:
        """Load weights from an HF directory and label them `version` (used to reset a server between tests)."""
        reply = httpx.post(self.url + "/update_weights_from_disk", timeout=60,
                           json={"model_path": str(model_path), "weight_version": str(version)})
        reply.raise_for_status()

    def model_info(self) -> dict:
        return httpx.get(self.url + "/get_model_info", timeout=10).json()

    def requests_in_flight(self) -> int:
        """Requests the server is running or has queued (its /v1/loads, as its scheduler counts them)."""
        loads = httpx.get(self.url + "/v1/loads", params={"include": "core"}, timeout=10).json()["loads"]
        return sum(load.get("num_running_reqs", 0) + load.get("num_waiting_reqs", 0) for load in loads)

    def wait_for_requests(self, timeout_s: float = 30.0) -> None:
        """Until the server has requests in flight (what a test that must interrupt generation waits for, in place
        of a fixed sleep that raced it)."""
        deadline = time.monotonic() + timeout_s
        while self.requests_in_flight() == 0:
            assert time.monotonic() < deadline, f"{self.url}: no request in flight after {timeout_s} s"
            time.sleep(0.02)


def start_servers(venv: Path, model_dir: Path, ports: list[int], log_dir: Path,
                  kind: type[SGLangServer] = SGLangServer) -> list[SGLangServer]:
    """Start one server per port concurrently (`kind.START`: its start script); return once every one serves."""
    launches = [
        subprocess.Popen(
            [sys.executable, str(SCRIPTS / kind.START), "--model-path", str(model_dir),
             "--port", str(port), "--venv", str(venv), "--log", str(log_dir / f"{kind.NAME}-{port}.log"),
             "--timeout", "240", *kind.ARGS],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for port in ports
    ]
    servers, errors = [], []
    for port, launch in zip(ports, launches, strict=True):
        out, err = launch.communicate(timeout=300)
        if launch.returncode == 0:
            info = json.loads(out.strip().splitlines()[-1])
            servers.append(kind(info["url"], info["pgid"], Path(info["log"]), model_dir, port))
        else:
            errors.append(f"port {port}: {err[-2000:]}")
    if errors:
        for server in servers:
            server.stop()
        raise RuntimeError(f"{kind.NAME} server(s) did not start:\n" + "\n".join(errors))
    return servers


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Pool:
    """The session's servers; a test that kills one gets it back at the next `reset`."""

    def __init__(self, venv: Path, model_dir: Path, log_dir: Path, kind: type[SGLangServer] = SGLangServer,
                 count: int = 2) -> None:
        self.venv, self.model_dir, self.log_dir, self.kind = venv, model_dir, log_dir, kind
        self.servers = start_servers(venv, model_dir, [free_port() for _ in range(count)], log_dir, kind)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def restart_dead(self) -> None:
        for index, server in enumerate(self.servers):
            if not server.alive():
                server.stop(signal.SIGKILL)
                self.servers[index] = start_servers(self.venv, self.model_dir, [server.port], self.log_dir,
                                                    self.kind)[0]

    def reset(self) -> None:
        self.restart_dead()
        for server in self.servers:
            server.load(self.model_dir, 0)


# The keys of `KeyedSGLangServer`: what a rollout worker holds (generation) and what the learner holds (admin).
API_KEY, ADMIN_KEY = "worker-generates", "learner-administers"


@dataclass
class KeyedSGLangServer(SGLangServer):
    """A server started closed, as docs/sglang.md#keys and #tls start one: `--api-key` and `--admin-api-key` (its
    weight, pause and abort routes take the admin key alone, generation and reads the API key alone) and TLS with a
    certificate for 127.0.0.1 signed by the test CA `CA` (a class of it is made by `keyed_tls_server`)."""

    CA: ClassVar[str] = ""  # the CA certificate file the clients verify the server with

    def load(self, model_path: Path, version: int) -> None:
        reply = httpx.post(self.url + "/update_weights_from_disk", timeout=60, headers=bearer(ADMIN_KEY),
                           verify=self.CA, json={"model_path": str(model_path), "weight_version": str(version)})
        reply.raise_for_status()

    def model_info(self) -> dict:
        return httpx.get(self.url + "/get_model_info", timeout=10, headers=bearer(API_KEY), verify=self.CA).json()


def make_test_certificates(cert_dir: Path) -> tuple[str, tuple[str, ...]]:
    """A fresh test CA (trustme) and a server certificate for 127.0.0.1 written to `cert_dir` (ca.pem, cert.pem,
    key.pem): the CA file the clients verify with, and the server flags that serve TLS with them (`--ssl-ca-certs`
    too: the start scripts' readiness check trusts that CA)."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = {name: cert_dir / f"{name}.pem" for name in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    cert.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    cert.private_key_pem.write_to_path(str(paths["key"]))
    return str(paths["ca"]), ("--ssl-keyfile", str(paths["key"]), "--ssl-certfile", str(paths["cert"]),
                              "--ssl-ca-certs", str(paths["ca"]))


def keyed_tls_server(cert_dir: Path) -> type[KeyedSGLangServer]:
    """The `KeyedSGLangServer` class whose servers use a fresh test CA written to `cert_dir`
    (`make_test_certificates`)."""
    ca, tls = make_test_certificates(cert_dir)
    args = ("--", "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY, *tls)
    return type("KeyedTLSServer", (KeyedSGLangServer,), {"ARGS": args, "CA": ca})


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
