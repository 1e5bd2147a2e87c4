"""An OpenAI-compatible HTTP endpoint inside a rollout worker (`rollout.agents.endpoint`), serving the worker's engine
to the agents of the `agent` env (rollout/agents/env.py): a starlette app on uvicorn, on its own thread and loop.

    GET  /v1/models                                     the one model (its name: env.kwargs.model)
    GET  /t/<key>/v1/models                             the same, under a trajectory's base URL
    POST /t/<key>/v1/chat/completions                   a completion of trajectory <key> (tools, tool_choice,
                                                        max_tokens; stream: true gets its tokens as they are sampled)
    POST /t/<key>/v1/async-rl/reward  {"value": x}      a stage reward for that trajectory's latest completion
    POST /v1/chat/completions, /v1/async-rl/reward      the same, the trajectory named by `Authorization: Bearer
                                                        <key>` (a client whose base URL has no key in it)

Each trajectory gets its own random key: its base URL is `http://HOST:PORT/t/<key>/v1` and its API key the same key,
so concurrent agents never see each other's completions. The key only keeps wires from crossing: an agent is the
user's code in the worker's process (docs/environments.md, "What an agent is trusted with").

A request is refused before its body is read when its key is no trajectory's (401 without a key in the path, 404
with one) or its Content-Length is over `max_body_bytes` (413); a body not received within `body_timeout_s` gets 408;
malformed JSON, or JSON nested deeper than `max_json_depth`, gets 400; a model other than the endpoint's gets 404.
A connection with no request under way (one that never sends its head, or idles between requests) is closed after
`idle_timeout_s`, and past `max_connections` at once new requests get 503 (uvicorn's `limit_concurrency`). A
completion waits on the loop, not on a thread: its answer is handed over from the runner's threads (`Reply`).
Errors come back in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from rollout.agents.chat_api import ChatError, StreamedContent, error, final_chunks, sse

log = logging.getLogger("async_rl.rollout")


@dataclass(frozen=True)
class EndpointLimits:
    max_connections: int = 4096  # connections and requests at once; past it a request gets 503
    max_body_bytes: int = 64 * 2**20  # a larger Content-Length gets 413 before the body is read
    max_json_depth: int = 64  # objects and arrays nested deeper get 400 (a chat request nests a few levels)
    body_timeout_s: float = 60.0  # a body not received whole within this gets 408
    idle_timeout_s: float = 60.0  # a connection with no request under way is closed after this


class Reply:
    """A completion's answer, handed from the runner's threads (the env's, the engine's) to the endpoint's loop: its
    sampled tokens as they come (when streamed), then its status and payload."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stream: bool) -> None:
        self.stream = stream
        self.completion_id = "chatcmpl-" + secrets.token_hex(12)  # random: no key material (issue 71)
        self.created = int(time.time())
        self._loop = loop
        self.events: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()

    def token(self, token_id: int) -> None:
        self._put(("token", token_id))

    def answer(self, status: int, payload: dict[str, Any]) -> None:
        self._put(("answer", status, payload))

    def _put(self, event: tuple[Any, ...]) -> None:
        with contextlib.suppress(RuntimeError):  # the endpoint closed: nobody waits for it
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)


class Trajectory(Protocol):
    """What the endpoint asks of a trajectory (rollout/agents/trajectory.py's AgentEnv)."""

    def submit(self, body: Any, reply: Reply) -> tuple[int, dict[str, Any]] | None:
        """Take a completion request: an answer at once (status, payload), or None when `reply` will get it."""
        ...

    def reward(self, body: Any) -> tuple[int, dict[str, Any]]: ...

    def decode(self, token_ids: list[int]) -> str: ...


def _json(status: int, payload: dict[str, Any], close: bool = False) -> Response:
    return Response(msgspec.json.encode(payload), status, media_type="application/json",
                    headers={"Connection": "close"} if close else None)


