"""The learner's loop: pull a batch from the replay service, take the optimizer step(s), ack, publish, log.

    v = number of optimizer steps taken (the policy version): 0 at start, or the latest checkpoint's (resume)
    repeat: BatchRequest(v, checkpoint) → Batch → ppo_epochs × (loss, backward, step; v += 1) → BatchAck(v)
            → every publish_every: weights + latest.json + WeightsPublished(v)
            → every checkpoint_every: checkpoint (after the ack: docs/architecture.md, "Resume after a crash")
            → metrics line
    until a budget, the target success rate, a stop event or SIGTERM/SIGINT; then checkpoint, publish, summary.

With several ranks (torchrun) rank 0 alone talks to the replay service and publishes; it broadcasts each batch
(or the decision to stop) and every rank trains its share of the items.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import zmq

from async_rl.config import Config
from async_rl.loss import entropy_floor_boost
from async_rl.model import wait_for_model_dir
from async_rl.protocol import Batch, ReplayStats, decode, encode
from async_rl.security import load_keys
from learner.batch import collate
from learner.engine import (
    build_engine,
    full_state_dict,
    leave_distributed,
    load_checkpoint,
    rank,
    save_checkpoint,
    world_size,
)
from learner.metrics import MetricsLog, batch_metrics, step_metrics
from learner.publisher import WeightPublisher
from learner.replay_client import ReplayClient
from learner.sglang_sync import make_publisher
from learner.step import layout_metrics, train_on_items

log = logging.getLogger("async_rl.learner")

LEARNER_ID = "learner-0"


class StopRequest:
    """The caller's stop event plus, if one arrived, the signal that asked us to stop."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event
        self.signal_name: str | None = None

    def handle(self, signum: int, _frame: object) -> None:
        self.signal_name = signal.Signals(signum).name
        log.info("%s received: finishing the current step, then stopping", self.signal_name)
        self.event.set()


@contextlib.contextmanager
def _signals_handled(request: StopRequest) -> Iterator[None]:
    """SIGTERM/SIGINT set the stop event instead of killing a step halfway (main thread only: Python's rule)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, request.handle) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_reason(config: Config, version: int, stats: ReplayStats, wall_s: float, request: StopRequest) -> str | None:
    run = config.run
    if request.event.is_set():
        return f"signal:{request.signal_name}" if request.signal_name else "stop_requested"
    if run.max_versions is not None and version >= run.max_versions:
        return "max_versions"
    if run.max_env_steps is not None and stats.env_steps >= run.max_env_steps:
        return "max_env_steps"
    if (
        run.target_success is not None
        and stats.trajectories_finished >= config.replay.long_success_window
        and stats.success_rate_long >= run.target_success
    ):
        return "target_success"
    if run.max_wall_s is not None and wall_s >= run.max_wall_s:
        return "max_wall_s"
    return None


def run(config: Config, stop: threading.Event | None = None) -> dict[str, Any]:
    """Train until a stop condition; returns (and on rank 0 writes to <run_dir>/summary.json) the summary."""
    request = StopRequest(stop if stop is not None else threading.Event())
    started = float(os.environ.get("ASYNC_RL_RUN_START", time.time()))
    with _signals_handled(request):
        summary = _train(config, request, started)
    # With several ranks at ZeRO-3, a rank that exits while the engine's threads still hold the process group
    # aborts ("terminate called without an active exception"): free the engine, then leave together.
    gc.collect()
    leave_distributed()
    return summary


def _share_batch(batch: Batch | None) -> Batch | None:
    """Rank 0's batch (None: stop) on every rank; a no-op in a world of one."""
    if world_size() == 1:
        return batch
    box = [encode(batch) if batch is not None else b""]
    dist.broadcast_object_list(box, src=0)
    return decode(box[0]) if box[0] else None


