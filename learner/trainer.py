"""The learner's loop: pull a batch from the replay service, take the optimizer step(s), ack, publish, log.

    v = number of optimizer steps taken (the policy version): 0 at start, or the latest checkpoint's (resume)
    repeat: BatchRequest(v, checkpoint) → Batch → ppo_epochs × (loss, backward, step; v += 1) → BatchAck(v)
            → every publish_every: weights + latest.json + WeightsPublished(v)
            → every checkpoint_every: checkpoint (after the ack: docs/architecture.md, "Resume after a crash")
            → metrics line
    until a budget, the target success rate, a stop event or SIGTERM/SIGINT; then checkpoint, publish, summary.

With several ranks (torchrun) rank 0 alone talks to the replay service and publishes (`_Leader`); it broadcasts
each batch (or the decision to stop) and every rank trains its share of the items (the others' side: `_Rank`).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import zmq

from async_rl.config import Config
from async_rl.evidence import trained_item
from async_rl.loss import LossStats
from async_rl.model import wait_for_model_dir
from async_rl.protocol import Batch, ReplayStats, TrainItem, decode, encode
from async_rl.security import (
    CurveKeys,
    check_transport,
    load_keys,
    sglang_admin_headers,
    sglang_headers,
    vllm_headers,
)
from async_rl.signals import StopRequest, stop_on_signals
from async_rl.telemetry import RoleMetrics
from learner.batch import collate
from learner.checkpoint import rollback_point
from learner.engine import (
    build_engine,
    full_state_dict,
    leave_distributed,
    rank,
    resume_checkpoint,
    save_checkpoint,
    world_size,
)
from learner.metrics import HISTOGRAMS, METRICS_FILE, MetricsLog, batch_metrics, step_metrics
from learner.publisher import ServerHeaders, WeightPublisher, make_publisher
from learner.replay_client import ReplayClient, ResumeRefused
from learner.settings import LearnerSettings, StopSettings
from learner.step import layout_metrics, train_on_items

log = logging.getLogger("async_rl.learner")

LEARNER_ID = "learner-0"


def stop_reason(stop: StopSettings, version: int, stats: ReplayStats, wall_s: float,
                request: StopRequest) -> str | None:
    """Why training stops now (a signal, a budget, the target success rate), or None."""
    if request.event.is_set():
        return f"signal:{request.signal_name}" if request.signal_name else "stop_requested"
    if stop.max_versions is not None and version >= stop.max_versions:
        return "max_versions"
    if stop.max_env_steps is not None and stats.env_steps >= stop.max_env_steps:
        return "max_env_steps"
    if (
        stop.target_success is not None
        and stats.trajectories_finished >= stop.long_success_window
        and stats.success_rate_long >= stop.target_success
    ):
        return "target_success"
    if stop.max_wall_s is not None and wall_s >= stop.max_wall_s:
        return "max_wall_s"
    return None


@dataclass(frozen=True)
class Outside:
    """What the entry hands the loop from the config's readers outside learner/ (async_rl/model.py, security.py,
    telemetry.py take the `Config`), each asked for where needed: the model directory on every rank, the rest on 0."""

    model_dir: Callable[[], Path]  # async_rl/model.py `wait_for_model_dir`
    keys: Callable[[], CurveKeys | None]  # the learner's CURVE keys (async_rl/security.py `load_keys`)
    metrics: Callable[[], RoleMetrics]  # <run_dir>/metrics.jsonl and the learner's W&B run
    server_headers: Callable[[], ServerHeaders]  # of the weight transport's HTTP calls to the servers


def run(config: Config, stop: threading.Event | None = None) -> dict[str, Any]:
    """The role's entry (launch/roles.py), the loop's one reader of the `Config`: train until a stop condition;
    returns (and on rank 0 writes to <run_dir>/summary.json) the summary."""
    started = float(os.environ.get("ASYNC_RL_RUN_START", time.time()))
    # refused before the engine is built; the sockets refuse again (async_rl/transport.py)
    check_transport(config.security.curve_dir, config.security.insecure,
                    (config.replay.endpoint, config.learner.publish_endpoint))
    settings = LearnerSettings.from_config(config)
    outside = Outside(
        model_dir=lambda: wait_for_model_dir(config.model.path, config.run_dir),
        keys=lambda: load_keys(config.security.curve_dir, "learner"),
        metrics=lambda: RoleMetrics(settings.metrics, "learner", path=settings.run_dir / METRICS_FILE,
                                    histograms=HISTOGRAMS),
        server_headers=lambda: (
            ServerHeaders(vllm_headers(config.rollout.vllm.api_key_file)) if config.rollout.engine == "vllm"
            else ServerHeaders(sglang_headers(config.rollout.sglang.api_key_file),
                               sglang_admin_headers(config.rollout.sglang.admin_key_file))))
    with stop_on_signals(stop) as request:  # a signal finishes the current step, then stops
        summary = _train(settings, outside, request, started)
    # With several ranks at ZeRO-3, a rank that exits while the engine's threads still hold the process group
    # aborts ("terminate called without an active exception"): free the engine, then leave together.
    gc.collect()
    leave_distributed()
    return summary


def _train(settings: LearnerSettings, outside: Outside, request: StopRequest, started: float) -> dict[str, Any]:
    """The loop of the module's docstring, on every rank."""
    model_dir = outside.model_dir()
    engine, reference = build_engine(settings.engine, model_dir)
    log.info("learner rank %d of world size %d", rank(), world_size())
    context = zmq.Context()
    side = _Leader(context, settings, outside, model_dir, request) if rank() == 0 else _Rank()
    try:
        progress = _resume(engine, side, settings, started)
        while (batch := _share_batch(side.next_batch(progress))) is not None:
            items = _trainable_items(batch, engine.module.config.vocab_size, progress)
            if not items:
                side.ack(batch, progress.version, trained=False)  # nothing of it was trained
                continue
            trained_at = progress.version
            losses, step_s = _optimize(engine, reference, items, progress, settings)
            # Honest acks: a batch with no step taken says so, and the replay counts none of its credit trained.
            side.ack(batch, progress.version, trained=bool(losses))
            if not losses:
                continue  # the weights did not change: nothing to publish, checkpoint or log as a step
            _publish_if_due(engine, side, progress, settings)
            side.log_step(engine, items, trained_at, losses, step_s, progress)
            _checkpoint_if_due(engine, side, progress, settings)
        return _finish(engine, side, progress, settings)
    finally:
        side.close()
        context.term()
        engine.destroy()


