"""Learner helpers only the tests use: a config's engine, one rank's share as a single batch, one tensor batch's
step, a model's activation-checkpointing flag."""

from __future__ import annotations

import deepspeed
import torch

from async_rl.config import Config
from async_rl.loss import LossStats
from async_rl.model import wait_for_model_dir
from async_rl.protocol import TrainItem
from learner.batch import TrainBatch, collate
from learner.engine import build_engine
from learner.pack import balance_shards
from learner.settings import LearnerSettings, StepSettings
from learner.step import aggregate_denominator, share_scale, train_on_micro_batches


def engine_for(config: Config) -> tuple[deepspeed.DeepSpeedEngine, torch.nn.Module | None]:
    """`build_engine` as the learner's entry calls it: the config's engine settings, its model directory."""
    model_dir = wait_for_model_dir(config.model.path, config.run_dir)
    return build_engine(LearnerSettings.from_config(config).engine, model_dir)


def rank_share(items: list[TrainItem], rank: int, world_size: int, step: StepSettings) -> tuple[TrainBatch, float]:
    """This rank's length-balanced share of the items as one padded batch, and the factor that makes the
    rank-averaged gradient equal the whole batch's (`share_scale`). A rank without items trains a masked-out copy
    of the first item: every rank must run forward and backward (collectives at ZeRO-3)."""
    share = balance_shards([item.num_tokens() for item in items], world_size)[rank]
    batch = collate([items[i] for i in share] or items[:1])
    if not share:
        batch.loss_mask.zero_()
    if world_size == 1:
        return batch, 1.0
    return batch, share_scale(batch.loss_mask, aggregate_denominator(collate(items).loss_mask, step), world_size, step)


def train_on_batch(
    engine: deepspeed.DeepSpeedEngine, reference: torch.nn.Module | None, batch: TrainBatch, version: int,
    config: Config, loss_scale: float = 1.0,
) -> tuple[int, list[tuple[float, LossStats]]]:
    """One tensor batch as a single micro-batch: `learner.step.train_on_micro_batches`, under the config's step
    settings."""
    step = LearnerSettings.from_config(config).step
    return train_on_micro_batches(engine, reference, [(batch, loss_scale)], version, step)


def activation_checkpointing_on(model: torch.nn.Module) -> bool:
    """Whether any layer of `model` recomputes its activations (the flag HF's layers carry, under every release)."""
    return any(getattr(module, "gradient_checkpointing", False) for module in model.modules())