def _share_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's summary (it alone knows the replay's stats) on every rank."""
    if world_size() == 1:
        return summary
    box = [summary]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _valid_items(batch: Batch, vocab_size: int) -> tuple[list, int]:
    """Items the model can take; a token id outside the vocabulary would crash the step, so it is counted instead."""
    valid = [item for item in batch.items if item.token_ids().min() >= 0 and item.token_ids().max() < vocab_size]
    return valid, len(batch.items) - len(valid)


def _train(config: Config, request: StopRequest, started: float) -> dict[str, Any]:
    run_dir = config.run_dir
    engine, reference = build_engine(config)
    leader = rank() == 0
    log.info("learner rank %d of world size %d", rank(), world_size())
    vocab_size = engine.module.config.vocab_size
    context = zmq.Context()
    client = publisher = metrics = None
    if leader:
        client = ReplayClient(context, config.replay.endpoint, LEARNER_ID, config.learner.request_timeout_s,
                              load_keys(config, "learner"))
        # SGLang servers: learner/sglang_sync.py
        publisher = make_publisher(context, config, wait_for_model_dir(config))
        metrics = MetricsLog(config, run_dir)
    checkpoints = run_dir / "checkpoints"
    # Resume (docs/architecture.md, "Resume after a crash"): the latest checkpoint in the run directory, with its
    # version numbering, optimizer and RNG states; the replay rolls back to it if it saw later versions acked.
    loaded = load_checkpoint(engine, checkpoints)
    resumed, saved_state = loaded if loaded is not None else (None, {})
    version, stats, reason = resumed or 0, ReplayStats(), None
    # The entropy floor's extra bonus coefficient (async_rl.loss.entropy_floor_boost), checkpointed with the weights.
    entropy_boost = _saved_boost(saved_state, config) if config.algo.entropy_floor > 0 else 0.0
    checkpointed = published = -1  # the same on every rank: the final gather must be collective or skipped by all
    keep = config.learner.keep_checkpoints
    if resumed is not None:
        checkpointed = resumed
        if leader:
            client.checkpoint = resumed
            # weights of versions above the checkpoint died with the learner that wrote them
            for dead in (run_dir / "weights").glob("v*.safetensors"):
                if dead.stem[1:].isdigit() and int(dead.stem[1:]) > version:
                    dead.unlink(missing_ok=True)
        _publish(engine, publisher, version)  # the workers may hold weights of versions that died with the learner
        published = version
    bad_items = 0
    skipped_nonfinite = 0  # optimizer steps refused for a non-finite loss or gradient

    def wall_s() -> float:
        return time.time() - started

    def waiting_should_stop() -> bool:
        return stop_reason(config, version, stats, wall_s(), request) is not None

    try:
        while True:
            batch = None
            if leader:
                reason = stop_reason(config, version, stats, wall_s(), request)
                if reason is None:
                    batch = client.next_batch(version, config.learner, waiting_should_stop, publisher.republish_if_due)
                    if batch is None:
                        reason = stop_reason(config, version, stats, wall_s(), request)
            batch = _share_batch(batch)
            if batch is None:
                break
            items, dropped = _valid_items(batch, vocab_size)
            bad_items += dropped
            if dropped:
                log.warning("batch %d: skipped %d item(s) with token ids outside the vocabulary",
                            batch.batch_id, dropped)
            if not items:
                if leader:
                    client.ack(batch, version, trained=False)  # nothing of it was trained
                    stats = batch.stats
                continue
            step_started = time.monotonic()
            trained_at = version
            boost_used = entropy_boost
            version, losses = train_on_items(engine, reference, items, version, config, entropy_boost)
            step_s = time.monotonic() - step_started
            for _, step_stats in losses:  # once per optimizer step; the whole batch's entropy, alike on every rank
                entropy_boost = entropy_floor_boost(entropy_boost, step_stats.entropy, config.algo)
            skipped_nonfinite += len(losses) < config.algo.ppo_epochs
            if leader:
                # Honest acks: a batch with no step taken says so, and the replay counts none of its credit trained.
                client.ack(batch, version, trained=bool(losses))
                stats = batch.stats
            if not losses:
                continue  # the weights did not change: nothing to publish, checkpoint or log as a step
            if version % config.learner.publish_every == 0:
                _publish(engine, publisher, version)
                published = version
            if leader:
                # Before the checkpoint: a learner killed between the two resumes from the previous checkpoint
                # (this line is then superseded), never from a version whose line was not written.
                layout = layout_metrics(items, world_size(), config)  # padding_frac of the tensors trained
                batch_line = {**batch_metrics(collate(items), trained_at), **layout}
                line = step_metrics(version, stats, batch_line, losses, step_s,
                                    wall_s(), client.bad_messages + bad_items, skipped_nonfinite,
                                    lr=float(engine.get_lr()[0]))
                line["entropy_coef"] = config.algo.entropy_coef + boost_used  # the coefficient this step trained with
                if engine.device.type == "cuda":  # this rank's peak since the last line: weights, state, activations
                    line["gpu_peak_gib"] = torch.cuda.max_memory_allocated(engine.device) / 2**30
                    torch.cuda.reset_peak_memory_stats(engine.device)
                if config.learner.log_item_ids:
                    line["item_ids"] = [item.item_id for item in items]
                metrics.write(line)
                log.info("v%d loss %.4f success %.3f env_steps %d", version, line["loss"], stats.success_rate,
                         stats.env_steps)
            every = config.learner.checkpoint_every
            if every and version - max(checkpointed, 0) >= every:
                # After the ack: a learner killed before this completes resumes from the previous checkpoint, and
                # the replay rolls back the acks above it. The next BatchRequest reports it durable.
                save_checkpoint(engine, checkpoints, version, keep, {"entropy_boost": entropy_boost})
                checkpointed = version
                if leader:
                    client.checkpoint = version
        if checkpointed != version:
            save_checkpoint(engine, checkpoints, version, keep, {"entropy_boost": entropy_boost})
        if published != version:
            _publish(engine, publisher, version)
        summary = _share_summary({
            "final_success_rate": stats.success_rate_long,
            "env_steps": stats.env_steps,
            "trajectories_finished": stats.trajectories_finished,
            "trajectories_abandoned": stats.trajectories_abandoned,
            "env_errors": stats.env_errors,
            "steps_skipped_nonfinite": skipped_nonfinite,
            "versions": version,
            "wall_s": wall_s(),
            "run_dir": str(run_dir.resolve()),
            "stop_reason": reason,
        })
        if leader:
            _write_json(run_dir / "summary.json", summary)
            log.info("learner stopped (%s) at v%d after %.1f s", reason, version, summary["wall_s"])
        return summary
    finally:
        for owned in (client, publisher, metrics):
            if owned is not None:
                owned.close()
        context.term()
        engine.destroy()


def _saved_boost(saved_state: dict[str, Any], config: Config) -> float:
    """The entropy floor's coefficient a checkpoint carried, checked: a number in [0, algo.entropy_floor_max]
    (clipped into it, e.g. after the bound was lowered), else 0 with a warning."""
    value = saved_state.get("entropy_boost", 0.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        log.warning("checkpoint's entropy_boost %r is not a finite number: starting the entropy floor at 0", value)
        return 0.0
    return min(max(float(value), 0.0), config.algo.entropy_floor_max)


def _publish(engine: Any, publisher: WeightPublisher | None, version: int) -> None:
    """Gather the full weights (a collective at ZeRO-3) and let rank 0 announce them."""
    state_dict = full_state_dict(engine)
    if publisher is not None:
        publisher.publish(state_dict, version)


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    staging = path.with_suffix(".json.tmp")
    staging.write_text(json.dumps(payload, indent=2))
    os.replace(staging, path)
