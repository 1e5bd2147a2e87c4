"""The warm start (`async-rl sft`): supervised fine-tuning on demonstrations, on the learner's own engine.

    demonstrations (learner/sft_data.py) → token ids + assistant-only masks → TrainItems
    repeat for --epochs, in a seeded order: batch of ≤ learner.batch_tokens → micro-batches (learner/pack.py)
        → `sft_loss` (async_rl/loss.py) → one optimizer step (learner/step.py, objective "sft") → metrics line
        → every learner.checkpoint_every steps a checkpoint (a rerun with --resume continues from it)
    then the full weights (LoRA merged) as a Hugging Face directory: OUT_DIR, which model.path and export take.

The same DeepSpeed engine, precision, LoRA, packing, micro-batching and clipping as RL training (the `learner`
section of the config); the loss is the only difference. A conversation longer than model.max_seq_len is skipped
and counted.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from async_rl.config import Config
from async_rl.errors import AsyncRLError
from async_rl.hf_io import refuse_non_empty, write_model_dir
from async_rl.model import load_tokenizer, wait_for_model_dir
from async_rl.protocol import ADVANTAGE, LOGPROB, TOKEN, TrainItem
from async_rl.telemetry import RoleMetrics
from learner.engine import build_engine, full_state_dict, load_checkpoint, rank, save_checkpoint
from learner.settings import LearnerSettings
from learner.sft_data import read_demonstrations, render
from learner.step import train_on_items

log = logging.getLogger("async_rl.learner")


@dataclass
class SftPlan:
    data: Path  # the demonstrations file
    out_dir: Path  # the model directory to write
    epochs: int = 1
    force: bool = False  # replace a non-empty out_dir
    resume: bool = False  # continue from the latest checkpoint in the run directory
    max_steps: int | None = None  # stop after this many optimizer steps (None: every batch of every epoch)


def demonstration_items(max_seq_len: int, model_dir: Path, data: Path) -> tuple[list[TrainItem], int]:
    """The file's conversations as TrainItems (advantage 1 on the trained tokens) and how many were skipped for
    being longer than model.max_seq_len."""
    tokenizer = load_tokenizer(model_dir)
    items, skipped = [], 0
    for demonstration in read_demonstrations(data):
        rendered = render(tokenizer, demonstration)
        if len(rendered.tokens) > max_seq_len or not rendered.mask.any():
            skipped += 1
            continue
        n = len(rendered.tokens)
        items.append(TrainItem(
            item_id=len(items), kind="immediate", group_id="sft", trajectory_id=f"sft/line{rendered.line}",
            tokens=rendered.tokens.astype(TOKEN).tobytes(), loss_mask=rendered.mask.tobytes(),
            advantages=rendered.mask.astype(ADVANTAGE).tobytes(), behaviour_logprobs=np.zeros(n, LOGPROB).tobytes(),
            policy_versions=np.zeros(n, TOKEN).tobytes()))
    if not items:
        raise AsyncRLError(f"--data: no conversation of {data} fits model.max_seq_len {max_seq_len} "
                           f"({skipped} skipped)")
    return items, skipped


def batches(items: list[TrainItem], batch_tokens: int, epochs: int, seed: int) -> list[tuple[int, list[TrainItem]]]:
    """Every epoch's items in a seeded order, cut into batches of at most `batch_tokens` tokens (one item at
    least), each with its epoch: the same list on every run, so a resumed run skips the batches its checkpoint
    trained."""
    planned: list[tuple[int, list[TrainItem]]] = []
    for epoch in range(epochs):
        order = list(items)
        random.Random(f"{seed}/{epoch}").shuffle(order)
        batch: list[TrainItem] = []
        tokens = 0
        for item in order:
            if batch and tokens + item.num_tokens() > batch_tokens:
                planned.append((epoch, batch))
                batch, tokens = [], 0
            batch.append(item)
            tokens += item.num_tokens()
        if batch:
            planned.append((epoch, batch))
    return planned


def run_sft(config: Config, model_dir: Path, plan: SftPlan) -> dict[str, Any]:
    """The `async-rl sft` entry (launch/warm_start.py): train on the demonstrations, write OUT_DIR; returns (and
    writes to <run_dir>/summary.json) the summary. The warm start's one reader of the `Config`: its components get
    their settings (learner/settings.py, `LearnerSettings.for_sft`)."""
    if not plan.resume:
        refuse_non_empty(plan.out_dir, plan.force)  # before minutes of training, not after
    settings = LearnerSettings.from_config(config).for_sft()
    items, skipped = demonstration_items(settings.max_seq_len, model_dir, plan.data)
    planned = batches(items, settings.batch_tokens, plan.epochs, settings.seed)[: plan.max_steps]
    log.info("warm start: %d conversation(s) (%d skipped, longer than %d tokens), %d step(s) over %d epoch(s)",
             len(items), skipped, settings.max_seq_len, len(planned), plan.epochs)
    engine, _ = build_engine(settings.engine, wait_for_model_dir(config.model.path, config.run_dir))
    checkpoints = settings.checkpoints
    metrics = RoleMetrics(settings.metrics, "sft", path=settings.run_dir / "metrics.jsonl") if rank() == 0 else None
    started, step = time.time(), 0
    try:
        if plan.resume:
            step = load_checkpoint(engine, checkpoints.directory) or 0
        for epoch, batch in planned[step:]:
            began = time.monotonic()
            new_step, losses = train_on_items(engine, None, batch, step, settings.step, objective="sft")
            if not losses:
                log.warning("step %d: non-finite loss or gradient, skipped", step + 1)
            step = step + 1 if not losses else new_step
            if metrics is not None and losses:
                loss, stats = losses[0]
                metrics.write({"version": step, "sft_loss": loss, "grad_norm": stats.grad_norm,
                               "tokens": sum(i.num_tokens() for i in batch),
                               "trained_tokens": int(sum(i.mask().sum() for i in batch)), "items": len(batch),
                               "epoch": epoch, "lr": float(engine.get_lr()[0]),
                               "step_s": time.monotonic() - began, "wall_s": time.time() - started}, step=step)
            if checkpoints.checkpoint_every and step % checkpoints.checkpoint_every == 0:
                save_checkpoint(engine, checkpoints.directory, step, keep=checkpoints.keep_checkpoints)
        state = full_state_dict(engine)
    finally:
        if metrics is not None:
            metrics.close()
        engine.destroy()
    summary = {"out_dir": str(plan.out_dir.resolve()), "steps": step, "conversations": len(items),
               "skipped_too_long": skipped, "wall_s": time.time() - started,
               "run_dir": str(settings.run_dir.resolve())}
    if rank() == 0:
        write_model_dir(model_dir, state, plan.out_dir, force=plan.force or plan.resume)
        (settings.run_dir / "summary.json").write_text(msgspec.json.encode(summary).decode() + "\n")
    return summary
