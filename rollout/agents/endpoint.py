"""An OpenAI-compatible HTTP endpoint inside a rollout worker (`rollout.agents.endpoint`), serving the worker's engine
to the agents of the `agent` env (rollout/agents/env.py).

    GET  /v1/models                                     the one model (its name: env.kwargs.model)
    GET  /t/<key>/v1/models                             the same, under a trajectory's base URL
    POST /t/<key>/v1/chat/completions                   a completion of trajectory <key> (tools, tool_choice,
                                                        max_tokens; stream: true gets it as one burst of events)
    POST /t/<key>/v1/async-rl/reward  {"value": x}      a stage reward for that trajectory's latest completion
    POST /v1/chat/completions, /v1/async-rl/reward      the same, the trajectory named by `Authorization: Bearer
                                                        <key>` (a client whose base URL has no key in it)

Each trajectory gets its own random key: its base URL is `http://HOST:PORT/t/<key>/v1` and its API key the same key,
so concurrent agents never see each other's completions, and a key that is not (or no longer) a trajectory's is
answered 404. The server is the standard library's threading HTTP/1.1 server (keep-alive; one thread per
connection): a completion request holds its thread until the episode runner has generated the answer.
Errors come back in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

log = logging.getLogger("async_rl.rollout")

MAX_BODY_BYTES = 64 * 2**20


class Trajectory(Protocol):
    """What the endpoint asks of a trajectory: each returns (HTTP status, JSON payload or raw event-stream bytes)."""

    def complete(self, body: Any) -> tuple[int, dict[str, Any] | bytes]: ...

    def reward(self, body: Any) -> tuple[int, dict[str, Any]]: ...


def error(status: int, message: str, code: str) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"message": message, "type": code, "param": None, "code": code}}


class ChatEndpoint:
    """The HTTP server and the trajectories it routes to, by key."""

    def __init__(self, model: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.model = model
        self._routes: dict[str, Trajectory] = {}
        self._lock = threading.Lock()
        self.server = _Server((host, port), _Handler)
        self.server.endpoint = self
        self.host, self.port = self.server.server_address[:2]
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="openai-endpoint", daemon=True)
        self._thread.start()
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

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "async-rl"}]}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a request still waiting when the worker stops does not hold up its exit
    request_queue_size = 512  # many agents connect at once
    endpoint: ChatEndpoint


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: an agent's client reuses its connection
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("endpoint: " + format, *args)

    def _split(self) -> tuple[str | None, str]:
        """(the trajectory key, the path after /v1): from /t/<key>/v1/..., else from the bearer key."""
        path = self.path.split("?", 1)[0]
        key = None
        if path.startswith("/t/"):
            key, _, path = path[3:].partition("/")
            path = "/" + path
        if not path.startswith("/v1/"):
            return key, ""
        if key is None:
            auth = self.headers.get("Authorization", "")
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        return key, path[3:]

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        _, path = self._split()
        if path == "/models":
            self._send(200, self.server.endpoint.models())
        else:
            self._send(*error(404, f"no such endpoint: GET {self.path}", "not_found"))

    def do_POST(self) -> None:  # noqa: N802
        key, path = self._split()
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY_BYTES:
            self.close_connection = True
            self._send(*error(400, "a request needs a Content-Length of at most 64 MiB", "invalid_request_error"))
            return
        raw = self.rfile.read(length)
        if path not in ("/chat/completions", "/async-rl/reward"):
            self._send(*error(404, f"no such endpoint: POST {self.path}", "not_found"))
            return
        trajectory = self.server.endpoint.route(key)
        if trajectory is None:
            self._send(*error(404, "no trajectory has this key (over, or never one of this worker's)",
                              "unknown_trajectory"))
            return
        try:
            body = json.loads(raw)
        except ValueError as exc:
            self._send(*error(400, f"the body is not JSON: {exc}", "invalid_request_error"))
            return
        try:
            status, payload = trajectory.complete(body) if path == "/chat/completions" else trajectory.reward(body)
        except Exception as exc:  # a bug of ours: this request, not the server
            log.exception("endpoint: %s failed", path)
            status, payload = error(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")
        self._send(status, payload)

    def _send(self, status: int, payload: dict[str, Any] | bytes) -> None:
        stream = isinstance(payload, bytes)
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "text/event-stream" if stream else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the agent went away; its trajectory hears of it elsewhere
            self.close_connection = True
