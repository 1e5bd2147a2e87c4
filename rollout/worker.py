"""A rollout worker: lease a group from the replay service, play it, stream its stages, follow new weights.

    DEALER -> replay ROUTER   LeaseRequest, StageRecord, Outcome, Heartbeat   (Ack, LeaseGrant, LeaseDenied, Error)
    SUB    <- learner PUB     WeightsPublished

Weights change only between turns (never inside one `generate` call), so every token's version tag is the
version that actually produced it. A worker that starts late catches up from `<run_dir>/weights/latest.json`.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import zmq

from async_rl.config import Config
from async_rl.model import ensure_model_dir, load_tokenizer
from async_rl.protocol import LeaseDenied, WeightsPublished
from async_rl.transport import BadFrame, connect_dealer, connect_subscriber, receive
from rollout.agent import Agent
from rollout.engines import EngineStopped, EngineUnavailable, InferenceEngine
from rollout.engines.torch_engine import TorchEngine
from rollout.link import ReplayLink

log = logging.getLogger("async_rl.rollout")

MIN_LEASE_INTERVAL_S = 1.0  # at most one lease request per this long unless a group just finished
IDLE_POLL_S = 0.05
STOP_DRAIN_S = 2.0  # on stop, wait this long at most for the acks of what was already sent


def make_engine(config: Config, model_dir: Path, seed: int, stop: threading.Event | None = None) -> InferenceEngine:
    if config.rollout.engine == "sglang":
        from rollout.engines.sglang import SGLangEngine  # httpx is needed only by SGLang users

        return SGLangEngine(config.rollout.sglang, stop)  # a generate waiting on its servers ends when `stop` is set
    return TorchEngine(model_dir, seed=seed)


class WeightsFollower:
    """Keeps the engine at the newest published policy version."""

    def __init__(self, socket: zmq.Socket, engine: InferenceEngine, run_dir: Path) -> None:
        self.socket = socket
        self.engine = engine
        self.bad_messages = 0
        self._catch_up(run_dir / "weights" / "latest.json")

    def sync(self) -> None:
        """Drain every announcement waiting on SUB; load only the newest one (skipped versions are superseded)."""
        newest: WeightsPublished | None = None
        while self.socket.poll(0):
            try:
                _, message = receive(self.socket)
            except BadFrame as exc:
                self.bad_messages += 1
                log.warning("ignoring a malformed weights announcement: %s", exc)
                continue
            if not isinstance(message, WeightsPublished):
                self.bad_messages += 1
                log.warning("ignoring an unexpected %s on the weights channel", type(message).__name__)
            elif newest is None or message.version > newest.version:
                newest = message
        if newest is not None:
            self._load(newest.version, newest.path)

    def _catch_up(self, latest: Path) -> None:
        if not latest.exists():
            return
        try:
            record = json.loads(latest.read_text())
            version, path = int(record["version"]), str(record["path"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable %s: %s", latest, exc)
            return
        self._load(version, path)

    def _load(self, version: int, path: str) -> None:
        if version <= self.engine.version:
            return
        try:
            self.engine.update_weights(version, path)
        except (OSError, RuntimeError) as exc:  # e.g. pruned by keep_weights before we read it; a newer one follows
            log.warning("could not load policy version %d from %s: %s", version, path, exc)


def run(config: Config, worker_index: int, stop: threading.Event | None = None) -> None:
    """Run rollout worker `rollout-<worker_index>` until `stop` is set (or SIGTERM/SIGINT in the main thread)."""
    stop = stop or threading.Event()
    worker_id = f"rollout-{worker_index}"
    restore_signals = _stop_on_signals(stop)
    torch.set_num_threads(config.run.threads_per_process)
    model_dir = ensure_model_dir(config)
    tokenizer = load_tokenizer(model_dir)
    engine = make_engine(config, model_dir, seed=config.run.seed * 1000 + worker_index, stop=stop)
    context = zmq.Context()
    dealer = connect_dealer(context, config.replay.endpoint, worker_id)
    subscriber = connect_subscriber(context, config.learner.publish_endpoint)
    link = ReplayLink(dealer, worker_id, config.rollout.ack_timeout_s, config.rollout.heartbeat_s)
    weights = WeightsFollower(subscriber, engine, config.run_dir)
    agent = Agent(config, worker_id, engine, tokenizer, link.send_reliably, link.next_msg_id)
    log.info(
        "%s up: engine %s at version %d, replay %s",
        worker_id,
        config.rollout.engine,
        engine.version,
        config.replay.endpoint,
    )

    def service() -> None:
        weights.sync()
        agent.poll_outcomes()
        link.tick(agent.live_group_ids())

    def service_during_group() -> None:
        link.handle_replies(0.0)  # acks; no lease request is open while a group runs
        service()

    next_request_at = 0.0
    try:
        while not stop.is_set():
            if link.lease_request is None and time.monotonic() >= next_request_at:
                link.request_lease()
                next_request_at = time.monotonic() + MIN_LEASE_INTERVAL_S
            for reply in link.handle_replies(IDLE_POLL_S):
                if isinstance(reply, LeaseDenied):
                    log.debug("lease denied (%s); asking again in %.2fs", reply.reason, reply.retry_after_s)
                    next_request_at = time.monotonic() + reply.retry_after_s
                else:
                    log.info("group %s: task %d x %d", reply.group_id, reply.task_id, reply.group_size)
                    agent.run_group(reply, service_during_group, stop)
                    next_request_at = 0.0
            service()
    except EngineUnavailable as exc:  # e.g. every SGLang server gone: deliver the abandoned outcomes, then stop
        log.error("%s stops: %s", worker_id, exc)
        _deliver_unacked(link, config.rollout.ack_timeout_s)
        raise
    except EngineStopped:  # stopped while the engine waited on its servers: as below
        _deliver_unacked(link, STOP_DRAIN_S)
    else:  # stopped: what was sent should still reach the replay service (it is stopped after the workers)
        _deliver_unacked(link, STOP_DRAIN_S)
    finally:
        agent.close()
        engine.close()
        dealer.close(linger=0)
        subscriber.close(linger=0)
        context.term()
        restore_signals()
        log.info("%s stopped (%d records unacked, %d resends)", worker_id, len(link.unacked), link.resends)


def _deliver_unacked(link: ReplayLink, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while link.unacked and time.monotonic() < deadline:
        link.handle_replies(IDLE_POLL_S)
        link.tick([])


def _stop_on_signals(stop: threading.Event) -> Callable[[], None]:
    """SIGTERM/SIGINT set `stop` (only possible from the main thread); returns a function restoring the old ones."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, lambda *_: stop.set())

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore
