"""The engine on its own thread: every call to an engine runs there, one at a time and in the order asked, while
the caller (the worker's socket loop) keeps reading acks, sending heartbeats and collecting judgements.

A weight update is a call like any other, so it runs between two generations and never inside one: every token's
version tag is still the version that produced it. Training and evaluation share one `EngineThread`, so an
evaluation's calls queue behind the training call in flight instead of running beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from rollout.engines.base import InferenceEngine

T = TypeVar("T")


class EngineThread:
    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    @property
    def version(self) -> int:
        """The policy version of the weights loaded now (a load in flight shows once it is done)."""
        return self.engine.version

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run `fn(*args)` on the engine's thread after every call asked for before it."""
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        """Cancel what is queued; a call already running finishes on its own (the engine's stop ends it early)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