def _too_deep(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


class ChatEndpoint:
    """The HTTP server and the trajectories it routes to, by key."""

    def __init__(self, model: str, host: str = "127.0.0.1", port: int = 0,
                 limits: EndpointLimits = EndpointLimits()) -> None:  # noqa: B008 - frozen, shared safely
        self.model, self.limits = model, limits
        self._routes: dict[str, Trajectory] = {}
        self._lock = threading.Lock()
        app = Starlette(routes=[
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/t/{key}/v1/models", self._models, methods=["GET"]),
            Route("/v1/chat/completions", self._completions, methods=["POST"]),
            Route("/t/{key}/v1/chat/completions", self._completions, methods=["POST"]),
            Route("/v1/async-rl/reward", self._reward, methods=["POST"]),
            Route("/t/{key}/v1/async-rl/reward", self._reward, methods=["POST"]),
        ], exception_handlers={HTTPException: self._http_error})
        self._socket = socket.create_server((host, port), backlog=2048)
        self.host, self.port = self._socket.getsockname()[:2]
        self.server = uvicorn.Server(uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="off", http="auto", ws="none", loop="auto",
            limit_concurrency=limits.max_connections, timeout_keep_alive=max(1, round(limits.idle_timeout_s)),
            timeout_graceful_shutdown=1))
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._serve, name="openai-endpoint", daemon=True)
        self._thread.start()
        while not self.server.started and self._thread.is_alive():
            time.sleep(0.005)
        if not self.server.started:
            raise RuntimeError("the OpenAI-compatible endpoint did not start (see the log)")
        log.info("OpenAI-compatible endpoint at http://%s:%d/v1 (model %r)", self.host, self.port, model)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def add(self, trajectory: Trajectory) -> tuple[str, str]:
        """Route a new trajectory: its key and its base URL."""
        key = secrets.token_urlsafe(18)
        with self._lock:
            self._routes[key] = trajectory
        return key, f"http://{self.host}:{self.port}/t/{key}/v1"

    def remove(self, key: str) -> None:
        with self._lock:
            self._routes.pop(key, None)

    def route(self, key: str | None) -> Trajectory | None:
        with self._lock:
            return self._routes.get(key) if key else None

    def close(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=5)
        self._socket.close()

    # --- the server's thread ----------------------------------------------------------------------------------

    def _serve(self) -> None:
        async def serve() -> None:
            self.loop = asyncio.get_running_loop()
            sweeper = asyncio.create_task(self._close_idle())
            try:
                await self.server.serve(sockets=[self._socket])
            finally:
                sweeper.cancel()

        with asyncio.Runner(loop_factory=self.server.config.get_loop_factory()) as runner:
            runner.run(serve())

    async def _close_idle(self) -> None:
        """Close each connection that has had no request under way for `idle_timeout_s`: one that never sends a
        request head (uvicorn's keep-alive timer starts only after a first response) or stops inside one."""
        idle_since: dict[int, tuple[Any, float]] = {}
        period = min(1.0, max(0.05, self.limits.idle_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            seen = {}
            for connection in list(self.server.server_state.connections):
                cycle = getattr(connection, "cycle", None)
                if cycle is not None and not cycle.response_complete:
                    continue  # a request under way: its own timeouts apply
                state = (id(connection), id(cycle))
                since = idle_since.get(state, (None, now))[1]
                seen[state] = (connection, since)
                if now - since >= self.limits.idle_timeout_s:
                    connection.transport.close()
            idle_since = seen

    # --- the routes (on the server's loop) --------------------------------------------------------------------

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = "not_found" if exc.status_code == 404 else "method_not_allowed"
        return _json(*error(exc.status_code, f"no such endpoint: {request.method} {request.url.path}", code))

    async def _models(self, request: Request) -> Response:
        return _json(200, {"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "async-rl"}]})

    def _trajectory(self, request: Request) -> tuple[Trajectory | None, Response | None]:
        """The trajectory the request names, or the refusal (before any of its body is read)."""
        key = request.path_params.get("key")
        if key is not None:
            trajectory = self.route(key)
            if trajectory is None:
                return None, _json(*error(404, "no trajectory has this key (over, or never one of this worker's)",
                                          "unknown_trajectory"), close=True)
            return trajectory, None
        auth = request.headers.get("authorization", "")
        trajectory = self.route(auth[7:].strip() if auth[:7].lower() == "bearer " else None)
        if trajectory is None:
            return None, _json(*error(401, "the API key is no trajectory's: use the key the agent env handed the "
                                           "agent (also its base URL's /t/<key>/v1)", "invalid_api_key",
                                      "invalid_request_error"), close=True)
        return trajectory, None

    async def _body(self, request: Request) -> tuple[Any, Response | None]:
        """The request's JSON body, or the refusal: 413 on its Content-Length alone, 408, 400."""
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return None, _json(*error(413, f"a request body may be at most {limit} bytes (Content-Length: "
                                           f"{declared[:20]})", "request_too_large", "invalid_request_error"),
                               close=True)
        raw = bytearray()
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                async for chunk in request.stream():
                    raw += chunk
                    if len(raw) > limit:
                        return None, _json(*error(413, f"a request body may be at most {limit} bytes",
                                                  "request_too_large", "invalid_request_error"), close=True)
        except TimeoutError:
            return None, _json(*error(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                                      "request_timeout", "invalid_request_error"), close=True)
        try:
            body = msgspec.json.decode(raw)
        except (msgspec.DecodeError, RecursionError) as exc:
            reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            return None, _json(*error(400, f"the body is not JSON: {reason}", "invalid_json", "invalid_request_error"))
        if _too_deep(body, self.limits.max_json_depth):
            return None, _json(*error(400, f"the body's JSON nests deeper than {self.limits.max_json_depth} levels",
                                      "invalid_json", "invalid_request_error"))
        return body, None

    async def _reward(self, request: Request) -> Response:
        trajectory, refused = self._trajectory(request)
        if refused is None:
            try:
                body, refused = await self._body(request)
            except ClientDisconnect:
                return Response(status_code=400)
        if refused is not None:
            return refused
        assert trajectory is not None
        return _json(*trajectory.reward(body))

    async def _completions(self, request: Request) -> Response:
        trajectory, refused = self._trajectory(request)
        if refused is not None:
            return refused
        try:
            body, refused = await self._body(request)
        except ClientDisconnect:
            return Response(status_code=400)  # nobody to answer
        if refused is not None:
            return refused
        model = body.get("model") if isinstance(body, dict) else None
        if model is not None and model != self.model:
            return _json(*error(404, f"the model {model!r} does not exist: this endpoint serves {self.model!r}",
                                "model_not_found", "invalid_request_error"))
        assert trajectory is not None and self.loop is not None
        stream = isinstance(body, dict) and bool(body.get("stream", False))
        reply = Reply(self.loop, stream)
        now = trajectory.submit(body, reply)
        if now is not None:
            return _json(*now)
        event = await reply.events.get()
        if event[0] == "answer" and (event[1] != 200 or not stream):
            return _json(event[1], event[2])
        usage = isinstance(body.get("stream_options"), dict) and bool(body["stream_options"].get("include_usage"))
        return StreamingResponse(self._events(trajectory, reply, event, usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _events(self, trajectory: Trajectory, reply: Reply, event: tuple[Any, ...],
                      usage: bool) -> AsyncIterator[bytes]:
        """A streamed completion's server-sent events: its content as the engine samples it, then the rest of the
        answer (tool calls, the finish reason) when the runner has it."""
        base = {"id": reply.completion_id, "object": "chat.completion.chunk", "created": reply.created,
                "model": self.model}
        yield sse(base, {"role": "assistant", "content": ""})
        content, tokens = StreamedContent(), []
        while event[0] == "token":
            tokens.append(event[1])
            while not reply.events.empty() and (event := reply.events.get_nowait())[0] == "token":
                tokens.append(event[1])
            if event[0] == "token":  # drained: send what the tokens so far add, then wait for more
                delta = content.feed(trajectory.decode(tokens))
                if delta:
                    yield sse(base, {"content": delta})
                event = await reply.events.get()
        status, payload = event[1], event[2]
        if status != 200:  # the trajectory ended under it (closed, or past its context)
            yield b"data: " + msgspec.json.encode(payload) + b"\n\n"
            return
        try:
            chunks = final_chunks(base, payload, content, usage)
        except ChatError as exc:
            log.warning("endpoint: %s", exc)
            chunks = [b"data: " + msgspec.json.encode(exc.payload()) + b"\n\n"]
        for chunk in chunks:
            yield chunk
