"""An MCP server's tools for an env: started over stdio with the `mcp` client library, listed, called with a time
limit, restarted after a crash, stopped (docs/environments.md, "MCP tools").

`McpTools(settings)` starts nothing until its first use (`specs()` or `call()`); then the server's process is
started with `mcp`'s `stdio_client` (or, with `url`, a running server is reached with its `streamable_http_client`)
and a `ClientSession` runs on an asyncio loop of its own thread, so an env's
synchronous `step` (on the worker's thread pool) can call it; many trajectories call it at once. The tools are
shown to the model as OpenAI function specs (`specs()`: the MCP tool's name, description and `inputSchema`).

Failures, each with a message that names the server's command:
- the command not found: `EnvError` when the settings are read (`async-rl train` stops before anything starts);
- the server exits or does not answer at start: `EnvError` with the tail of its stderr (the trajectory that
  started it is abandoned; the next use tries again);
- a tool the server does not list, arguments it refuses, a tool that reports an error: an `error: ...` result;
- a call past `call_timeout_s`: an `error: ...` result (never a wait without end); if the server then does not
  answer a ping either, it is taken as failed, as below;
- the server crashing mid-run: `ServerFailed` for every call on that server process (the env abandons those
  trajectories); the next call starts a new process. A trajectory is tied to the process it first called
  (`call(..., generation)`), since a server may hold state: its later calls fail rather than reach a new one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import shutil
import tempfile
import threading
from typing import Any

import msgspec

from rollout.envs.base import EnvError

STDERR_TAIL_CHARS = 2000
PING_S = 5.0  # after a call timed out: a server that does not answer a ping in this long has failed
STOP_S = 10.0  # closing waits this long for the server to stop (mcp's own shutdown: stdin closed, TERM, KILL)


class McpSettings(msgspec.Struct, forbid_unknown_fields=True):
    command: list[str] = []  # the server's command line, e.g. ["python", "server.py"] (stdio transport)
    url: str | None = None  # or a running server's streamable-HTTP endpoint, e.g. http://127.0.0.1:8000/mcp
    env: dict[str, str] = {}  # environment variables for the command, over mcp's safe default (HOME, PATH, ...)
    cwd: str | None = None  # the command's working directory (default: the worker's)
    start_timeout_s: float = 30.0  # the longest its start or connection (initialize + list_tools) may take
    call_timeout_s: float = 30.0  # the longest one tool call may take
    max_result_chars: int = 2000  # a result's text is cut to this many characters

    def __post_init__(self) -> None:
        if self.url is not None:
            if self.command:
                raise ValueError("mcp: give a command (stdio) or a url (HTTP), not both")
            if not self.url.startswith(("http://", "https://")):
                raise ValueError(f"mcp: url must start with http:// or https://, got {self.url!r}")
        elif not self.command or not all(isinstance(part, str) and part for part in self.command):
            raise ValueError("mcp: command must be a non-empty list of strings, e.g. [\"python\", \"server.py\"] "
                             "(or give a url)")
        if self.start_timeout_s <= 0 or self.call_timeout_s <= 0 or self.max_result_chars < 1:
            raise ValueError("mcp: start_timeout_s and call_timeout_s must be > 0, max_result_chars >= 1")


class ServerFailed(EnvError):
    """The MCP server a trajectory was using crashed or stopped answering; the trajectory cannot go on."""


class _Server:
    """One started server process: its session, its tools, and the task that holds its contexts."""

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.session: Any = None
        self.tools: dict[str, dict] = {}  # name -> the MCP tool (by_alias dump)
        self.stop = asyncio.Event()
        self.failed: str | None = None
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - the server writes its stderr here; closed with it
        self.task: asyncio.Task | None = None

    def stderr_tail(self) -> str:
        try:
            size = os.fstat(self.stderr.fileno()).st_size
            data = os.pread(self.stderr.fileno(), STDERR_TAIL_CHARS, max(0, size - STDERR_TAIL_CHARS))
        except (OSError, ValueError):
            return ""
        return data.decode("utf-8", "replace").strip()


class McpTools:
    """An MCP server's tools, started on first use, for the envs of one factory (thread-safe)."""

    def __init__(self, settings: McpSettings) -> None:
        self.settings = settings
        self.what = f"MCP server at {settings.url}" if settings.url else f"MCP server {' '.join(settings.command)!r}"
        try:
            import mcp  # noqa: F401
        except ImportError:
            raise EnvError("env.kwargs.mcp: needs the `mcp` package (pip install 'async-rl[mcp]')") from None
        search = settings.env.get("PATH") or os.environ.get("PATH")
        if settings.command and shutil.which(settings.command[0], path=search) is None:
            raise EnvError(f"env.kwargs.mcp.command: {settings.command[0]!r} is not a command found on PATH "
                           f"(the {self.what})")
        self.lock = threading.Lock()  # held while a server starts; never taken on the loop's thread
        self.count_lock = threading.Lock()  # the counts and failures (taken briefly, on any thread)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.server: _Server | None = None
        self.generations = 0
        self.closed = False
        self.failures: dict[int, str] = {}  # server generation -> why it failed
        self.counts = dict.fromkeys(("starts", "start_failures", "calls", "call_errors", "timeouts", "failures",
                                     "abandoned"), 0)

    # --- the synchronous side (the env's threads) ---------------------------------------------------------------

    def specs(self) -> list[dict]:
        """The server's tools as OpenAI function specs (starts the server if none is running)."""
        server = self._running()
        return [_openai_spec(tool) for tool in server.tools.values()]

    def call(self, name: str, arguments: dict, generation: int | None = None) -> tuple[str, bool, int]:
        """Call tool `name`: (its text, whether it worked, the server generation that answered). `generation`: the
        server process the trajectory used before (None: none yet); if that one failed, `ServerFailed`."""
        server = self._running()
        if generation is not None and generation != server.generation:
            self._count("abandoned")
            raise ServerFailed(f"{self.what} this trajectory was using failed (it was restarted since): "
                               f"{self._failure(generation)}")
        self._count("calls")
        if name not in server.tools:
            self._count("call_errors")
            return f"error: the MCP server has no tool {name!r} (it has: {', '.join(server.tools)})", False, \
                server.generation
        assert self.loop is not None
        future = asyncio.run_coroutine_threadsafe(self._call(server, name, arguments), self.loop)
        try:  # _call keeps its own limit; this one only guards against a loop that stopped
            text, ok = future.result(timeout=self.settings.call_timeout_s + PING_S + 5)
        except concurrent.futures.TimeoutError:
            future.cancel()
            self._fail(server, f"no answer within {self.settings.call_timeout_s + PING_S + 5:.0f} s")
            self._count("abandoned")
            raise ServerFailed(f"{self.what} stopped answering: {self._failure(server.generation)}") from None
        except ServerFailed:
            self._count("abandoned")
            raise
        if not ok:
            self._count("call_errors")
        limit = self.settings.max_result_chars
        return (text if len(text) <= limit else text[:limit] + " ...[cut]"), ok, server.generation

    def metrics(self) -> dict[str, float]:
        """Counts since the start, for the worker's metrics line (`mcp_*`)."""
        with self.count_lock:
            return {f"mcp_{key}": float(value) for key, value in self.counts.items()}

    def close(self) -> None:
        """Stop the server (if one runs) and the loop's thread; later use raises EnvError."""
        with self.lock:
            self.closed = True
            loop, thread, server, self.server = self.loop, self.thread, self.server, None
        if loop is None or thread is None:
            return
        if server is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._stop(server), loop).result(timeout=STOP_S)
            server.stderr.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=STOP_S)
        if not thread.is_alive():
            loop.close()

    # --- starting and failing -------------------------------------------------------------------------------------

    def _count(self, key: str) -> None:
        with self.count_lock:
            self.counts[key] += 1

    def _running(self) -> _Server:
        """The running server, started (again) if there is none or it failed."""
        with self.lock:
            if self.closed:
                raise EnvError(f"{self.what}: used after the env factory was closed")
            if self.server is not None and self.server.failed is None:
                return self.server
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                self.thread = threading.Thread(target=self.loop.run_forever, name="mcp-client", daemon=True)
                self.thread.start()
            if self.server is not None:
                self.server.stderr.close()  # a failed one's (its message has been taken)
            self.generations += 1
            self._count("starts")
            server = _Server(self.generations)
            self.server = server
            future = asyncio.run_coroutine_threadsafe(self._start(server), self.loop)
            try:
                future.result(timeout=self.settings.start_timeout_s + STOP_S)
            except BaseException as exc:
                future.cancel()
                self._count("start_failures")
                server.failed = f"did not start: {_why(exc)}"
                tail = server.stderr_tail()
                stderr = "" if self.settings.url else (f"; its stderr ends: {tail}" if tail else
                                                        "; it wrote nothing to stderr")
                raise EnvError(f"{self.what} did not start: {_why(exc)}{stderr}") from None
            return server

    async def _start(self, server: _Server) -> None:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future = loop.create_future()
        server.task = asyncio.ensure_future(self._hold(server, ready))
        try:
            await asyncio.wait_for(asyncio.shield(ready), self.settings.start_timeout_s)
        except TimeoutError:
            server.stop.set()
            server.task.cancel()  # still inside initialize: cancelling runs mcp's shutdown (the process killed)
            raise TimeoutError(f"no answer to initialize and list_tools within {self.settings.start_timeout_s:g} s")\
                from None

    async def _hold(self, server: _Server, ready: asyncio.Future) -> None:
        """Hold the server's transport and session open until `stop` is set (anyio scopes stay in one task)."""
        from mcp import ClientSession, StdioServerParameters, stdio_client

        if self.settings.url:
            from mcp.client.streamable_http import streamable_http_client

            transport = streamable_http_client(self.settings.url)
        else:
            params = StdioServerParameters(command=self.settings.command[0], args=self.settings.command[1:],
                                           env=dict(self.settings.env) or None, cwd=self.settings.cwd)
            transport = stdio_client(params, errlog=server.stderr)
        try:
            async with transport as streams, ClientSession(streams[0], streams[1]) as session:
                await session.initialize()
                listed = await session.list_tools()  # one page (a server that pages its tools shows the first)
                tools = {tool.name: tool.model_dump(by_alias=True, exclude_none=True, mode="json")
                         for tool in listed.tools}
                server.session, server.tools = session, tools
                if not ready.done():
                    ready.set_result(None)
                await server.stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else RuntimeError(_why(exc)))
            if server.failed is None and not server.stop.is_set():
                server.failed = _why(exc)
            if not isinstance(exc, Exception):
                raise

    async def _stop(self, server: _Server) -> None:
        server.stop.set()
        if server.task is not None and not server.task.done():
            if server.session is None:  # not started yet: stop waits on nothing there
                server.task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(server.task), STOP_S)
            if not server.task.done():
                server.task.cancel()

    def _fail(self, server: _Server, why: str) -> None:
        """Mark `server` failed (later calls start a new one) and stop it."""
        loop = self.loop
        with self.count_lock:
            if server.failed is not None:
                return
            self.counts["failures"] += 1
            tail = server.stderr_tail()
            server.failed = f"{why}; its stderr ends: {tail[-500:]}" if tail else why
            self.failures[server.generation] = server.failed
        if loop is not None:
            loop.call_soon_threadsafe(server.stop.set)

    def _failure(self, generation: int) -> str:
        with self.count_lock:
            return self.failures.get(generation, "it failed")

    async def _call(self, server: _Server, name: str, arguments: dict) -> tuple[str, bool]:
        from mcp import MCPError

        try:
            result = await asyncio.wait_for(server.session.call_tool(name, arguments), self.settings.call_timeout_s)
        except TimeoutError:
            self._count("timeouts")
            if not await self._answers(server):
                self._server_failed(server, f"a call to {name!r} ran past {self.settings.call_timeout_s:g} s and the "
                                            "server did not answer a ping")
            return f"error: the tool {name!r} did not answer within {self.settings.call_timeout_s:g} s", False
        except MCPError as exc:
            if not await self._answers(server):
                self._server_failed(server, f"the connection was lost during a call to {name!r} ({exc})")
            return f"error: {exc}", False
        except Exception as exc:  # the session refused the arguments (not JSON, ...) or the reply
            if not await self._answers(server):
                self._server_failed(server, f"{type(exc).__name__} during a call to {name!r}: {exc}")
            return f"error: {type(exc).__name__}: {exc}", False
        text = _result_text(result)
        if getattr(result, "isError", None) or getattr(result, "is_error", None):
            return f"error: {text}", False
        return text, True

    def _server_failed(self, server: _Server, why: str) -> None:
        self._fail(server, why)
        raise ServerFailed(f"{self.what} failed: {server.failed or why}")

    async def _answers(self, server: _Server) -> bool:
        """Whether the server still answers a ping (a tool's own error, or a dead server?)."""
        if server.failed is not None or server.task is None or server.task.done():
            return False
        try:
            await asyncio.wait_for(server.session.send_ping(), PING_S)
            return True
        except Exception:  # TimeoutError, or mcp's MCPError("Connection closed")
            return False


def _why(exc: BaseException) -> str:
    """A readable reason from an exception, exception groups (anyio's task groups) unwrapped."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _openai_spec(tool: dict) -> dict:
    schema = tool.get("inputSchema") or {"type": "object", "properties": {}}
    function = {"name": tool["name"], "description": tool.get("description") or tool.get("title") or "",
                "parameters": schema}
    return {"type": "function", "function": function}


def _result_text(result: Any) -> str:
    """A CallToolResult's content as text: text blocks as they are, other blocks named; structured content when
    there is no text."""
    parts = []
    for block in getattr(result, "content", None) or []:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind}: {getattr(block, 'mimeType', None) or getattr(block, 'mime_type', '')}]")
        elif kind == "resource":
            resource = block.resource
            parts.append(getattr(resource, "text", None) or f"[resource: {resource.uri}]")
        else:
            parts.append(f"[{kind}]")
    structured = getattr(result, "structuredContent", None) or getattr(result, "structured_content", None)
    if not parts and structured is not None:
        parts.append(json.dumps(structured))
    return "\n".join(parts)
