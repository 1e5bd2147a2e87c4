"""The one small interface every inference engine offers the agent loop (docs/architecture.md).

An engine turns token-id prompts into sampled continuations with the behaviour log-probability and the policy
version of every generated token, and swaps in new weights when the learner publishes a version.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from async_rl.errors import AsyncRLError


class EngineUnavailable(AsyncRLError):
    """The engine cannot generate at all (e.g. every SGLang server is gone); nothing of the call was produced."""


class EngineStopped(AsyncRLError):
    """The engine was told to stop (its stop event set, or `close()`) while a `generate` was still waiting on its
    servers; nothing of the call was returned. Not a failure: the caller is stopping anyway."""


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 1
    stop_token_ids: list[int] = field(default_factory=list)  # a stop token is kept in the output, then the row ends
    stop: list[str] = field(default_factory=list)  # stop strings: the row ends at the token completing one (kept)


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]  # log mu(a): behaviour log-probability of each generated token
    versions: list[int]  # v_b: the policy version that produced each token
    finish_reason: Literal["stop", "length"]


class InferenceEngine(Protocol):
    version: int  # policy version of the weights currently loaded
    weights_refused: int  # published weights refused for failing their checksum (torn, changed), never loaded

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]: ...

    def update_weights(self, version: int, path: str, format: str | None = None) -> None:
        """Take policy `version` from `path` as the learner published it in `format` (`WeightsPublished.format`;
        None: the format this engine is configured for): the engine's loader for that format, chosen with
        async_rl/weights/base.py `loader_for`, checks its checksums first; WeightsFormatError naming a format the
        engine cannot load."""
        ...

    def close(self) -> None: ...
