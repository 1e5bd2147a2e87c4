"""One metrics line per learner step: `<run_dir>/metrics.jsonl` (read by other tools) and Weights & Biases.

Key names are stable; the replay-side ones are echoed from the batch's `ReplayStats`.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from pathlib import Path
from typing import Any

import torch

from async_rl.config import Config
from async_rl.config_load import config_to_dict
from async_rl.loss import LossStats
from async_rl.protocol import ReplayStats
from async_rl.telemetry import MetricsSettings, RoleMetrics, stats_line
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


class GuardWatch:
    """What the correction guard costs and the bound that would not have cost it (docs/algorithm.md, "Staleness").

    `max_correction_staleness` counts learner versions, and how many versions a judge delay spans depends on the
    arm: one that also steps on immediate items takes ~3x the versions of outcome-only+step (docs/results.md,
    "delay"), so a bound sized for one throttles the other. Over the last `window_s` of metrics lines:
    `guard_held_frac`, the share of the wall time the guard held the learner, and `correction_bound_needed`, the
    largest correction staleness trained, scaled by wall ÷ unheld time (the versions those corrections would have
    spanned had the learner stepped through the holds as it steps between them; the scale is capped at 20x). With
    no hold it is the staleness seen. With the run's `bound` given, a hold over `warn_frac` of a window of at least
    `warn_after_s` logs a warning naming both numbers, at most once per `warn_every_s` (without it, no warning:
    `benchmarks/delay.py` recomputes the figures from finished runs' lines)."""

    def __init__(self, bound: int | None = None, window_s: float = 120.0, warn_frac: float = 0.25,
                 warn_after_s: float = 30.0, warn_every_s: float = 600.0) -> None:
        self.bound, self.window_s, self.warn_frac = bound, window_s, warn_frac
        self.warn_after_s, self.warn_every_s = warn_after_s, warn_every_s
        self.lines: deque[tuple[float, float, int]] = deque()  # (wall_s, guard_held_s, staleness_max_correction)
        self.warned_at: float | None = None

    def update(self, wall_s: float, guard_held_s: float, staleness_max_correction: int) -> dict[str, Any]:
        self.lines.append((wall_s, guard_held_s, staleness_max_correction))
        while len(self.lines) > 2 and self.lines[1][0] <= wall_s - self.window_s:
            self.lines.popleft()
        first_wall, first_held, _ = self.lines[0]
        span = wall_s - first_wall
        held = min(max(guard_held_s - first_held, 0.0), span)
        seen = max(staleness for _, _, staleness in self.lines)
        frac = held / span if span > 0 else 0.0
        needed = math.ceil(seen / max(1.0 - frac, 0.05)) if held else seen
        if self.bound is not None and frac > self.warn_frac and span >= self.warn_after_s and (
                self.warned_at is None or wall_s - self.warned_at >= self.warn_every_s):
            self.warned_at = wall_s
            log.warning("the correction guard held the learner %.0f%% of the last %.0f s: corrections reached %d "
                        "versions (the bound in use: algo.max_correction_staleness=%d); stepping through the holds "
                        "they would span ~%d. Raise the bound (under auto: algo.max_correction_staleness_cap) toward "
                        "that, or accept the holds (docs/algorithm.md, \"Staleness\")",
                        100 * frac, span, seen, self.bound, needed)
        return {"guard_held_frac": round(frac, 4), "correction_bound_needed": needed}


class MetricsLog:
    """Appends the learner's lines to metrics.jsonl (flushed per line), mirrored to the learner's W&B run
    (async_rl/telemetry.py: one W&B run per role, grouped per training run)."""

    def __init__(self, config: Config, run_dir: Path) -> None:
        settings = MetricsSettings(run_dir=config.run_dir, name=config.run.name, wandb=config.wandb,
                                   run_config=config_to_dict(config))
        self._metrics = RoleMetrics(settings, "learner", path=run_dir / "metrics.jsonl", histograms=("staleness_hist",))
        self._guard = GuardWatch(0)

    def write(self, line: dict[str, Any]) -> None:
        # the bound in use, as the replay reports it (algo.max_correction_staleness=auto: measured)
        self._guard.bound = line.get("correction_bound", 0)
        line.update(self._guard.update(line["wall_s"], line.get("guard_held_s", 0.0),
                                       line.get("staleness_max_correction", 0)))
        self._metrics.write(line, step=line["version"])

    def close(self) -> None:
        self._metrics.close()
