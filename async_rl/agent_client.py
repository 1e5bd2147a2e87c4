"""What an agent trained as it is calls (`async_rl.reward`): a thin client of the rollout worker's OpenAI-compatible
endpoint, made through the agent's own OpenAI client (rollout/agents/endpoint.py; docs/environments.md). The kernel
imports no role and not `openai`: the client is used through its `post` method."""

from __future__ import annotations

import inspect
import math
from typing import Any

REWARD_PATH = "/async-rl/reward"  # under the trajectory's base URL (.../t/<key>/v1)


def reward(client: Any, value: float) -> Any:
    """Add `value` to the stage reward of the latest completion `client`'s trajectory got (several calls add up).

    With an `openai.AsyncOpenAI` client, await it: `await async_rl.reward(client, 0.1)`; with an `openai.OpenAI`
    client it is done when the call returns. The client must be the one the `agent` env handed the agent (or one
    with the same base URL and key). A reward before the first completion, or after the trajectory is over, raises
    the client's error (openai.BadRequestError, openai.ConflictError)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"async_rl.reward: expected a finite number, got {value!r}")
    post = getattr(client, "post", None)
    if not callable(post):
        raise TypeError(f"async_rl.reward: expected an openai.OpenAI or openai.AsyncOpenAI client, got "
                        f"{type(client).__name__}")
    sent = post(REWARD_PATH, cast_to=str, body={"value": float(value)})  # the reply's text, unparsed
    if inspect.isawaitable(sent):
        return _done(sent)
    return _Finished()


async def _done(sent: Any) -> None:
    await sent


class _Finished:
    """What `reward` gives for a synchronous client: already done, and awaiting it is harmless."""

    def __await__(self) -> Any:
        return iter(())
