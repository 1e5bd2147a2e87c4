"""The DeepSpeed engine the learner trains with: process group, model, optimizer, full weights, checkpoints.

On a laptop or CI this is one CPU process with gloo and no launcher; under torchrun (or the deepspeed launcher)
every rank runs the same code and DeepSpeed averages gradients across ranks.
"""

from __future__ import annotations

import copy
import datetime
import logging
import os
import random
import re
import shutil
from pathlib import Path

import deepspeed
import numpy as np
import torch
import torch.distributed as dist

from async_rl.config import Config
from async_rl.errors import AsyncRLError
from async_rl.model import load_model, wait_for_model_dir

log = logging.getLogger("async_rl.learner")


class CheckpointError(AsyncRLError):
    """A checkpoint that exists but cannot be resumed from."""

# Rank 0 may wait a long time for the replay service to have items while the other ranks sit in a broadcast;
# the default collective timeout (10 min) would kill a healthy but idle run.
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=24)


def init_distributed() -> None:
    """Join (or, without a launcher, create) the process group; single process gets a private loopback port."""
    if dist.is_initialized():
        return
    # The shared-memory comm op would be JIT-compiled (minutes) on CPU for a world > 1; gloo is enough for us.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if "RANK" not in os.environ:
        # No launcher: a world of one. An in-memory store needs no port, so nothing can race us for one (a free
        # port picked here and bound later was taken by another process often enough to fail CI runs).
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=COLLECTIVE_TIMEOUT)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False, timeout=COLLECTIVE_TIMEOUT)


def leave_distributed() -> None:
    """Several ranks: leave together, so no rank exits with the group's threads still talking to a live peer."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def deepspeed_config(config: Config) -> dict:
    learner = config.learner
    ds_config: dict = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": learner.zero_stage},
        "wall_clock_breakdown": False,
        "steps_per_print": 10**9,  # DeepSpeed's own progress lines; our metrics say it better
    }
    if learner.grad_clip > 0:
        ds_config["gradient_clipping"] = learner.grad_clip
    return ds_config


def build_engine(config: Config) -> tuple[deepspeed.DeepSpeedEngine, torch.nn.Module | None]:
    """The trained engine (fp32, torch AdamW) and, when algo.kl_beta > 0, a frozen copy of the initial policy."""
    init_distributed()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    torch.manual_seed(config.run.seed)
    torch.set_num_threads(config.run.threads_per_process)
    model = load_model(wait_for_model_dir(config))
    parameters = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions them away
    reference = None
    if config.algo.kl_beta > 0:
        reference = copy.deepcopy(model).eval().requires_grad_(False)
    # torch's AdamW, not FusedAdam: the fused op would be JIT-built and buys nothing on CPU.
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learner.lr, weight_decay=config.learner.weight_decay)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(config))
    engine.train()
    log.info(
        "DeepSpeed engine ready: ZeRO-%d, %d rank(s), %d parameters",
        config.learner.zero_stage, world_size(), parameters,
    )
    return engine, reference


def full_state_dict(engine: deepspeed.DeepSpeedEngine) -> dict[str, torch.Tensor] | None:
    """The whole model's weights on rank 0 (None elsewhere). Collective at ZeRO-3: every rank must call it."""
    if engine.zero_optimization_stage() < 3:
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()} if rank() == 0 else None
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        if rank() != 0:
            return None
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def save_checkpoint(engine: deepspeed.DeepSpeedEngine, directory: Path, version: int, keep: int | None = None) -> None:
    """DeepSpeed checkpoint (model, optimizer, ZeRO shards) tagged `v{version}`, with the version and the torch,
    numpy and python RNG states in its client state; every rank must call it. DeepSpeed points `latest` at it
    only once it is written, so a learner killed mid-save resumes from the one before. `keep`: delete all but the
    newest `keep` checkpoints (rank 0)."""
    engine.save_checkpoint(str(directory), tag=f"v{version}", client_state={"version": version, "rng": _rng_state()})
    log.info("checkpoint v%d written to %s", version, directory)
    if keep is not None and rank() == 0:
        tags = sorted((p for p in directory.iterdir() if p.is_dir() and re.fullmatch(r"v\d+", p.name)),
                      key=lambda p: int(p.name[1:]))
        for old in tags[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(directory: Path) -> int | None:
    """The version of the checkpoint DeepSpeed's `latest` names in `directory`, or None (no checkpoint)."""
    try:
        tag = (directory / "latest").read_text().strip()
    except OSError:
        return None
    if not re.fullmatch(r"v\d+", tag) or not (directory / tag).is_dir():
        raise CheckpointError(f"{directory / 'latest'} names {tag!r}, which is not a checkpoint in {directory}")
    return int(tag[1:])


def load_checkpoint(engine: deepspeed.DeepSpeedEngine, directory: Path) -> int | None:
    """Restore the latest checkpoint in `directory` (weights, optimizer, RNG states); its version, or None when
    there is none (a fresh start). Every rank must call it."""
    version = latest_checkpoint(directory)
    if version is None:
        return None
    path, client_state = engine.load_checkpoint(str(directory), tag=f"v{version}")
    if path is None or client_state.get("version") != version:
        raise CheckpointError(f"checkpoint v{version} in {directory} could not be loaded")
    rng = client_state["rng"]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    log.info("resumed from checkpoint v%d in %s", version, directory)
    return version