@dataclass
class _Progress:
    """What the loop counts, alike on every rank (so that the last checkpoint and gather are collective or skipped
    by all)."""

    started: float  # time.time() at the run's start
    version: int = 0  # optimizer steps taken: the policy version
    checkpointed: int = -1  # the latest checkpoint's version (-1: none)
    checkpoint_failed: int = -1  # the version of the last checkpoint the disk refused (the next waits checkpoint_every)
    published: int = -1  # the latest published weights' version (-1: none)
    bad_items: int = 0  # items skipped for token ids outside the vocabulary
    skipped_nonfinite: int = 0  # optimizer steps refused for a non-finite loss or gradient

    def wall_s(self) -> float:
        return time.time() - self.started


class _Rank:
    """A rank's part of the loop's dealings with the outside: none, on every rank but 0 (`_Leader`). Its batches
    come from rank 0's broadcast, and rank 0 acks them, publishes, and writes the metrics and the summary."""

    publisher: WeightPublisher | None = None

    def next_batch(self, progress: _Progress) -> Batch | None:
        return None  # rank 0's is broadcast in its place

    def ack(self, batch: Batch, version: int, trained: bool) -> None:
        pass

    def resumed(self, version: int, damage: str) -> None:
        pass

    def checkpointed(self, version: int) -> None:
        pass

    def log_step(self, engine: Any, items: list[TrainItem], trained_at: int, losses: list[tuple[float, LossStats]],
                 step_s: float, progress: _Progress) -> None:
        pass

    def summary(self, progress: _Progress) -> dict[str, Any]:
        return {}  # rank 0's is broadcast in its place

    def write_summary(self, summary: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class _Leader(_Rank):
    """Rank 0's part: the replay client (batches, acks, the durable checkpoint it reports), the weight publisher
    (learner/publisher.py: its transport by the rollout engine), the replay's latest stats, the metrics log and the
    summary."""

    def __init__(self, context: zmq.Context, settings: LearnerSettings, outside: Outside, model_dir: Path,
                 request: StopRequest) -> None:
        self.settings, self.request = settings, request
        keys, client = outside.keys(), settings.client
        self.client = ReplayClient(context, client.endpoint, LEARNER_ID, client.request_timeout_s, keys,
                                   insecure=client.insecure)
        self.publisher = make_publisher(context, settings.publisher, model_dir, keys, outside.server_headers)
        self.metrics = MetricsLog(outside.metrics())
        self.stats = ReplayStats()
        self.reason: str | None = None  # why the loop stopped
        self.damage = ""  # the damaged checkpoints a resume skipped (named if the replay refuses the resume)
        self.parent = os.getppid()  # under `async-rl train` the launcher (or its fork server): the replay's too

    def _stop_reason(self, progress: _Progress) -> str | None:
        return stop_reason(self.settings.stop, progress.version, self.stats, progress.wall_s(), self.request)

    def next_batch(self, progress: _Progress) -> Batch | None:
        """The replay's next batch, or None once a stop condition holds (`reason` names it)."""
        self.reason = self._stop_reason(progress)
        if self.reason is not None:
            return None
        try:
            batch = self.client.next_batch(progress.version, self.settings.client.request,
                                           lambda: self._stop_reason(progress) is not None,
                                           self.publisher.republish_if_due)
        except ResumeRefused as exc:
            if not self.damage:
                raise
            raise ResumeRefused(f"{exc}; this learner resumed from checkpoint v{progress.checkpointed} because the "
                                f"newer one failed its check ({self.damage}): restore the damaged checkpoint from a "
                                "backup, or restart the replay with the learner") from None
        if batch is None:
            self.reason = self._stop_reason(progress)
        return batch

    def ack(self, batch: Batch, version: int, trained: bool) -> None:
        self.client.ack(batch, version, trained=trained, should_stop=self.request.event.is_set,
                        hopeless=self.orphaned)
        self.stats = batch.stats

    def orphaned(self) -> bool:
        """Whether the process that started this learner is gone (it was reparented). Under `async-rl train` that is
        the launcher, killed: its parent-death signal stopped every role, the replay among them, so a stopping
        learner waits for no Ack (it outlived the launcher by ACK_GIVE_UP_S). In a pod the parent stays."""
        return os.getppid() != self.parent

    def resumed(self, version: int, damage: str) -> None:
        self.damage = damage
        self.checkpointed(version)
        # weights of versions above the checkpoint died with the learner that wrote them (or are a damaged
        # checkpoint's versions, trained again)
        for dead in self.settings.publisher.weights_dir.glob("v*.safetensors"):
            if dead.stem[1:].isdigit() and int(dead.stem[1:]) > version:
                dead.unlink(missing_ok=True)

    def checkpointed(self, version: int) -> None:
        """The next BatchRequest reports durable the oldest checkpoint kept, not `version`: the replay keeps the acks
        above it undoable, so a resume that falls back past a damaged newer checkpoint can be rolled back to."""
        checkpoints = self.settings.checkpoints
        self.client.checkpoint = rollback_point(checkpoints.directory, version, checkpoints.keep_checkpoints)

    def log_step(self, engine: Any, items: list[TrainItem], trained_at: int, losses: list[tuple[float, LossStats]],
                 step_s: float, progress: _Progress) -> None:
        """The step's metrics line (learner/metrics.py). Written before the checkpoint: a learner killed between
        the two resumes from the previous checkpoint (this line is then superseded), never from a version whose
        line was not written."""
        settings, stats = self.settings, self.stats
        layout = layout_metrics(items, world_size(), settings.step.layout)  # padding_frac of the tensors trained
        batch_line = {**batch_metrics(collate(items), trained_at), **layout}
        line = step_metrics(progress.version, stats, batch_line, losses, step_s, progress.wall_s(),
                            self.client.bad_messages + progress.bad_items, progress.skipped_nonfinite,
                            lr=float(engine.get_lr()[0]))
        line["entropy_coef"] = settings.step.loss.entropy_coef  # the coefficient this step trained with
        if engine.device.type == "cuda":  # this rank's peak since the last line: weights, state, activations
            line["gpu_peak_gib"] = torch.cuda.max_memory_allocated(engine.device) / 2**30
            torch.cuda.reset_peak_memory_stats(engine.device)
        if settings.log_item_ids:
            line["item_ids"] = [item.item_id for item in items]
            line["items"] = [trained_item(item) for item in items]  # what each trained, for the soak's join
        self.metrics.write(line)
        log.info("v%d loss %.4f success %.3f env_steps %d", progress.version, line["loss"], stats.success_rate,
                 stats.env_steps)

    def summary(self, progress: _Progress) -> dict[str, Any]:
        stats = self.stats
        return {
            "final_success_rate": stats.success_rate_long,
            "env_steps": stats.env_steps,
            "trajectories_finished": stats.trajectories_finished,
            "trajectories_abandoned": stats.trajectories_abandoned,
            "env_errors": stats.env_errors,
            "steps_skipped_nonfinite": progress.skipped_nonfinite,
            "versions": progress.version,
            "wall_s": progress.wall_s(),
            "run_dir": str(self.settings.run_dir.resolve()),
            "stop_reason": self.reason,
        }

    def write_summary(self, summary: dict[str, Any]) -> None:
        _write_json(self.settings.run_dir / "summary.json", summary)
        log.info("learner stopped (%s) at v%d after %.1f s", self.reason, summary["versions"], summary["wall_s"])

    def close(self) -> None:
        for owned in (self.client, self.publisher, self.metrics):
            owned.close()


def _resume(engine: Any, side: _Rank, settings: LearnerSettings, started: float) -> _Progress:
    """Where the loop starts: v0, or the latest checkpoint in the run directory with its version numbering,
    optimizer and RNG states (docs/architecture.md, "Resume after a crash": the replay rolls back to it if it saw
    later versions acked). Its weights are published again: the workers may hold weights of versions that died
    with the learner."""
    progress = _Progress(started)
    resume = resume_checkpoint(engine, settings.checkpoints.directory)
    if resume is not None:
        progress.version = progress.checkpointed = progress.published = resume.version
        side.resumed(resume.version, resume.damage)
        _publish(engine, side.publisher, resume.version, settings)
    return progress


def _share_batch(batch: Batch | None) -> Batch | None:
    """Rank 0's batch (None: stop) on every rank; a no-op in a world of one."""
    if world_size() == 1:
        return batch
    box = [encode(batch) if batch is not None else b""]
    dist.broadcast_object_list(box, src=0)
    return decode(box[0]) if box[0] else None


def _trainable_items(batch: Batch, vocab_size: int, progress: _Progress) -> list[TrainItem]:
    """The items the model can take; a token id outside the vocabulary would crash the step, so it is counted
    instead."""
    items = [item for item in batch.items if item.token_ids().min() >= 0 and item.token_ids().max() < vocab_size]
    dropped = len(batch.items) - len(items)
    if dropped:
        progress.bad_items += dropped
        log.warning("batch %d: skipped %d item(s) with token ids outside the vocabulary", batch.batch_id, dropped)
    return items


def _optimize(
    engine: Any, reference: torch.nn.Module | None, items: list[TrainItem], progress: _Progress,
    settings: LearnerSettings,
) -> tuple[list[tuple[float, LossStats]], float]:
    """The optimizer step(s) on this rank's share of the items (learner/step.py): (loss, stats) per step taken
    (`progress.version` moves on by as many) and the seconds they took."""
    started = time.monotonic()
    progress.version, losses = train_on_items(engine, reference, items, progress.version, settings.step)
    progress.skipped_nonfinite += len(losses) < settings.step.ppo_epochs
    return losses, time.monotonic() - started


def _publish_if_due(engine: Any, side: _Rank, progress: _Progress, settings: LearnerSettings) -> None:
    if progress.version % settings.publish_every == 0:
        _publish(engine, side.publisher, progress.version, settings)
        progress.published = progress.version


def _checkpoint_if_due(engine: Any, side: _Rank, progress: _Progress, settings: LearnerSettings) -> None:
    """Every learner.checkpoint_every versions, after the ack: a learner killed before this completes resumes from
    the previous checkpoint, and the replay rolls back the acks above it."""
    every = settings.checkpoints.checkpoint_every
    if every and progress.version - max(progress.checkpointed, progress.checkpoint_failed, 0) >= every:
        _checkpoint(engine, side, progress, settings)


def _checkpoint(engine: Any, side: _Rank, progress: _Progress, settings: LearnerSettings) -> None:
    """A checkpoint of this version; one the disk refused (logged, naming it) is not reported to the replay, and
    the learner goes on: the previous checkpoint stays the one to resume from."""
    checkpoints = settings.checkpoints
    if save_checkpoint(engine, checkpoints.directory, progress.version, checkpoints.keep_checkpoints):
        progress.checkpointed = progress.version
        side.checkpointed(progress.version)
    else:
        progress.checkpoint_failed = progress.version


def _finish(engine: Any, side: _Rank, progress: _Progress, settings: LearnerSettings) -> dict[str, Any]:
    """The last version checkpointed and published (if it is not yet), then the summary, rank 0's on every rank
    (it alone knows the replay's stats); rank 0 writes it to <run_dir>/summary.json."""
    if progress.checkpointed != progress.version:
        _checkpoint(engine, side, progress, settings)
    if progress.published != progress.version:
        _publish(engine, side.publisher, progress.version, settings)
    summary = _share_summary(side.summary(progress))
    side.write_summary(summary)
    return summary


def _share_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's summary on every rank."""
    if world_size() == 1:
        return summary
    box = [summary]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _publish(engine: Any, publisher: WeightPublisher | None, version: int, settings: LearnerSettings) -> None:
    """Gather the full weights, or the adapters alone where they are published (a collective at ZeRO-3), and let
    rank 0 announce them."""
    state_dict = full_state_dict(engine, adapters=settings.publisher.adapters is not None)
    if publisher is not None:
        publisher.publish(state_dict, version)


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    staging = path.with_suffix(".json.tmp")
    staging.write_text(json.dumps(payload, indent=2))
    os.replace(staging, path)
