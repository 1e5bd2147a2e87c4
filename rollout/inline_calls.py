"""Env calls run on the owner's loop thread while they are instant, watched: one still running after the budget hands
the loop to a fresh thread and finishes as a pool call would.

A reset, step or judge that returns in microseconds (the trap env's, a string compare) costs more on a pool thread
than it does itself: a queue put, a thread's wake-up, a Future and the GIL passed back and forth, per call (about a
third of a worker's CPU on a one-token task: docs/results.md, "vs_trl"). So the runner (rollout/runner.py) runs
such calls inline, one after another, on the thread that runs its loop. A call cannot be interrupted, so the
watchdog, a daemon thread that looks every `tick_s`, does not try: when the call it finds running has run
`budget_s` or longer, it turns that call into a `Future` (the runner files it with its pool calls, so the step and
judge time limits abandon it as they abandon any hung call) and calls `resume`, which starts the owner's loop again
on a new thread. The old thread, stuck in the env, is written off: when the call returns, its result goes into
the Future and the thread leaves the loop by raising `LoopMoved` (caught where the owner started the thread),
touching nothing else. The runner then sends that kind of call (reset, step or judge) of its env to its pools
(an env that was slow once is likely to be slow again, and a move costs a thread) until 64 of them in a row were
instant (rollout/env_calls.py, which also pools a kind whose calls are slow on average without being hung: inline
calls run one after another). A call that overran only because the machine was busy costs one move, not the rest
of the run.

The handshake is one lock: the watchdog moves a call only while the call is still inside the env, and the loop
thread, once the env returns, learns under the same lock whether its call was moved.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

DEFAULT_BUDGET_S = 0.02  # rollout.inline_budget_s's default: the longest the loop waits on one env call


class LoopMoved(BaseException):
    """Raised on a written-off loop thread after its moved call returned: the loop runs on another thread now; the
    thread's entry catches it and ends (a BaseException, so no `except Exception` on the way takes it)."""


@dataclass
class _Running:
    started: float
    kind: str
    episode: Any
    future: Future | None = None  # set by the watchdog when it moves the call


class InlineCalls:
    """Runs env calls on the calling thread; `on_moved(kind, episode, future)` files a moved call, `resume()` starts
    the owner's loop on a new thread. `moved` counts the calls moved so far."""

    def __init__(self, budget_s: float, resume: Callable[[], None], tick_s: float | None = None) -> None:
        self.budget_s = budget_s
        self.tick_s = tick_s if tick_s is not None else max(budget_s / 2, 0.001)
        self.resume = resume
        self.on_moved: Callable[[str, Any, Future], None] | None = None  # the runner's (EpisodeRunner.__init__)
        self.moved = 0
        self._lock = threading.Lock()
        self._running: _Running | None = None
        self._closed = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="inline-watchdog", daemon=True)
        self._watchdog.start()

    def call(self, kind: str, episode: Any, fn: Callable[..., Any], *args: Any) -> tuple[Any, BaseException | None,
                                                                                          float]:
        """(result, the exception it raised or None, seconds) of `fn(*args)` run here; raises LoopMoved instead
        when the watchdog moved the call meanwhile (its result then went into the moved call's Future)."""
        running = _Running(time.monotonic(), kind, episode)
        self._running = running  # a plain store: the watchdog reads it under the lock below
        result: Any = None
        error: BaseException | None = None
        try:
            result = fn(*args)
        except Exception as exc:  # the env's own error: the runner handles it as it handles a pool call's
            error = exc
        elapsed = time.monotonic() - running.started
        with self._lock:
            if self._running is running:  # a moved call returns while the loop's new thread may run its own
                self._running = None
            future = running.future
        if future is None:
            return result, error, elapsed
        future.elapsed_s = elapsed  # type: ignore[attr-defined]  # as rollout/plugin_calls.py's timed_call sets it
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
        raise LoopMoved

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.wait(self.tick_s):
            with self._lock:
                running = self._running
                if running is None or running.future is not None or time.monotonic() - running.started < self.budget_s:
                    continue
                running.future = Future()
                running.future.set_running_or_notify_cancel()
                self.moved += 1
                if self.on_moved is not None:  # the loop thread is inside the env: the runner's state is ours
                    self.on_moved(running.kind, running.episode, running.future)
            self.resume()
