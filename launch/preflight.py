"""What `async-rl train` can refuse before creating anything, and before importing torch (seconds on a busy
machine) unless a device is set to cuda: a missing or invalid model.path, cuda without a GPU, missing CURVE keys,
a run directory that cannot be created. Each refusal is a ConfigError naming the path or the key."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from async_rl.config import Config, configured_model_path
from async_rl.errors import ConfigError
from async_rl.security import load_keys, worker_identity
from launch.rundir import fresh_run_dir


def preflight(config: Config, resume: bool = False) -> None:
    """Raises ConfigError naming the path or the key."""
    configured_model_path(config)
    _check_devices(config)
    workers = [worker_identity(i) for i in range(config.rollout.workers)]
    for identity in ("replay", "learner", *workers):  # security.curve_dir: every key is there (all roles run here)
        load_keys(config.security.curve_dir, identity)
    if not resume:
        _check_run_dir_creatable(fresh_run_dir(config).run_dir)


def _check_run_dir_creatable(run_dir: Path) -> None:
    """Fail at once, naming the path, if the run directory cannot be created (before anything is started).
    Probes the nearest existing ancestor by creating and removing a directory in it (os.access says yes to root
    on a read-only mount)."""
    existing = run_dir.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"run.dir: cannot create the run directory {run_dir}: {existing} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".async-rl-probe-", dir=existing))
    except OSError as exc:
        raise ConfigError(
            f"run.dir: cannot create the run directory {run_dir}: {existing} is not writable ({exc.strerror})"
        ) from None


def _check_devices(config: Config) -> None:
    """learner.device or rollout.device (torch engine) set to cuda on a machine where torch sees no GPU: refused
    here, before any role starts (a rollout worker that found out itself would be restarted to the same error).
    torch is imported only when cuda is asked for."""
    asked = [("learner.device", config.learner.device)]
    if config.rollout.engine == "torch":
        asked.append(("rollout.device", config.rollout.device))
    asked = [(key, value) for key, value in asked if value == "cuda"]
    if asked:
        import torch

        from async_rl.model import resolve_device

        for key, value in asked:
            resolve_device(value, key, torch.cuda.is_available())
