"""The replay's socket loop and its write-ahead log's wiring: one ROUTER socket in front of `ReplayService`, each
poll round's inputs logged (replay/wal.py) before its replies leave, and the metrics line.

The role's entry: the one place of the replay that takes the run's `Config` (with replay/settings.py's
`ReplaySettings.from_config`, which it calls); every component below gets only its own settings."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq

from async_rl.config import Config
from async_rl.config_load import config_to_dict
from async_rl.protocol import Ack, Acks, AnyMessage, Error, decode, encode
from async_rl.security import check_transport, load_keys
from async_rl.signals import stop_on_signals
from async_rl.telemetry import MetricsSettings, RoleMetrics
from async_rl.transport import BadFrame, CurveServerSocket, bind_router, poll, receive_from, send
from replay.log_format import Entry, Received, Refused, Started, Ticked, Undecodable
from replay.service import ReplayService, Reply
from replay.settings import ReplaySettings
from replay.telemetry import metrics_line
from replay.wal import ReplayLog, WalWriteError

log = logging.getLogger("async_rl.replay")

POLL_S = 0.02
MAX_MESSAGES_PER_TICK = 1000  # timers still run under a flood of messages
RETRY_S = 1.0  # a log write the disk refused is tried again this often
REMIND_S = 60.0  # while it keeps refusing, the error is logged again this often


def run(config: Config, stop: threading.Event | None = None, service: ReplayService | None = None) -> None:
    """Serve the replay ROUTER at `config.replay.endpoint` until `stop` is set (or SIGTERM / SIGINT).
    `service`: the core to serve (a test reads its counters afterwards); a fresh one by default.

    With `replay.durable` the service is first rebuilt from its log in `<run dir>/replay/` (replay/wal.py), and
    each poll round's inputs are written and fsynced before its replies are sent: started again with the same
    config after a crash, the replay goes on from the last acknowledged input. Every start begins a new epoch.
    A disk that refuses the log (full, failing) holds the replay until it takes it again (`hold_until_written`)."""
    check_transport(config.security.curve_dir, config.security.insecure, (config.replay.endpoint,))
    with stop_on_signals(stop) as request:
        _serve_until_stopped(config, service if service is not None else build_service(config), request.event)


def build_service(config: Config) -> ReplayService:
    """A fresh replay core for the run's config: the components' settings are read from it here, at the entry."""
    return ReplayService(ReplaySettings.from_config(config))


def _serve_until_stopped(config: Config, service: ReplayService, stop: threading.Event) -> None:
    wal, clock = open_log(config, service)
    context = zmq.Context()
    metrics = RoleMetrics(MetricsSettings(run_dir=config.run_dir, name=config.run.name, wandb=config.wandb,
                                          run_config=config_to_dict(config)),
                          "replay", histograms=("queue_staleness_hist",))
    try:
        socket = bind_router(context, config.replay.endpoint, config.replay.max_message_bytes,
                             load_keys(config.security.curve_dir, "replay"), insecure=config.security.insecure)
        try:
            service.start_epoch(service.epoch + 1 if wal is not None else _volatile_epoch(), clock())
            if wal is None or start_log(wal, service, clock, stop):
                log.info("replay service listening on %s (epoch %d, %s)", config.replay.endpoint, service.epoch,
                         f"log in {wal.directory}" if wal is not None else "not durable")
                _serve(config, service, socket, clock, wal, metrics, stop)
        finally:
            socket.close(linger=0)
    finally:
        metrics.write(metrics_line(service, clock()))
        metrics.close()
        context.term()
        if wal is not None:
            wal.close()
        log.info("replay service stopped: %s", service.stats_snapshot())


def _serve(config: Config, service: ReplayService, socket: zmq.Socket, clock: Callable[[], float],
           wal: ReplayLog | None, metrics: RoleMetrics, stop: threading.Event) -> None:
    """Poll rounds until `stop`. The replies of one round wait for its inputs to be in the log: one write + fsync
    per round."""
    next_metrics_at = time.monotonic() + config.run.metrics_every_s
    while not stop.is_set():
        if time.monotonic() >= next_metrics_at:
            next_metrics_at = time.monotonic() + config.run.metrics_every_s
            metrics.write(metrics_line(service, clock()))
        replies: list[Reply] = []
        ready, received = poll(socket, POLL_S), 0
        while ready and received < MAX_MESSAGES_PER_TICK:
            replies += _receive_one(service, socket, clock, wal)
            received += 1
            ready = poll(socket, 0)
        now = clock()
        if isinstance(socket, CurveServerSocket):  # CURVE on: count the peers it kept out
            for reason in socket.refused_handshakes():
                if wal is not None:
                    wal.append(Refused(reason, now))
                service.refuse_handshake(reason)
        replies += service.tick(now)
        if wal is not None:
            if service.tick_changed:
                wal.append(Ticked(now))
            if not hold_until_written(wal.commit, stop, clock):
                return  # stopped while the disk refused the round: its replies were never durable, never sent
        for identity, reply in coalesce_acks(replies):
            send(socket, reply, identity)
        if wal is not None and wal.due():
            compact(wal, service, clock())


def start_log(wal: ReplayLog, service: ReplayService, clock: Callable[[], float], stop: threading.Event) -> bool:
    """The start's epoch (`service.start_epoch` done) made durable before anything is served: a `Started` entry in
    the recovered log's last segment, then a snapshot (best effort); a fresh log's first snapshot must be written.
    False: `stop` came while the disk refused."""
    if not wal.opened():
        return hold_until_written(lambda: wal.compact(service, clock()), stop, clock)
    wal.append(Started(service.epoch, clock()))
    if not hold_until_written(wal.commit, stop, clock):
        return False
    compact(wal, service, clock())  # the start is in a snapshot; a torn tail of the last run is gone
    return True


def compact(wal: ReplayLog, service: ReplayService, now: float) -> None:
    """A snapshot and a new segment; one the disk refused is not fatal: the log goes on in its segment."""
    try:
        wal.compact(service, now)
    except WalWriteError as exc:
        log.error("%s; the log goes on in segment %d (compaction tried again after %d more entries)", exc,
                  wal.segment, max(1, wal.compact_every // 4))


def hold_until_written(write: Callable[[], object], stop: threading.Event, clock: Callable[[], float] | None = None
                       ) -> bool:
    """Run `write` (a commit of the round's inputs, or a fresh log's first snapshot) until the disk takes it: True,
    or False once `stop` is set first. While the disk refuses (ENOSPC, EIO: `WalWriteError` names the file and the
    errno) the replay holds: it takes no input and sends no reply, so nothing is acknowledged that is not durable,
    and its peers send again (docs/architecture.md, "A durable replay"). A `ServiceClock` skips the time held."""
    held_since = reminded = None
    while True:
        try:
            write()
        except WalWriteError as exc:
            now = time.monotonic()
            if reminded is None or now - reminded >= REMIND_S:
                log.error("%s: the replay holds (takes no input, acknowledges nothing) and tries again every %.0f s "
                          "until the disk takes it", exc, RETRY_S)
                held_since, reminded = held_since or now, now
            if stop.wait(RETRY_S):
                log.error("stopped while holding: the inputs not written were never acknowledged")
                return False
            continue
        if held_since is not None:
            held = time.monotonic() - held_since
            if isinstance(clock, ServiceClock):
                clock.skip(held)
            log.warning("the replay's log was written after %.1f s held: the replay goes on", held)
        return True


def open_log(config: Config, service: ReplayService) -> tuple[ReplayLog | None, Callable[[], float]]:
    """With `replay.durable`: lock and replay the log in `<run dir>/replay/` into `service`. Returns the log (None
    when not durable) and the service clock: monotonic seconds that go on from the last logged input, so the
    timers of the rebuilt state (leases, stage groups, batches) resume where they stopped (the time the replay was
    down does not count: its peers could not reach it)."""
    wal, base = None, 0.0
    if config.replay.durable:
        wal = ReplayLog(config.run_dir / "replay", config.replay.fsync, config.replay.compact_every)
        service_log = logging.getLogger("async_rl.replay")
        service_log_disabled, service_log.disabled = service_log.disabled, True  # the rebuild repeats old lines
        try:
            base = wal.recover(service, apply_entry)
        except BaseException:
            wal.close()
            raise
        finally:
            service_log.disabled = service_log_disabled
    return wal, ServiceClock(base)


class ServiceClock:
    """The service clock: monotonic seconds that go on from `base` (the last logged input's). Time the replay spent
    holding (`hold_until_written`) does not count, as the time it was down does not: its peers could not reach it,
    so their leases and the learner's batches must not expire for it."""

    def __init__(self, base: float = 0.0) -> None:
        self.base, self.started = base, time.monotonic()

    def __call__(self) -> float:
        return self.base + (time.monotonic() - self.started)

    def skip(self, seconds: float) -> None:
        self.started += seconds


def _volatile_epoch() -> int:
    """A replay without a log cannot count its starts: the wall clock's seconds tell them apart."""
    return int(time.time()) % 2**31 or 1


def apply_entry(service: ReplayService, entry: Entry) -> None:
    """Replay one logged input exactly as the socket loop handed it over."""
    match entry:
        case Received():
            handle_safely(service, entry.identity, decode(entry.message), entry.now, entry.peer)
        case Refused():
            service.refuse_handshake(entry.reason)
        case Undecodable():
            service.reject_frame(entry.identity, entry.detail)
        case Ticked():
            service.tick(entry.now)
        case Started():
            service.start_epoch(entry.epoch, entry.now)


def coalesce_acks(replies: list[Reply]) -> list[Reply]:
    """A round's replies, with the Acks to a peer that gets two or more of them sent as one `Acks` (where its first
    Ack was); every other reply as it is, in its order."""
    counts: dict[bytes, int] = {}
    for identity, reply in replies:
        if type(reply) is Ack:
            counts[identity] = counts.get(identity, 0) + 1
    if all(n < 2 for n in counts.values()):
        return replies
    merged: dict[bytes, Acks] = {}
    out: list[Reply] = []
    for identity, reply in replies:
        if type(reply) is not Ack or counts[identity] < 2:
            out.append((identity, reply))
            continue
        acks = merged.get(identity)
        if acks is None:
            acks = merged[identity] = Acks(msg_ids=[], duplicates=[])
            out.append((identity, acks))
        acks.msg_ids.append(reply.msg_id)
        if reply.duplicate:
            acks.duplicates.append(reply.msg_id)
    return out


def _receive_one(
    service: ReplayService, socket: zmq.Socket, clock: Callable[[], float], wal: ReplayLog | None
) -> list[Reply]:
    try:
        identity, message, peer = receive_from(socket)
    except BadFrame as exc:
        if wal is not None:
            wal.append(Undecodable(exc.identity, str(exc), clock()))
        return service.reject_frame(exc.identity, str(exc))
    assert identity is not None  # a ROUTER socket: every frame names its sender
    now = clock()
    if wal is not None:
        wal.append(Received(identity, now, encode(message), peer))
    return handle_safely(service, identity, message, now, peer)


def handle_safely(
    service: ReplayService, identity: bytes, message: AnyMessage, now: float, peer: str | None = None
) -> list[Reply]:
    """`handle`, except that a bug of ours must not take the service down for every other peer."""
    try:
        return service.handle(identity, message, now, peer)
    except Exception:  # a bug of ours must not take the service down for every other peer
        log.exception("internal error handling %s from %r", type(message).__name__, identity)
        service.counters.bad_messages += 1
        service.counters.rejected["internal_error"] = service.counters.rejected.get("internal_error", 0) + 1
        detail = "internal error in the replay service (see its log)"
        return [(identity, Error(msg_id=getattr(message, "msg_id", -1), code="bad_state", detail=detail))]
