"""Where an episode runner's env calls run and for how long: inline on the owner's thread (rollout/inline_calls.py)
while they are instant, else on pools of daemon threads (rollout/plugin_calls.py), each under its time limit.

The runner (rollout/runner.py) hands every reset, step and judge to `EnvCalls.submit` and takes the results back,
in one form whichever way the call ran, from `run_queued` (inline calls, run there and then), `returned` (pool
calls that are done) and `expired` (calls past their limit, written off: the runner abandons their trajectories).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from rollout.episode import Episode
from rollout.inline_calls import InlineCalls
from rollout.plugin_calls import ElasticPool, PluginPool

log = logging.getLogger("async_rl.rollout")

# A call is instant under a twentieth of rollout.inline_budget_s (1 ms at its default): a pool call's hand-off costs
# ~0.1 ms of CPU (docs/results.md, "worker_cpu"), so a call ten times that is worth overlapping with the others on
# a pool. Inline calls run one after another: a tool that waits 10 ms (a sandbox, a request) inline caps a worker
# at 100 steps a second, where a pool runs its trajectories' waits side by side. A kind goes to the pools once the
# mean of its inline calls (a moving average over about the last MEAN_OVER) is not instant, long before the
# watchdog's budget (a hung call) would move it.
INSTANT_FRACTION = 20
MEAN_OVER = 16
# A pooled kind goes back inline after this many of its pool calls in a row were instant: a call that overran only
# because the machine was busy (its thread waited for a core) costs one move, not the rest of the run on the pools.
BACK_INLINE_AFTER = 64


@dataclass
class Returned:
    """One env call's result: `error` is what it raised (then `result` is None); `elapsed_s` its own duration."""

    kind: str
    episode: Episode
    result: Any
    error: BaseException | None
    elapsed_s: float


