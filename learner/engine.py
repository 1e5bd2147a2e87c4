"""The DeepSpeed engine the learner trains with: device, precision, process group, model, optimizer, full weights,
checkpoints.

On a laptop or CI this is one CPU process with gloo, fp32 and no launcher; on GPUs (learner.device auto or cuda)
each rank drives the GPU of its LOCAL_RANK, ranks talk NCCL and train in bf16 with fp32 master weights
(learner.precision auto). Under torchrun (or the deepspeed launcher) every rank runs the same code and DeepSpeed
averages gradients across ranks.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import os
import random
import shutil
from pathlib import Path

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator, set_accelerator
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

from async_rl.errors import ConfigError
from async_rl.model import load_model, resolve_device
from learner import checkpoint, lora
from learner.attention import flash_attn_installed, row_tokens, select_attention, use_attention
from learner.checkpoint import CheckpointError
from learner.settings import EngineSettings

log = logging.getLogger("async_rl.learner")


LORA_FILE = "lora.json"  # in a LoRA run's checkpoint: the adapters' rank, alpha and targets (learner/lora.py)

# Rank 0 may wait a long time for the replay service to have items while the other ranks sit in a broadcast;
# the default collective timeout (10 min) would kill a healthy but idle run.
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=24)


def select_device(learner: EngineSettings, cuda_available: bool) -> str:
    """learner.device resolved: "cuda" or "cpu" (auto: cuda when torch sees a GPU)."""
    return resolve_device(learner.device, "learner.device", cuda_available)


def select_precision(learner: EngineSettings, device: str, bf16_supported: bool) -> str:
    """learner.precision resolved: "bf16" or "fp32" (auto: bf16 on a GPU that supports it)."""
    if learner.precision == "bf16" and not (device == "cuda" and bf16_supported):
        raise ConfigError(
            f"learner.precision: bf16 needs a CUDA device that supports it; this learner runs on {device}"
            + (" whose GPU has no bf16" if device == "cuda" else "") + " (set auto or fp32)"
        )
    if learner.precision == "auto":
        return "bf16" if device == "cuda" and bf16_supported else "fp32"
    return learner.precision


def backend_for(device: str) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device == "cuda" else "gloo"


def resolve_hardware(learner: EngineSettings) -> tuple[str, str]:
    """(device, precision) on this machine."""
    cuda = torch.cuda.is_available()
    device = select_device(learner, cuda)
    return device, select_precision(learner, device, cuda and torch.cuda.is_bf16_supported())


def local_gpu(local_rank: int, device_count: int) -> int:
    """The GPU index of the rank with LOCAL_RANK `local_rank` on a node where torch sees `device_count` GPUs: one
    GPU per rank, so a launcher that starts more ranks than the node has GPUs gets an error that says so (CUDA's
    own is "invalid device ordinal", raised from deep inside DeepSpeed)."""
    if not 0 <= local_rank < device_count:
        raise ConfigError(
            f"learner.device: cuda needs one GPU per rank, but LOCAL_RANK is {local_rank} and torch sees "
            f"{device_count} GPU(s) on this node: start at most {device_count} rank(s) per node "
            "(torchrun --nproc_per_node), or set learner.device=cpu"
        )
    return local_rank


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """HF's non-reentrant activation checkpointing, under the name the installed transformers has: 5.x calls it
    activation checkpointing, older releases (and early 5.x) gradient checkpointing."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def init_distributed(device: str = "cpu") -> None:
    """Join (or, without a launcher, create) the process group; a single process needs no port. On CUDA each rank
    first takes the GPU of its LOCAL_RANK (NCCL and DeepSpeed use the current device)."""
    if dist.is_initialized():
        return
    # The shared-memory comm op would be JIT-compiled (minutes) on CPU for a world > 1; gloo is enough for us.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    backend = backend_for(device)
    if device == "cpu" and get_accelerator().device_name() != "cpu":
        # DeepSpeed takes the GPU whenever torch sees one: a CPU learner (learner.device=cpu) on a GPU machine would
        # have its model moved there and each rank's process group bound to the GPU of its LOCAL_RANK.
        set_accelerator(CPU_Accelerator())
    if device == "cuda":
        torch.cuda.set_device(local_gpu(int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()))
    if "RANK" not in os.environ:
        # No launcher: a world of one. An in-memory store needs no port, so nothing can race us for one (a free
        # port picked here and bound later was taken by another process often enough to fail CI runs).
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=COLLECTIVE_TIMEOUT)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False,
                               timeout=COLLECTIVE_TIMEOUT)


