"""An episode runner's engine calls: one at a time, every waiting trajectory in it, run on the engine's thread.

A call holds each trajectory waiting for an action. Near `model.max_seq_len` a trajectory's action budget shrinks
to what still fits: trajectories with the same budget share one `generate` (the torch engine samples them as one
batch; the SGLang engine sends concurrent requests), and one call runs those generates in turn on the engine's own
thread (rollout/engines/thread.py), so the runner's owner keeps its sockets answered while a slow model
generates; weights change only between calls, so every token's version tag is the version that produced it.

A trajectory whose env asked to hear its action's tokens as they are sampled (`Prompt.on_token`, the `agent` env's
streamed completions) hears each from the engine's thread at the step that sampled it, when the engine streams
(`streams_tokens`: the built-in one, which samples a token of every row per forward pass); from an engine that does
not (SGLang, vLLM: their HTTP and offline calls return whole generations), it hears them all when its generate
returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace

from rollout.engines import Generation, InferenceEngine, SamplingParams
from rollout.engines.thread import EngineThread
from rollout.episode import Episode

# What a finished call gives: for each generate, its trajectories, their generations and the generate's seconds.
CallResult = list[tuple[list[Episode], list[Generation], float]]


class EngineCalls:
    """The engine call under way (at most one) and the trajectories in it."""

    def __init__(self, engine: InferenceEngine | EngineThread, params: SamplingParams) -> None:
        # A worker shares one engine thread between its training and evaluation runners; a bare engine gets its own.
        self.own_thread = not isinstance(engine, EngineThread)
        self.thread = engine if isinstance(engine, EngineThread) else EngineThread(engine)
        self.engine = self.thread.engine
        self.params = params
        self.call: Future | None = None
        self.episodes: list[Episode] = []  # the trajectories of the call under way

    def start(self, ready: list[Episode], rooms: list[int]) -> None:
        """One call for all of `ready`, each with `rooms[i]` action tokens at most (a generate per budget)."""
        by_room: dict[int, list[Episode]] = {}
        for episode, room in zip(ready, rooms, strict=True):
            by_room.setdefault(room, []).append(episode)
        batches = []
        for room, episodes in sorted(by_room.items(), reverse=True):
            params = self.params if room == self.params.max_new_tokens else replace(self.params, max_new_tokens=room)
            listeners = [e.on_token for e in episodes]
            batches.append((episodes, [list(e.context) for e in episodes], params,
                            listeners if any(listeners) else None))
        self.episodes = list(ready)
        self.call = self.thread.submit(self._generate, batches)

    def finished(self) -> tuple[Future, list[Episode]] | None:
        """The call, if one has finished, and its trajectories; the next call can start."""
        call = self.call
        if call is None or not call.done():
            return None
        episodes, self.call, self.episodes = self.episodes, None, []
        return call, episodes

    def close(self) -> None:
        """Without waiting for a call under way."""
        if self.own_thread:
            self.thread.close()

    def _generate(self, batches: list) -> CallResult:
        """On the engine's thread: the generates of one call, each with its duration."""
        results = []
        streams = getattr(self.engine, "streams_tokens", False)
        for episodes, prompts, params, listeners in batches:
            called = time.monotonic()
            if listeners is not None and streams:
                generations = self.engine.generate(prompts, params, on_token=_to_rows(listeners))
            else:
                generations = self.engine.generate(prompts, params)
                for listener, generation in zip(listeners or (), generations, strict=False):
                    for token in generation.token_ids if listener is not None else ():
                        listener(token)
            results.append((episodes, generations, time.monotonic() - called))
        return results


def _to_rows(listeners: list[Callable[[int], None] | None]) -> Callable[[int, int], None]:
    def on_token(row: int, token: int) -> None:
        listener = listeners[row]
        if listener is not None:
            listener(token)

    return on_token