class EnvCalls:
    def __init__(self, env_name: str, width: int, step_timeout_s: float, judge_timeout_s: float,
                 inline: InlineCalls | None = None, wake: Callable[[Future], None] | None = None) -> None:
        self.env_name = env_name
        self.wake = wake  # each pool call's done callback (the runner's Waker)
        self.limits = {"reset": step_timeout_s, "step": step_timeout_s, "judge": judge_timeout_s}
        self.pool = PluginPool(width, name="env-step")  # resets and steps: at most one per trajectory in flight
        self.judge_pool = ElasticPool(name="env-judge")  # judges: slow, many at once, outside the in-flight budget
        self.calls: dict[Future, tuple[str, Episode]] = {}  # pool calls under way (and moved inline ones)
        self.inline = inline
        self.queue: deque[tuple[str, Episode, Callable, tuple]] = deque()  # inline calls not run yet
        self.pooled_kinds: set[str] = set()  # kinds that overran the inline budget: on the pools for now
        self.quick_in_a_row: dict[str, int] = {}  # per pooled kind: its pool calls in a row that were instant
        self.mean_s: dict[str, float] = {}  # per inline kind: its calls' moving mean time (over ~MEAN_OVER calls)
        self.moved: set[Future] = set()  # moved inline calls among `calls` (their thread is not the pool's)
        self.timeouts = 0  # calls written off past their time limit
        self.written_off: list[Future] = []  # those calls, until they return
        if inline is not None:
            inline.on_moved = self._moved

    def submit(self, kind: str, episode: Episode, fn: Callable, *args: object) -> None:
        """A reset, step or judge of `episode`: queued for `run_queued`, or on its pool."""
        episode.since = time.monotonic()
        if self.inline is not None and kind not in self.pooled_kinds:
            self.queue.append((kind, episode, fn, args))
        else:
            self._to_pool(kind, episode, fn, args)

    def run_queued(self, inline: bool, handle: Callable[[Returned], None]) -> None:
        """The queued calls, here, one after another, each result to `handle` as it comes. `inline=False` (an
        evaluation has the engine and this thread): they go to the pools instead. May raise LoopMoved
        (rollout/inline_calls.py): the calls not run yet stay queued for the loop's next thread."""
        while self.queue:
            kind, episode, fn, args = self.queue.popleft()
            if episode.phase == "done":  # abandoned while queued
                continue
            if not inline or self.inline is None or kind in self.pooled_kinds:  # queued before its kind overran
                self._to_pool(kind, episode, fn, args)
                continue
            episode.since = time.monotonic()
            result, error, elapsed = self.inline.call(kind, episode, fn, *args)
            self._inline_call_took(kind, elapsed)
            handle(Returned(kind, episode, result, error, elapsed))

    def _inline_call_took(self, kind: str, elapsed: float) -> None:
        """A kind whose inline calls are not instant on average goes to the pools (they overlap there)."""
        mean = self.mean_s.get(kind, 0.0)
        mean += (elapsed - mean) / MEAN_OVER
        self.mean_s[kind] = mean
        if mean > self._instant_s():
            log.info("env %r: its %ss take %.1f ms on average: they run on a pool for now, side by side",
                     self.env_name, kind, mean * 1e3)
            self._to_pools(kind)

    def returned(self, kinds: tuple[str, ...]) -> list[Returned]:
        """The pool calls of `kinds` that are done, taken off the books (results of abandoned trajectories too)."""
        done = []
        for future in [f for f, (kind, _) in self.calls.items() if kind in kinds and f.done()]:
            kind, episode = self.calls.pop(future)
            self.moved.discard(future)
            try:
                result, error = future.result(), None
            except Exception as exc:
                result, error = None, exc
            elapsed = getattr(future, "elapsed_s", time.monotonic() - episode.since)
            done.append(Returned(kind, episode, result, error, elapsed))
            if kind in self.pooled_kinds:
                self._pooled_call_took(kind, elapsed)
        return done

    def _pooled_call_took(self, kind: str, elapsed: float) -> None:
        assert self.inline is not None  # only an inline kind is ever pooled
        quick = self.quick_in_a_row.get(kind, 0) + 1 if elapsed < self._instant_s() else 0
        self.quick_in_a_row[kind] = quick
        if quick >= BACK_INLINE_AFTER:
            self.pooled_kinds.discard(kind)
            self.mean_s.pop(kind, None)
            log.info("env %r: its last %d %ss each took under %g s on a pool: inline again", self.env_name, quick,
                     kind, self._instant_s())

    def expired(self, now: float) -> list[tuple[str, Episode, float]]:
        """(kind, episode, limit) of each call past its time limit: written off (a pool's thread is replaced)."""
        late = []
        for future, (kind, episode) in list(self.calls.items()):
            limit = self.limits[kind]
            if future.done() or now - episode.since < limit:
                continue
            del self.calls[future]
            self.written_off.append(future)
            self.timeouts += 1
            if kind != "judge" and future not in self.moved:  # a moved inline call's thread is no pool's
                self.pool.write_off()
            self.moved.discard(future)
            late.append((kind, episode, limit))
        return late

    def pending(self) -> list[Future]:
        return list(self.calls)

    def judging(self) -> int:
        return sum(kind == "judge" for kind, _ in self.calls.values()) + sum(k == "judge" for k, *_ in self.queue)

    def hung(self) -> int:
        """Calls written off past their time limit that have still not returned (each holds a thread)."""
        self.written_off = [f for f in self.written_off if not f.done()]
        return len(self.written_off)

    def close(self) -> None:
        self.pool.close()

    def _to_pool(self, kind: str, episode: Episode, fn: Callable, args: tuple) -> None:
        pool = self.judge_pool if kind == "judge" else self.pool
        future = pool.submit(fn, *args)
        self.calls[future] = (kind, episode)
        if self.wake is not None:
            future.add_done_callback(self.wake)

    def _instant_s(self) -> float:
        return self.inline.budget_s / INSTANT_FRACTION if self.inline is not None else 0.0

    def _to_pools(self, kind: str) -> None:
        self.quick_in_a_row[kind] = 0
        self.pooled_kinds.add(kind)

    def _moved(self, kind: str, episode: Episode, future: Future) -> None:
        """The watchdog moved an inline call past its budget (the loop thread is inside the env, so the books are
        ours): filed with the pool calls, so its time limit applies, and this kind goes to the pools from now on."""
        if kind not in self.pooled_kinds:
            log.info("env %r: a %s took longer than rollout.inline_budget_s (%g s): its %ss run on a pool for now",
                     self.env_name, kind, self.inline.budget_s if self.inline else 0.0, kind)
        self._to_pools(kind)
        self.calls[future] = (kind, episode)
        self.moved.add(future)
        if self.wake is not None:
            future.add_done_callback(self.wake)