def leave_distributed() -> None:
    """Several ranks: leave together, so no rank exits with the group's threads still talking to a live peer."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def clips_itself(learner: EngineSettings, precision: str, ranks: int) -> bool:
    """Whether the learner clips gradients with torch instead of DeepSpeed: in a world of one at ZeRO-0 in fp32,
    where DeepSpeed would still all-reduce the gradient norm over a group of one (5% of a step on the benchmark)."""
    return ranks == 1 and learner.zero_stage == 0 and precision == "fp32" and learner.grad_clip > 0


def deepspeed_config(learner: EngineSettings, precision: str = "fp32", ranks: int = 1) -> dict:
    ds_config: dict = {
        # Nominal sizes: our micro-batches are token-budgeted (learner/pack.py), their number varies per batch, and
        # the loss is scaled by hand (learner/step.py), so DeepSpeed must neither count nor divide by them.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        # backward() only accumulates; step() is the boundary that reduces across ranks and updates, once a batch.
        "managed_gradient_accumulation": False,
        "zero_optimization": {"stage": learner.zero_stage},
        "wall_clock_breakdown": False,
        "steps_per_print": 10**9,  # DeepSpeed's own progress lines; our metrics say it better
    }
    if precision == "bf16":
        # bf16 weights and activations, fp32 master weights and optimizer state. With ZeRO >= 1 the gradients are
        # accumulated over micro-batches in fp32 too; DeepSpeed 0.19 refuses that mix at ZeRO-0 (bf16 accumulation).
        ds_config["bf16"] = {"enabled": True}
        if learner.zero_stage >= 1:
            ds_config["data_types"] = {"grad_accum_dtype": "fp32"}
    # Always set: DeepSpeed's default is 1.0, so leaving it out would clip at 1.0 even with learner.grad_clip 0.
    ds_config["gradient_clipping"] = 0.0 if clips_itself(learner, precision, ranks) else learner.grad_clip
    return ds_config


def build_engine(
    learner: EngineSettings, model_dir: Path,
) -> tuple[deepspeed.DeepSpeedEngine, torch.nn.Module | lora.AdapterOff | None]:
    """The trained engine on the model in `model_dir` (torch AdamW, or SGD under learner.optimizer sgd; fp32, or
    bf16 with fp32 master weights) on learner.device and, when algo.kl_beta > 0, a frozen copy of the initial policy
    on the same device in the same precision. Under learner.lora the model is the peft-wrapped one, only its
    adapters are in the optimizer, and the reference is the same model with its adapter off (learner/lora.py), not a
    copy."""
    device, precision = resolve_hardware(learner)
    init_distributed(device)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    torch.manual_seed(learner.seed)
    torch.set_num_threads(learner.threads_per_process)
    model = load_model(model_dir)
    attention = select_attention(learner.attention, device, flash_attn_installed(), row_tokens(learner.layout))
    use_attention(model, attention)
    parameters = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions them away
    if learner.activation_checkpointing:
        model.config.use_cache = False
        enable_activation_checkpointing(model)
    adapted = lora.lora_on(learner.lora)
    if adapted:
        model = lora.wrap(model, learner.lora)  # A drawn from the run.seed-seeded RNG, B zero
    reference = None
    if learner.kl_beta > 0 and not adapted:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        reference = copy.deepcopy(model).eval().requires_grad_(False).to(device=_local_device(device), dtype=dtype)
    # torch's AdamW with its fused kernel (CPU and CUDA), not DeepSpeed's FusedAdam, which would be JIT-built; on CPU
    # torch's default is a per-tensor Python loop (docs/results.md, "systems": the learner against bare loops
    # with and without it). The update is the same AdamW.
    trained = lora.trainable(model) if adapted else model.parameters()
    if learner.optimizer == "sgd":
        optimizer = torch.optim.SGD(trained, lr=learner.lr, momentum=learner.momentum,
                                    weight_decay=learner.weight_decay)
    else:
        optimizer = torch.optim.AdamW(trained, lr=learner.lr, weight_decay=learner.weight_decay, fused=True)
    ds_config = deepspeed_config(learner, precision, world_size())
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    engine.train()
    if adapted and learner.kl_beta > 0:
        reference = lora.AdapterOff(engine.module)
    if world_size() == 1 and learner.zero_stage == 0:
        # A world of one has nothing to average; DeepSpeed would still flatten every gradient and all-reduce it.
        engine.enable_backward_allreduce = False
    log.info(
        "DeepSpeed engine ready: ZeRO-%d, %d rank(s), %s, %s (%s), %s, attention %s, %d parameters%s%s",
        learner.zero_stage, world_size(), engine.device, precision, backend_for(device),
        type(optimizer).__name__, attention, parameters,
        ", activation checkpointing" if learner.activation_checkpointing else "",
        f", LoRA rank {learner.lora.rank}: {sum(p.numel() for p in lora.trainable(model))} trained" if adapted else "",
    )
    return engine, reference


def _local_device(device: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


def full_state_dict(engine: deepspeed.DeepSpeedEngine, adapters: bool = False) -> dict[str, torch.Tensor] | None:
    """The whole model's weights on rank 0 (None elsewhere), under LoRA merged with the adapter and under the base
    model's key names (learner/lora.py); `adapters` (under LoRA): the adapters' tensors alone, under PEFT's names.
    Collective at ZeRO-3: every rank must call it."""
    if engine.zero_optimization_stage() < 3:
        return _to_cpu(_weights(engine.module, adapters)) if rank() == 0 else None
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        if rank() != 0:
            return None
        return _to_cpu(_weights(engine.module, adapters))


def _weights(module: torch.nn.Module, adapters: bool = False) -> dict[str, torch.Tensor]:
    if not lora.is_adapted(module):
        return module.state_dict()
    return lora.adapter_state_dict(module) if adapters else lora.merged_state_dict(module)


def _to_cpu(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies in host memory (a copy on the GPU would double the weights' footprint there)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in state_dict.items()}


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def save_checkpoint(engine: deepspeed.DeepSpeedEngine, directory: Path, version: int, keep: int | None = None) -> bool:
    """DeepSpeed checkpoint (model, optimizer, ZeRO shards) tagged `v{version}`, with the version and the torch,
    numpy and python RNG states in its client state; every rank must call it. Under LoRA the module state is the
    adapters alone (the frozen base is reloaded from model.path), with the adapters' shape in the client state.
    Rank 0 then records its files' checksums and points `latest` at it (learner/checkpoint.py), so a learner killed
    mid-save resumes from the one before. `keep`: delete all but the newest `keep` checkpoints, and all but the
    newest `keep` set aside as damaged (rank 0: `checkpoint.prune`).
    Returns whether it was written, alike on every rank: one the disk refused (full) is logged naming its
    directory, its files are removed, and `latest` still names the one before."""
    adapted = lora.is_adapted(engine.module)
    tag, failure = directory / f"v{version}", None
    try:
        engine.save_checkpoint(str(directory), tag=f"v{version}", client_state={
            "version": version, "rng": _rng_state(),
        }, exclude_frozen_parameters=adapted, save_latest=False)
    except (OSError, RuntimeError) as exc:  # torch.save says RuntimeError for a write the disk refused
        failure = exc
        if world_size() > 1:
            dist.barrier()  # the ranks that wrote theirs wait in DeepSpeed's last barrier
    if _all_ranks(failure is None) and rank() == 0:
        try:
            if adapted:  # before `latest` points at the tag (in its manifest): read first when resuming
                (tag / LORA_FILE).write_text(json.dumps(lora.signature(engine.module)))
            checkpoint.commit(directory, version)
        except OSError as exc:
            failure = exc
    if not _all_ranks(failure is None):
        _abandon_checkpoint(tag, version, failure)
        return False
    log.info("checkpoint v%d written to %s", version, directory)
    if keep is not None and rank() == 0:
        checkpoint.prune(directory, keep)
    return True


def _all_ranks(ok: bool) -> bool:
    """Whether `ok` holds on every rank (a collective when there are several)."""
    if world_size() == 1:
        return ok
    flag = torch.tensor([int(ok)], device=get_accelerator().current_device_name())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _abandon_checkpoint(tag: Path, version: int, failure: BaseException | None) -> None:
    """A checkpoint not written on every rank: rank 0 removes its files (a full disk gets its space back)."""
    if failure is None:
        log.error("checkpoint v%d was not written by every rank (their logs say why); the previous checkpoint stays "
                  "the one to resume from", version)
    else:
        free = shutil.disk_usage(tag.parent).free if tag.parent.exists() else 0
        log.error("checkpoint v%d could not be written to %s: %s (%d bytes free there); the previous checkpoint "
                  "stays the one to resume from, and the next is tried in learner.checkpoint_every versions",
                  version, tag, failure, free)
    if rank() == 0 and checkpoint.latest(tag.parent)[1] != version:  # never the one `latest` names
        shutil.rmtree(tag, ignore_errors=True)


def load_checkpoint(engine: deepspeed.DeepSpeedEngine, directory: Path) -> int | None:
    """`resume_checkpoint`'s version to go on at (the loaded checkpoint's own), or None (a fresh start)."""
    resume = resume_checkpoint(engine, directory)
    return None if resume is None else resume.version


def resume_checkpoint(engine: deepspeed.DeepSpeedEngine, directory: Path) -> checkpoint.Resume | None:
    """Restore the checkpoint in `directory` that `latest` names, or the newest other one whose files match their
    manifest when it does not (learner/checkpoint.py `resumable`; the ones that failed are set aside): weights,
    optimizer, RNG states. What was loaded (its version is the one to go on at, also past a damaged newer one) and
    what was skipped, or None when there is none (a fresh start). Every rank must call it. A checkpoint written with
    the entropy floor (removed) also carries that controller's state under "learner": it is ignored."""
    resume = checkpoint.resumable(directory)
    if resume is None:
        return None
    version = resume.version
    adapted = lora.is_adapted(engine.module)
    _check_lora_signature(directory / f"v{version}", lora.signature(engine.module))
    # Under LoRA the checkpoint holds the adapters only: the frozen base stays as model.path loaded it.
    path, client_state = engine.load_checkpoint(str(directory), tag=f"v{version}", load_module_strict=not adapted)
    if path is None or client_state.get("version") != version:
        raise CheckpointError(f"checkpoint v{version} in {directory} could not be loaded")
    rng = client_state["rng"]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if resume.skipped:
        if world_size() > 1:
            dist.barrier()  # every rank has chosen from the same files
        if rank() == 0:
            checkpoint.set_aside(resume.skipped)
            checkpoint.point_latest(directory, version)
    log.info("resumed from checkpoint v%d in %s", version, directory)
    return resume


def _check_lora_signature(checkpoint: Path, expected: dict | None) -> None:
    """A checkpoint resumes only under the LoRA setting that wrote it (read before DeepSpeed loads it: a full
    fine-tune's weights loaded non-strictly into adapters, or adapters of another rank, would fail obscurely or
    not at all)."""
    try:
        saved = json.loads((checkpoint / LORA_FILE).read_text())
    except FileNotFoundError:
        saved = None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{checkpoint / LORA_FILE} cannot be read: {exc}") from None
    if saved != expected:
        def said(sig: dict | None) -> str:
            return "a full fine-tune (learner.lora.rank 0)" if sig is None else f"LoRA {sig}"
        raise CheckpointError(f"{checkpoint} was written by {said(saved)}, but learner.lora asks for {said(expected)}: "
                              "resume with the learner.lora it was written with, or start a new run")
