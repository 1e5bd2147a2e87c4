"""`env.name=agent`: train an agent you already have, written against the OpenAI client, as it is
(docs/environments.md, "Your agent as it is").

    env.name=agent env.kwargs.entry=MODULE:FUNCTION env.kwargs.tasks=FILE.jsonl [env.kwargs.judge=MODULE:FUNCTION]

    async def FUNCTION(task: dict, client: openai.AsyncOpenAI, model: str) -> float | dict

Each trajectory runs FUNCTION once, on a thread of its own, with one line of the tasks file (a JSON object, given
as it is) and a client whose base URL is the trajectory's own on the worker's OpenAI-compatible endpoint
(rollout/openai_endpoint.py). Every chat completion the agent asks for is one stage: the episode runner generates
it with the worker's engine like any env's action (rollout/agent.py, a token-level env: rollout/envs/base.py), the
endpoint returns it with its tool calls parsed (rollout/chat_api.py), and its tokens, log-probs and policy versions
go to the replay when the agent's next request (or its return) ends the stage. `await async_rl.reward(client, x)`
adds x to the stage reward of the latest completion. What FUNCTION returns is the outcome: a number (success when
>= 1) or {"reward": r, "success": bool, <other numbers>: averaged by evaluation}; with `env.kwargs.judge` the slow
judge `JUDGE(task, returned)` (sync or async) makes the outcome of whatever the agent returned.

A synchronous FUNCTION (smolagents, a plain loop) gets an `openai.OpenAI` client instead and runs as it is.

Failures cost the trajectory only, each counted on the rollout metrics line: an agent that raises (agent_errors),
returns without calling the model (agent_no_model_call), or works longer than `env.kwargs.timeout_s` between two
model calls (agent_timeouts: the runner's step time limit, rollout.step_timeout_s when set); a request that is
malformed (agent_bad_requests) or does not extend the trajectory's history (agent_history_edits) is answered 400
and the agent may go on. A trajectory whose context reaches model.max_seq_len has its pending request answered
400 `context_length_exceeded` and is judged on what the agent returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import inspect
import logging
import math
import random
import ssl
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

from async_rl.env_types import Judgement, StepResult, Task
from rollout.chat_api import (
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
from rollout.envs.base import EnvError, Prompt, load_callable, settings_from_kwargs
from rollout.envs.task_file import read_task_file
from rollout.openai_endpoint import ChatEndpoint, error

log = logging.getLogger("async_rl.rollout")

ENV = "agent"
DEFAULT_TIMEOUT_S = 300.0


class AgentSettings(msgspec.Struct, forbid_unknown_fields=True):
    entry: str  # MODULE:FUNCTION, the agent: async def FUNCTION(task: dict, client, model: str) -> float | dict
    tasks: str  # a JSONL file, one JSON object per task (optional "id"; optional "split": "train" or "eval")
    judge: str | None = None  # MODULE:FUNCTION, the slow judge: JUDGE(task: dict, returned) -> float | dict
    eval_fraction: float = 0.2  # the share of the tasks without a "split" held out for evaluation
    seed: int = 0  # the split's shuffle
    timeout_s: float = DEFAULT_TIMEOUT_S  # the longest an agent may work before its first model call, between two,
    #                                       and after its last until it returns (rollout.step_timeout_s when set)
    model: str = "policy"  # the model name the agent is given and /v1/models lists (requests may name any)

    def __post_init__(self) -> None:
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"eval_fraction: expected 0 < f < 1, got {self.eval_fraction}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: expected > 0, got {self.timeout_s}")


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


def _record_task(record: dict, number: int) -> Task:
    split = record.get("split")
    if split not in (None, "train", "eval"):
        raise ValueError(f'split: expected "train" or "eval", got {split!r}')
    return Task(id=str(record.get("id", f"line{number}")), data=record)


class _Call:
    """One completion request, waiting for its answer."""

    def __init__(self, request: ChatRequest) -> None:
        self.request = request
        self.done = threading.Event()
        self.reply: tuple[int, dict[str, Any] | bytes] = (500, {})


class AgentEnv:
    """One trajectory: the user's agent on its own thread, and its requests as the runner's turns."""

    def __init__(self, factory: AgentFactory) -> None:
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


class AgentFactory:
    """The tasks file's split, the user's agent and judge, the worker's endpoint and the counts of what agents did."""

    name = ENV  # the env.name its errors give

    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        if importlib.util.find_spec("openai") is None:
            raise EnvError("env.name=agent: the agents' client is openai's, which is not installed "
                           "(pip install 'async-rl[agent]')")
        self.entry = load_callable(settings.entry, "env.kwargs.entry")
        self.judge_fn = load_callable(settings.judge, "env.kwargs.judge") if settings.judge else None
        self.step_timeout_s = settings.timeout_s  # the runner's step limit (rollout.step_timeout_s overrides it)
        words = getattr(inspect.getmodule(self.entry), "VOCABULARY", None)
        if words is not None:  # the tiny built-in model's words (ignored with model.path): one token each
            self.vocabulary = lambda: list(words)
        if not Path(settings.tasks).is_file():
            raise EnvError(f"env.kwargs.tasks: no such file: {settings.tasks}")
        self.serve(read_task_file(settings.tasks, _record_task, setting="env.kwargs.tasks"),
                   f"env.kwargs.tasks: {settings.tasks}")

    def serve(self, tasks: list[Task], source: str) -> None:
        """The tasks' train/eval split (`source` names them in an error) and the state the trajectories share: the
        end of __init__, and of a subclass's that has its tasks and agent from elsewhere (envs/verifiers_env.py)."""
        self.splits = self._split(tasks, source)
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.endpoint: ChatEndpoint | None = None
        self.template: ChatTemplate | None = None
        self.tokenizer: Any = None
        self.parse: Any = None
        self.stop: list[str] = []

    def _split(self, tasks: list[Task], source: str) -> dict[str, list[Task]]:
        fixed = {s: [t for t in tasks if t.data.get("split") == s] for s in ("train", "eval")}
        free = [t for t in tasks if t.data.get("split") is None]
        random.Random(self.settings.seed).shuffle(free)
        n_eval = round(len(free) * self.settings.eval_fraction)
        if not fixed["eval"] and free:
            n_eval = max(1, n_eval)
        if len(free) - n_eval < 1 and not fixed["train"] and free:
            n_eval = len(free) - 1
        splits = {"eval": fixed["eval"] + free[:n_eval], "train": fixed["train"] + free[n_eval:]}
        for name, split in splits.items():
            if not split:
                raise EnvError(f"{source} leaves the {name} split empty "
                               f"({len(tasks)} task(s); a train and an eval split need one each)")
        return splits

    def tasks(self, split: str) -> list[Task]:
        if split not in self.splits:
            raise EnvError(f"env {ENV!r}: no split {split!r} (train, eval)")
        return list(self.splits[split])

    def make(self) -> AgentEnv:
        return AgentEnv(self)

    def bind(self, tokenizer: Any, parse_tools: Any, stop: list[str], step_timeout_s: float) -> None:
        """The episode runner's tokenizer, tool parser, stop strings and step limit (rollout/agent.py)."""
        with self.lock:
            if self.template is None or self.tokenizer is not tokenizer:
                self.tokenizer, self.template = tokenizer, ChatTemplate(tokenizer)
            self.parse, self.stop, self.step_timeout_s = parse_tools, list(stop), step_timeout_s

    def endpoint_for_trajectories(self) -> ChatEndpoint:
        with self.lock:
            if self.endpoint is None:  # started with the first trajectory, so a config check starts no server
                self.endpoint = ChatEndpoint(self.settings.model)
            return self.endpoint

    def decode(self, token_ids: list[int]) -> str:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        for stop in self.stop:  # the tokens may run past the stop string inside their last token
            at = text.find(stop)
            if at >= 0:
                text = text[: at + len(stop)]
        return text

    def count(self, what: str, n: int = 1) -> None:
        if n:
            with self.lock:
                self.counts[what] += n

    def metrics(self) -> dict[str, float]:
        """Counts since the worker started, for its metrics line (docs/metrics.md)."""
        keys = ("started", "returned", "completions", "tool_calls", "tool_call_errors", "rewards", "errors",
                "timeouts", "cancelled", "no_model_call", "history_edits", "bad_requests")
        with self.lock:
            return {f"agent_{key}": float(self.counts[key]) for key in keys}

    def close(self) -> None:
        with self.lock:
            endpoint, self.endpoint = self.endpoint, None
        if endpoint is not None:
            endpoint.close()


def factory(**kwargs: Any) -> AgentFactory:
    """`env.name=agent` with `env.kwargs` (AgentSettings)."""
    return AgentFactory(settings_from_kwargs(ENV, AgentSettings, kwargs))
