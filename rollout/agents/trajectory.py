"""One trajectory of the `agent` env: the user's agent on a thread of its own, its requests as the runner's turns.

AgentEnv is the bridge between two sides that meet under one condition variable. The endpoint's HTTP threads
(rollout/agents/endpoint.py) hand over each chat-completion request (`complete`) or stage reward (`reward`) and
wait for the answer; the episode runner's env threads (rollout/runner.py) take each request that extends the
trajectory as the tokens it adds (`reset_tokens`, `step_tokens`), answer it with the engine's generation as a
completion (rollout/agents/chat_api.py), and make the outcome of what the agent returned (`judge`, `judgement_of`). The
agent's function runs to its return or its exception on its own thread (`_run_agent`: an async one on an event
loop of its own); the runner's step time limit measures the agent's time between two model calls
(`waiting_since`), and a trajectory closed while its agent works counts a timeout or a cancellation and cancels the
agent's task on that loop. The factory the trajectories share (settings, tasks, the user's agent and judge, the
endpoint, the counts) is rollout/agents/env.py's AgentFactory.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from async_rl.env_types import Judgement, StepResult, Task
from rollout.agents.chat_api import (
    ChatError,
    ChatRequest,
    ChatTemplate,
    assistant_message,
    completion,
    first_difference,
    normalise_messages,
    parse_request,
    stream_events,
)
from rollout.agents.endpoint import ChatEndpoint, error
from rollout.envs.base import EnvError, Prompt

log = logging.getLogger("async_rl.rollout")

ENV = "agent"


class AgentHost(Protocol):
    """What a trajectory asks of its factory (AgentFactory, rollout/agents/env.py, and its subclasses)."""

    name: str  # the env.name the agent's errors give
    settings: Any  # its `entry`, `judge` and `model` (AgentSettings)
    entry: Callable[..., Any]  # the user's agent
    judge_fn: Callable[..., Any] | None  # the user's slow judge, if any
    step_timeout_s: float  # the runner's step limit
    template: ChatTemplate | None  # the tokenizer's chat template (bound by the runner)
    parse: Any  # the runner's tool-call parser

    def endpoint_for_trajectories(self) -> ChatEndpoint: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def count(self, what: str, n: int = 1) -> None: ...


def judgement_of(value: Any, what: str) -> Judgement:
    """An outcome from a number (success when >= 1) or {"reward": r, "success": bool, other numbers as info}."""

    def number(x: Any, name: str) -> float:
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
            raise EnvError(f"env {ENV!r}: {what} gave {name} {x!r}, expected a finite number")
        return float(x)

    if isinstance(value, dict):
        reward = number(value.get("reward"), "reward")
        success = value.get("success", reward >= 1.0 - 1e-9)
        info = {str(k): float(v) for k, v in value.items() if k not in ("reward", "success")
                and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}
        return Judgement(reward, bool(success), info)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EnvError(f"env {ENV!r}: {what} returned {type(value).__name__}, expected a number or "
                       '{"reward": ..., "success": ...}')
    reward = number(value, "the reward")
    return Judgement(reward, reward >= 1.0 - 1e-9)


class _Call:
    """One completion request, waiting for its answer."""

    def __init__(self, request: ChatRequest) -> None:
        self.request = request
        self.done = threading.Event()
        self.reply: tuple[int, dict[str, Any] | bytes] = (500, {})


class AgentEnv:
    """One trajectory: the user's agent on its own thread, and its requests as the runner's turns."""

    def __init__(self, factory: AgentHost) -> None:
        self.factory = factory
        self.cond = threading.Condition()
        self.task: Task | None = None
        self.key, self.url = "", ""
        self.incoming: _Call | None = None  # a request the runner has not taken yet
        self.serving: _Call | None = None  # the request whose answer the engine is generating
        self.refuse: tuple[int, dict[str, Any]] | None = None  # what new requests get (the trajectory is over)
        self.finished, self.closed = False, False
        self.result: Any = None
        self.error: BaseException | None = None
        self.rewards = 0.0  # stage reward of the latest completion so far
        self.answered = 0  # completions returned
        self.sent: list[dict[str, Any]] | None = None  # the messages of the last request answered
        self.tools: list[dict[str, Any]] = []
        self.returned: dict[str, Any] = {}  # the assistant message it got (normalised)
        self.context_len = 0
        self.waiting_since = 0.0  # since when the agent, not the engine, has the turn
        self.loop: asyncio.AbstractEventLoop | None = None
        self.agent_task: asyncio.Task | None = None

    # --- the endpoint's side (HTTP threads) -------------------------------------------------------------------

    def complete(self, body: Any) -> tuple[int, dict[str, Any] | bytes]:
        try:
            request = parse_request(body)
        except ChatError as exc:
            self.factory.count("bad_requests")
            return exc.status, exc.payload()
        call = _Call(request)
        with self.cond:
            if self.refuse is not None:
                return self.refuse
            if self.incoming is not None or self.serving is not None:
                return error(409, "this trajectory has a completion under way: one request at a time",
                             "concurrent_request")
            self.incoming = call
            self.cond.notify_all()
        call.done.wait()
        return call.reply

    def reward(self, body: Any) -> tuple[int, dict[str, Any]]:
        value = body.get("value") if isinstance(body, dict) else None
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return error(400, f"a reward needs {{'value': <finite number>}}, got {body!r:.200}",
                         "invalid_request_error")
        with self.cond:
            if self.closed:
                return error(409, "this trajectory is over", "trajectory_over")
            if self.answered == 0:
                return error(400, "no completion to reward yet: a reward attaches to the latest completion",
                             "no_completion")
            self.rewards += float(value)
            stage = self.answered - 1
        self.factory.count("rewards")
        return 200, {"object": "async-rl.reward", "stage": stage, "value": float(value)}

    # --- the runner's side (its env threads) ------------------------------------------------------------------

    def reset_tokens(self, task: Task) -> Prompt:
        self.task = task
        self.key, self.url = self.factory.endpoint_for_trajectories().add(self)
        self.waiting_since = time.monotonic()
        self.factory.count("started")
        threading.Thread(target=self._run_agent, name=f"agent-{task.id}", daemon=True).start()
        taken = self._next()
        if taken is None:
            if self.error is None:
                self.factory.count("no_model_call")
                raise EnvError(f"env {ENV!r}: the agent returned {self.result!r:.80} without calling the model")
            raise self._agent_error()
        call, tokens = taken
        return Prompt(tokens, call.request.max_new_tokens)

    def step_tokens(self, generation: Any) -> StepResult:
        call = self.serving
        assert call is not None, "step_tokens without a request under way"
        factory = self.factory
        text = factory.decode(generation.token_ids)
        message, calls, errors = assistant_message(text, factory.parse, call.request.parse_names, self.answered)
        finish = "tool_calls" if calls else ("length" if generation.finish_reason == "length" else "stop")
        payload = completion(message, finish, factory.settings.model, f"chatcmpl-{self.key[:10]}-{self.answered}",
                             int(time.time()), self.context_len, len(generation.token_ids))
        self.sent, self.tools = call.request.messages, call.request.tools
        self.returned = normalise_messages([message])[0]
        self.context_len += len(generation.token_ids)
        with self.cond:
            self.rewards = 0.0
            self.answered += 1
            self.serving = None
            self.waiting_since = time.monotonic()
        factory.count("completions")
        factory.count("tool_calls", calls)
        factory.count("tool_call_errors", errors)
        self._answer(call, 200, stream_events(payload) if call.request.stream else payload)
        taken = self._next()
        with self.cond:
            reward, self.rewards = self.rewards, 0.0
        if taken is None:
            if self.error is not None:
                raise self._agent_error()
            return StepResult(None, reward, True)
        call, tokens = taken
        return StepResult(Prompt(tokens, call.request.max_new_tokens), reward, False)  # type: ignore[arg-type]

    def judge(self) -> Judgement:
        overflow = error(400, "the trajectory's context reached model.max_seq_len", "context_length_exceeded")
        with self.cond:
            call, self.serving = self.serving, None  # truncated: the request the model will not answer
            self.refuse = overflow
            self.waiting_since = min(self.waiting_since, time.monotonic())  # the agent's turn, to return
        if call is not None:
            self._answer(call, *overflow)
        with self.cond:
            while not self.finished and not self.closed:
                self.cond.wait()
        if self.closed and not self.finished:
            raise EnvError(f"env {ENV!r}: the trajectory was closed before the agent returned")
        if self.error is not None:
            raise self._agent_error()
        value = self.result
        judge = self.factory.judge_fn
        if judge is not None:
            assert self.task is not None
            try:
                value = judge(dict(self.task.data), value)
                if inspect.isawaitable(value):
                    value = asyncio.run(_awaited(value))
            except Exception as exc:
                raise EnvError(f"env {ENV!r}: the judge {self.factory.settings.judge} raised "
                               f"{type(exc).__name__}: {exc}") from exc
            return judgement_of(value, f"the judge {self.factory.settings.judge}")
        return judgement_of(value, f"the agent {self.factory.settings.entry}")

    def close(self) -> None:
        gone = error(409, "this trajectory was abandoned", "trajectory_abandoned")
        with self.cond:
            self.closed = True
            self.refuse = self.refuse or gone
            calls = [c for c in (self.incoming, self.serving) if c is not None]
            self.incoming = self.serving = None
            running = not self.finished and self.task is not None
            self.cond.notify_all()
        for call in calls:
            self._answer(call, *gone)
        if self.key:
            self.factory.endpoint_for_trajectories().remove(self.key)
        if running:  # abandoned while the agent worked: past its time limit, or the worker stopping
            late = time.monotonic() - self.waiting_since >= 0.99 * self.factory.step_timeout_s
            self.factory.count("timeouts" if late else "cancelled")
            loop, agent_task = self.loop, self.agent_task
            if loop is not None and agent_task is not None:
                with contextlib.suppress(RuntimeError):  # its loop already closed: it is ending anyway
                    loop.call_soon_threadsafe(agent_task.cancel)

    # --- helpers ----------------------------------------------------------------------------------------------

    def _next(self) -> tuple[_Call, list[int]] | None:
        """The agent's next request that extends the trajectory, with its new tokens (the others answered with
        their error, the agent may send another); None when the agent returned (or raised)."""
        while True:
            with self.cond:
                while self.incoming is None and not self.finished and not self.closed:
                    self.cond.wait()
                if self.closed:
                    raise EnvError(f"env {ENV!r}: the trajectory was closed")
                if self.incoming is None:
                    return None
                call, self.incoming = self.incoming, None
                self.serving = call
                self.waiting_since = math.inf  # the engine's turn now: the agent is not late while it waits
            try:
                tokens = self._tokens(call.request)
            except ChatError as exc:
                self.factory.count("history_edits" if exc.code == "history_edited" else "bad_requests")
                with self.cond:
                    self.serving = None
                    self.waiting_since = time.monotonic()
                self._answer(call, exc.status, exc.payload())
                continue
            self.context_len += len(tokens)
            return call, tokens

    def _tokens(self, request: ChatRequest) -> list[int]:
        template = self.factory.template
        assert template is not None
        if self.sent is None:
            return template.first(request)
        why = first_difference(self.sent, self.returned, self.tools, request)
        if why is not None:
            raise ChatError(f"history_edited: this request does not extend the trajectory: {why}. Each request of "
                            "a trajectory repeats the one before and the answer it got, then adds messages.",
                            code="history_edited")
        return template.delta(request, len(self.sent) + 1)

    def _answer(self, call: _Call, status: int, payload: dict[str, Any] | bytes) -> None:
        call.reply = (status, payload)
        call.done.set()

    def _agent_error(self) -> EnvError:
        exc = self.error
        return EnvError(f"env {self.factory.name!r}: the agent raised {type(exc).__name__}: {str(exc)[:300]}")

    def _run_agent(self) -> None:
        """On the agent's own thread: the user's function, to its return or its exception."""
        entry, settings = self.factory.entry, self.factory.settings
        assert self.task is not None
        try:
            if inspect.iscoroutinefunction(entry):
                result = asyncio.run(self._main())
            else:
                import openai

                with openai.OpenAI(base_url=self.url, api_key=self.key, max_retries=0, timeout=None,
                                   http_client=openai.DefaultHttpxClient(verify=_tls())) as client:
                    result = entry(dict(self.task.data), client, settings.model)
        except BaseException as exc:  # noqa: BLE001 - whatever the agent raised ends its trajectory only
            with self.cond:
                self.error, self.finished = exc, True
                closed = self.closed
                self.cond.notify_all()
            if not closed:
                self.factory.count("errors")
                log.warning("agent of trajectory %s raised %s: %s", self.task.id, type(exc).__name__, exc)
            return
        with self.cond:
            self.result, self.finished = result, True
            self.cond.notify_all()
        self.factory.count("returned")

    async def _main(self) -> Any:
        import openai

        self.loop, self.agent_task = asyncio.get_running_loop(), asyncio.current_task()
        if self.closed:
            raise asyncio.CancelledError
        assert self.task is not None
        async with openai.AsyncOpenAI(base_url=self.url, api_key=self.key, max_retries=0, timeout=None,
                                      http_client=openai.DefaultAsyncHttpxClient(verify=_tls())) as client:
            return await self.factory.entry(dict(self.task.data), client, self.factory.settings.model)


_TLS: list[ssl.SSLContext] = []


def _tls() -> ssl.SSLContext:
    """One TLS context for every agent's client (each building its own loaded the CA file: ~0.1 s of CPU a
    trajectory). Their base URL is plain HTTP on loopback; a client the agent builds for elsewhere is its own."""
    with _TLS_LOCK:
        if not _TLS:
            _TLS.append(ssl.create_default_context())
        return _TLS[0]


_TLS_LOCK = threading.Lock()


async def _awaited(value: Any) -> Any:
    return await value
