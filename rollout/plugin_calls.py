"""Environment calls on daemon threads with time limits: a reset, step or judge that never returns costs its own
trajectory (abandoned, counted) and one thread, never the worker's slots or its exit.

A Python thread cannot be killed. A call past its limit is written off: its trajectory is abandoned at once and
`PluginPool.write_off` starts a replacement thread, so the pool keeps its width; the hung thread stays parked
(a daemon, so it does not hold up the process's exit); the runner counts such calls until they return. Every future
carries `elapsed_s`, the call's own duration measured on its thread (what the env took, not when the caller
looked).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout.settings import RunnerSettings

DEFAULT_STEP_TIMEOUT_S = 300.0  # reset and step (a tool call), when neither rollout.step_timeout_s nor the env says
DEFAULT_JUDGE_TIMEOUT_S = 900.0  # judge, when neither rollout.judge_timeout_s nor the env says


def call_limits(rollout: RunnerSettings, factory: Any) -> tuple[float, float]:
    """(step, judge) time limits in seconds: `rollout.step_timeout_s` / `rollout.judge_timeout_s` when set, else the
    factory's optional `step_timeout_s` / `judge_timeout_s`, else the defaults above."""

    def pick(key: str, default: float) -> float:
        configured = getattr(rollout, key, None)
        if configured is not None:
            return float(configured)
        declared = getattr(factory, key, None)
        if isinstance(declared, int | float) and not isinstance(declared, bool) and declared > 0:
            return float(declared)
        return default

    return pick("step_timeout_s", DEFAULT_STEP_TIMEOUT_S), pick("judge_timeout_s", DEFAULT_JUDGE_TIMEOUT_S)


def _nothing() -> None:
    pass


def timed_call(future: Future, fn: Callable[..., Any], args: tuple, finished: Callable[[], None] = _nothing) -> None:
    """Run `fn(*args)` into `future`, with the call's own duration as `future.elapsed_s`; `finished` is called
    after `fn` returns and before the future is done (a pool marks its thread free there)."""
    if not future.set_running_or_notify_cancel():
        finished()
        return
    started = time.monotonic()
    try:
        result = fn(*args)
    except BaseException as exc:
        future.elapsed_s = time.monotonic() - started  # type: ignore[attr-defined]
        finished()
        future.set_exception(exc)
    else:
        future.elapsed_s = time.monotonic() - started  # type: ignore[attr-defined]
        finished()
        future.set_result(result)


class PluginPool:
    """A fixed number of daemon threads taking calls from one queue (ThreadPoolExecutor's threads are joined at
    exit, so one hung env call would hold the process forever)."""

    def __init__(self, width: int, name: str) -> None:
        self.name = name
        self._calls: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple] | None] = queue.SimpleQueue()
        self._numbers = itertools.count()
        self._threads: list[threading.Thread] = []
        for _ in range(width):
            self._start_thread()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._calls.put((future, fn, args))
        return future

    def write_off(self) -> None:
        """A call went past its limit: its thread is lost to the pool; start one to take its place."""
        self._threads = [t for t in self._threads if t.is_alive()]
        self._start_thread()

    def close(self) -> None:
        """Stop taking calls; idle threads end, busy ones end after their call (queued calls are cancelled)."""
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self._threads:
            self._calls.put(None)

    def _start_thread(self) -> None:
        thread = threading.Thread(target=self._work, name=f"{self.name}-{next(self._numbers)}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _work(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            timed_call(*item)


class ElasticPool:
    """Daemon threads started when a call finds none idle, kept while calls keep coming and ended after `idle_s`
    without one (judges: slow, many at once, not counted in the in-flight budget; starting a thread per judge cost
    a quarter of the worker's loop on the instant trap judge)."""

    def __init__(self, name: str, idle_s: float = 30.0) -> None:
        self.name = name
        self.idle_s = idle_s
        self._calls: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a call that no queued call has claimed
        self._numbers = itertools.count()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            self._calls.put((future, fn, args))
            if self._idle > 0:
                self._idle -= 1
            else:
                threading.Thread(target=self._work, name=f"{self.name}-{next(self._numbers)}", daemon=True).start()
        return future

    def threads(self) -> int:
        return sum(t.name.startswith(f"{self.name}-") for t in threading.enumerate())

    def _work(self) -> None:
        while True:
            try:
                item = self._calls.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if not self._calls.empty():
                        continue  # a call came as the wait ended: it counted on this thread
                    self._idle -= 1
                    return
            if item is None:
                return
            timed_call(*item, finished=self._free)

    def _free(self) -> None:
        """This thread's call returned: it counts as idle before its caller sees the result (so a caller that
        submits again at once finds it)."""
        with self._lock:
            self._idle += 1


class Waker:
    """A pipe that a finished call writes a byte to (`wake`, as a Future's done callback), so that one poll waits
    for the calls and the owner's sockets together (rollout/runner.py `pump`)."""

    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)
        # a call may finish after the runner closed: its byte must not go to whatever file reuses the number
        self._lock = threading.Lock()
        self._closed = False

    def wake(self, *_: Any) -> None:
        with self._lock:
            if self._closed:
                return
            try:  # noqa: SIM105 - called once per finished call: no context manager on this path
                os.write(self._write_fd, b"x")
            except OSError:  # full: a wake-up is pending anyway
                pass

    def clear(self) -> None:
        """Take the bytes waiting (called when a poll found some: more than 4096 only make the next poll return)."""
        try:  # noqa: SIM105 - on every wake-up: no context manager on this path
            os.read(self.fd, 4096)
        except OSError:
            pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for fd in (self.fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def start_daemon_call(fn: Callable[..., Any], *args: Any, name: str) -> Future:
    """One call on a daemon thread of its own (a call that may hang, e.g. the close of an env whose call hung)."""
    future: Future = Future()
    threading.Thread(target=timed_call, args=(future, fn, args), name=name, daemon=True).start()
    return future
