"""What `async-rl train --ray` checks and makes before any role starts (launch/ray_run.py): a run directory every
node can see, the cluster at ADDRESS (or a clear error within seconds), room on it for every role (or an error naming
what was asked and what the nodes have, never a pending placement), and the run's CURVE keys."""

from __future__ import annotations

import logging
import socket
import tempfile
from pathlib import Path

from async_rl.config import Config
from async_rl.errors import AsyncRLError, ConfigError
from async_rl.security import create_keys, role_files, worker_identity


def check_ray_config(config: Config) -> None:
    """What `--ray` refuses before reaching the cluster: a run directory that the nodes would each resolve in their
    own working directory."""
    if not Path(config.run.dir).is_absolute():
        raise ConfigError(f"run.dir: {config.run.dir!r} is a relative path; under --ray every node writes the run "
                          "directory, so it must be an absolute path on storage every node mounts (e.g. "
                          "run.dir=/mnt/shared/runs; docs/deploy.md#ray)")


def connect(address: str, timeout_s: float) -> None:
    """ray.init at `address` (`auto`: the cluster this process runs in; HOST[:PORT] a head's GCS; ray://...), or an
    AsyncRLError within `timeout_s` that says no cluster answers there."""
    import ray

    fix = ("start one with `ray start --head` and pass its HOST:6379, or `auto` inside the cluster "
           "(docs/deploy.md#ray)")
    if address != "auto" and not address.startswith("ray://"):
        host, _, port = address.rpartition(":") if ":" in address else (address, "", "6379")
        try:
            socket.create_connection((host, int(port)), timeout=timeout_s).close()
        except (OSError, ValueError) as exc:
            raise AsyncRLError(f"--ray {address}: no Ray cluster answers there ({exc}); {fix}") from None
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False,
                 configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise AsyncRLError(f"--ray {address}: cannot join a Ray cluster there: {exc}; {fix}") from None


def _resources(nodes: list[dict], key: str) -> list[float]:
    return [node["Resources"].get(key, 0.0) for node in nodes]


def check_resources(config: Config) -> None:
    """Refuse, naming what is asked and what the cluster has, a run whose actors cannot all be placed on the live
    nodes (Ray would leave them pending for ever)."""
    import ray

    r, workers = config.ray, config.rollout.workers
    nodes = [node for node in ray.nodes() if node["Alive"]]
    have = {key: _resources(nodes, key) for key in ("CPU", "GPU")}
    bundle = {"CPU": r.learner_cpus, "GPU": r.learner_gpus}
    asked = {"CPU": r.replay_cpus + r.learner_ranks * r.learner_cpus + workers * r.rollout_cpus,
             "GPU": r.learner_ranks * r.learner_gpus + workers * r.rollout_gpus}
    said = (f"the run asks for {asked['CPU']:g} CPUs and {asked['GPU']:g} GPUs (replay {r.replay_cpus:g} CPU; "
            f"learner {r.learner_ranks} rank(s) x {r.learner_cpus:g} CPU, {r.learner_gpus:g} GPU, "
            f"{r.learner_placement}; {workers} rollout worker(s) x {r.rollout_cpus:g} CPU, {r.rollout_gpus:g} GPU)")
    has = (f"the cluster has {len(nodes)} node(s) with {sum(have['CPU']):g} CPUs and {sum(have['GPU']):g} GPUs "
           f"(per node: CPUs {[round(c, 2) for c in have['CPU']]}, GPUs {[round(g, 2) for g in have['GPU']]})")
    fix = "add nodes, or lower ray.*_cpus / ray.*_gpus, ray.learner_ranks or rollout.workers"
    if any(asked[key] > sum(have[key]) + 1e-9 for key in asked):
        raise AsyncRLError(f"not enough resources on the Ray cluster: {said}, but {has}; {fix}")
    fits = sum(1 for i in range(len(nodes)) if all(have[key][i] + 1e-9 >= bundle[key] for key in bundle))
    one_node = any(all(have[key][i] + 1e-9 >= r.learner_ranks * bundle[key] for key in bundle)
                   for i in range(len(nodes)))
    wanted = {"STRICT_SPREAD": fits >= r.learner_ranks, "STRICT_PACK": one_node}.get(r.learner_placement, fits > 0)
    if not wanted:
        raise AsyncRLError(f"the learner's placement group cannot be placed: {said}; {r.learner_placement} needs "
                           f"{'one node per rank' if r.learner_placement == 'STRICT_SPREAD' else 'a node'} with room "
                           f"for its bundle(s), but {has}; {fix}")


def curve_keys(config: Config) -> dict[str, dict[str, bytes]] | None:
    """Fresh CURVE keys for every identity of the run (made here, never written to the run directory): identity
    -> the files it reads (security.role_files) -> their bytes. None when the config names its own keys
    (security.curve_dir, on every node) or runs in the clear (security.insecure)."""
    if config.security.curve_dir is not None or config.security.insecure:
        return None
    workers = [worker_identity(i) for i in range(config.rollout.workers)]
    with tempfile.TemporaryDirectory(prefix="async-rl-keys-") as directory:
        create_keys(directory, config.rollout.workers)
        return {identity: {name: (Path(directory) / name).read_bytes()
                           for name in role_files(identity, workers if identity in ("replay", "learner") else ())}
                for identity in ("replay", "learner", *workers)}
