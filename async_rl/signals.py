"""SIGTERM / SIGINT as a stop request: the one way every role (replay, learner, rollout worker) turns a signal into
its stop event, so that the current round, step or send finishes instead of being killed halfway."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("async_rl.signals")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """A role's stop event plus, if one arrived, the name of the signal that set it."""

    def __init__(self, event: threading.Event | None = None) -> None:
        self.event = event if event is not None else threading.Event()
        self.signal_name: str | None = None

    def handle(self, signum: int, _frame: object) -> None:
        self.signal_name = signal.Signals(signum).name
        log.info("%s received: finishing what is in hand, then stopping", self.signal_name)
        self.event.set()


@contextmanager
def stop_on_signals(event: threading.Event | None = None) -> Iterator[StopRequest]:
    """While open, SIGTERM and SIGINT set `event` (a new one when None) instead of raising; the handlers before are
    put back on exit. Python lets only the main thread install handlers: elsewhere (a role run on a thread, as tests
    do) the request is yielded and only its event stops the role."""
    request = StopRequest(event)
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {sig: signal.signal(sig, request.handle) for sig in STOP_SIGNALS}
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
