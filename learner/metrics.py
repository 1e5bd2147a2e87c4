"""One metrics line per learner step: `<run_dir>/metrics.jsonl` (read by other tools) and Weights & Biases.

Key names are stable; the replay-side ones are echoed from the batch's `ReplayStats`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from async_rl.config import Config
from async_rl.loss import LossStats
from async_rl.protocol import ReplayStats
from async_rl.telemetry import RoleMetrics, stats_line
from learner.batch import TrainBatch

log = logging.getLogger("async_rl.learner")


def batch_metrics(batch: TrainBatch, version: int) -> dict[str, Any]:
    """Staleness (at the version the batch is trained at), |Â| by kind, sizes: over the masked action tokens."""
    on = batch.loss_mask.bool()
    correction = batch.is_correction.unsqueeze(1).expand_as(on)
    staleness = batch.staleness(version)
    line: dict[str, Any] = {}
    for kind, of_kind in (("immediate", on & ~correction), ("correction", on & correction)):
        line[f"staleness_max_{kind}"] = int(staleness[of_kind].max()) if of_kind.any() else 0
        line[f"adv_abs_{kind}"] = float(batch.advantages[of_kind].abs().mean()) if of_kind.any() else 0.0
    trained = staleness[on].clamp(min=0)
    line["staleness_mean"] = float(trained.float().mean()) if on.any() else 0.0
    line["staleness_hist"] = torch.bincount(trained).tolist() if on.any() else []
    line["items_immediate"] = int((~batch.is_correction).sum())
    line["items_correction"] = int(batch.is_correction.sum())
    real_tokens = int(batch.attention_mask.sum())
    line["tokens"] = real_tokens
    line["padding_frac"] = 1.0 - real_tokens / batch.attention_mask.numel()
    return line


def step_metrics(
    version: int, stats: ReplayStats, batch_line: dict[str, Any], losses: list[tuple[float, LossStats]],
    step_s: float, wall_s: float, learner_bad_messages: int, steps_skipped_nonfinite: int = 0, lr: float = 0.0,
) -> dict[str, Any]:
    """The full line. With ppo_epochs > 1 one line covers the batch's epochs: loss is their mean, ρ the first's."""
    first = losses[0][1]
    return {
        "version": version,
        **stats_line(stats),  # the replay's counters, the latest evaluation, rejections by reason
        **batch_line,
        "learner_bad_messages": learner_bad_messages,
        "steps_skipped_nonfinite": steps_skipped_nonfinite,
        "loss": sum(loss for loss, _ in losses) / len(losses),
        "is_ratio_mean": first.is_ratio_mean,
        "is_ratio_max": first.is_ratio_max,
        "is_capped_frac": first.is_capped_frac,
        "kl": losses[-1][1].kl,
        "entropy_mean": first.entropy,
        "grad_norm": max(stats.grad_norm for _, stats in losses),
        "lr": lr,
        "step_s": step_s,
        "tokens_per_s": batch_line.get("tokens", 0) / step_s if step_s > 0 else 0.0,
        "wall_s": wall_s,
    }


class MetricsLog:
    """Appends the learner's lines to metrics.jsonl (flushed per line), mirrored to the learner's W&B run
    (async_rl/telemetry.py: one W&B run per role, grouped per training run)."""

    def __init__(self, config: Config, run_dir: Path) -> None:
        self._metrics = RoleMetrics(config, "learner", path=run_dir / "metrics.jsonl", histograms=("staleness_hist",))

    def write(self, line: dict[str, Any]) -> None:
        self._metrics.write(line, step=line["version"])

    def close(self) -> None:
        self._metrics.close()
