"""The directory of a local run: a fresh one for each run (`runs/local`, then `runs/local-2`, ...; never over an
earlier run) with its local endpoints, created with its logs/ and config.yaml before any role starts."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import msgspec

from async_rl.config import Config
from async_rl.config_load import dump_config
from async_rl.errors import ConfigError
from async_rl.security import create_keys, insecure_endpoints

log = logging.getLogger("launch.rundir")


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _local_endpoint(endpoint: str, socket_path: Path) -> str:
    """`auto` (or a configured loopback port that is taken) becomes a Unix socket in the run directory: unlike a
    "free" port, no other run on the machine can take it between now and the bind."""
    loopback = endpoint.startswith("tcp://127.0.0.1:")
    if endpoint != "auto" and (not loopback or _port_free("127.0.0.1", int(endpoint.rsplit(":", 1)[1]))):
        return endpoint
    if len(str(socket_path.resolve())) < 100:  # the limit of a Unix socket path
        replacement = f"ipc://{socket_path.resolve()}"
    else:
        replacement = f"tcp://127.0.0.1:{_free_port()}"
    if endpoint != "auto":
        log.info("%s is in use; using %s", endpoint, replacement)
    return replacement


def fresh_run_name(config: Config) -> str:
    """run.name, or the first of `<name>-2`, `-3`, ... that names no directory under run.dir yet."""
    name, n = config.run.name, 1
    while (Path(config.run.dir) / name).exists():
        n += 1
        name = f"{config.run.name}-{n}"
    return name


def fresh_run_dir(config: Config) -> Config:
    """Never write over an earlier run: `runs/local` becomes `runs/local-2`, `-3`, ..."""
    name = fresh_run_name(config)
    run_dir = Path(config.run.dir) / name
    replay = msgspec.structs.replace(
        config.replay, endpoint=_local_endpoint(config.replay.endpoint, run_dir / "replay.sock")
    )
    learner = msgspec.structs.replace(
        config.learner, publish_endpoint=_local_endpoint(config.learner.publish_endpoint, run_dir / "weights.sock")
    )
    run = msgspec.structs.replace(config.run, name=name)
    return msgspec.structs.replace(config, run=run, replay=replay, learner=learner)


def keys_for_loopback(config: Config) -> Config:
    """A fresh run whose `auto` endpoint fell back to a loopback TCP port (a run directory path too long for a Unix
    socket) would be refused there in the clear (async_rl/security.py `check_transport`): it gets CURVE keys of its
    own in `<run dir>/curve`, a pair per worker, readable by this user only."""
    exposed = insecure_endpoints(config.security.curve_dir, (config.replay.endpoint, config.learner.publish_endpoint))
    if not exposed or config.security.insecure:
        return config
    directory = config.run_dir / "curve"
    try:
        create_keys(directory, config.rollout.workers)
        directory.chmod(0o700)
    except OSError as exc:
        raise ConfigError(f"run.dir: cannot write the run's CURVE keys in {directory}: {exc}") from None
    log.info("%s is loopback TCP: the run's sockets use CURVE keys in %s",
             ", ".join(exposed), directory)
    return msgspec.structs.replace(config, security=msgspec.structs.replace(config.security, curve_dir=str(directory)))


def create_run_dir(config: Config, resume: bool) -> Path:
    """The run directory with its logs/ (a resumed run's exist already) and the config every role reads; returns
    the config's path."""
    run_dir = config.run_dir
    try:
        (run_dir / "logs").mkdir(parents=True, exist_ok=resume)
    except OSError as exc:
        raise ConfigError(f"run.dir: cannot create the run directory {run_dir}: {exc}") from None
    config_path = run_dir / "config.yaml"
    dump_config(config, config_path)
    return config_path
