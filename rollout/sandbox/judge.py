"""The sandbox's judge: runs the tests in a process of its own, calling the agent's functions across a pipe.

Run by rollout/sandbox/parent.py as `python -I -S -B <this file>` beside the agent's process
(rollout/sandbox/child.py), standard library only (values.py loaded by path). It reads its spec (tests, setup,
entry points, limits, its three pipes, the token that signs each event) from stdin. It runs the task's setup in its
own namespace, binds each entry point to a `Remote` (a call sends the arguments to the agent's process as plain
values and returns the plain values that come back, or raises what the function raised), and runs each test in a
copy of that namespace under a `test_s` alarm. So `assert candidate(x) == y` compares two values this process
built from JSON (rollout/sandbox/values.py): no object, builtin or `assert` of the agent's takes part, and the
setup's helpers stay the task's own (only the entry points are the agent's).

It trusts: the spec from the parent (the task's tests and setup), this file, values.py and the interpreter. It
believes nothing of the agent's process but the first message (written before the agent's code loads: the
isolation in force) and, after that, plain values. It reports one JSON line per event on its result pipe, which
the agent's process never holds: ready, load, start and test for each test, gone (the agent's process ended),
output, done.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import importlib.util
import io
import json
import linecache
import os
import resource
import signal
import sys
import time
import traceback
from collections.abc import Callable
from types import ModuleType

OUTPUT_WAIT_S = 1.0  # after the tests, how long the agent's process may take to hand over what it printed
MAX_NAMES = 1000  # entry points taken from the agent's own list when the spec names none


def sibling(name: str) -> ModuleType:
    """rollout/sandbox/<name>.py, loaded by path (this process has no project on its sys.path)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
    spec = importlib.util.spec_from_file_location("_sandbox_" + name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


values = sibling("values")


class TestTimeout(BaseException):
    __test__ = False  # not a pytest test class


class CandidateError(Exception):
    """The agent's function raised an exception that is not a builtin one (its type's name and message)."""


class CandidateFault(BaseException):
    """A call that yielded no value and no exception: not plain data, a malformed or oversized reply. A
    BaseException, so a test's `except ValueError` (or `except Exception`) never takes it for the error it expects."""


class AgentGone(CandidateFault):
    """The agent's process ended (or closed its pipe): no later test runs."""


class Report:
    """The events to the parent, each signed with the execution's token."""

    def __init__(self, token: str, fd: int) -> None:
        self.token, self.fd = token, fd

    def emit(self, **event: object) -> None:
        event["token"] = self.token
        data = (json.dumps(event) + "\n").encode()
        try:
            while data:
                data = data[os.write(self.fd, data):]
        except OSError:
            pass


def cap(text: object, n: int) -> str:
    text = str(text)
    return text if len(text) <= n else text[: n - 20] + " ...[truncated]"


class Agent:
    """The agent's process as the judge sees it: messages in (one JSON line each, at most `max_bytes`), calls out."""

    OVERSIZED = object()

    def __init__(self, reply_fd: int, request_fd: int, max_bytes: int) -> None:
        self.reply_fd, self.request_fd, self.max_bytes = reply_fd, request_fd, max_bytes
        self.buffer = bytearray()
        self.skipping = False  # inside a line over max_bytes: dropped up to its newline
        self.gone = False
        self.last_id = 0

    def _line(self) -> bytes | object | None:
        """The next line, OVERSIZED, or None at the end of the pipe."""
        while True:
            newline = self.buffer.find(b"\n")
            if newline >= 0:
                line = bytes(self.buffer[:newline])
                del self.buffer[: newline + 1]
                if self.skipping:
                    self.skipping = False
                    return self.OVERSIZED
                return line
            if len(self.buffer) > self.max_bytes:
                self.buffer.clear()
                self.skipping = True
            chunk = os.read(self.reply_fd, 1 << 16)
            if not chunk:
                self.gone = True
                return None
            self.buffer += chunk

    def message(self) -> dict | object | None:
        """The next message that is a JSON object, OVERSIZED, or None when the agent's process is gone."""
        while not self.gone:
            line = self._line()
            if line is None or line is self.OVERSIZED:
                return line
            try:
                message = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if type(message) is dict:
                return message
        return None

    def expect(self, kind: str) -> dict | None:
        """The next message of this kind (others skipped), or None when the agent's process is gone."""
        while True:
            message = self.message()
            if message is None:
                return None
            if message is not self.OVERSIZED and message.get("kind") == kind:
                return message

    def send(self, **request: object) -> None:
        data = (json.dumps(request, separators=(",", ":")) + "\n").encode()
        try:
            while data:
                data = data[os.write(self.request_fd, data):]
        except OSError:
            self.gone = True

    def call(self, name: str, args: tuple, kwargs: dict) -> object:
        if self.gone:
            raise AgentGone("the agent's process has ended")
        try:
            plain_args, plain_kwargs = values.to_plain(args), values.to_plain(kwargs)
        except values.NotPlain as exc:
            raise TypeError(f"the test passed {name} an argument that is not plain data: {exc}") from None
        self.last_id += 1
        self.send(kind="call", id=self.last_id, name=name, args=plain_args, kwargs=plain_kwargs)
        while True:  # replies to earlier calls that timed out here arrive late: skipped
            reply = self.message()
            if reply is None:
                raise AgentGone(f"the agent's process ended during the call of {name}")
            if reply is self.OVERSIZED:
                raise CandidateFault(f"{name} returned more than {self.max_bytes} bytes of data")
            if reply.get("kind") == "reply" and reply.get("id") == self.last_id:
                return answer(name, reply)

    def goodbye(self) -> dict:
        """Tell the agent's process the calls are over; what it printed (empty if it does not say in time)."""
        self.send(kind="bye")
        try:
            output = limited(lambda: self.expect("output"), OUTPUT_WAIT_S)
        except TestTimeout:
            output = None
        return output or {}


def answer(name: str, reply: dict) -> object:
    """What a call gave, from its reply: a plain value, or a raise here."""
    if reply.get("timeout") is True:
        raise TestTimeout()
    if "not_plain" in reply:
        raise CandidateFault(f"{name} returned something that is not plain data: {cap(reply['not_plain'], 300)}")
    if "raised" in reply:
        kind, message = str(reply["raised"]), str(reply.get("message", ""))
        error = getattr(builtins, kind, None)
        same = None
        if isinstance(error, type) and issubclass(error, Exception):
            with contextlib.suppress(TypeError):  # a builtin that takes other arguments (UnicodeDecodeError)
                same = error(message)
        same = same if same is not None else CandidateError(f"{kind}: {message}")
        if reply.get("trace"):
            same.add_note(f"raised in the agent's {name}:\n{cap(reply['trace'], 2000)}")
        raise same
    if "value" not in reply:
        raise CandidateFault(f"the reply to the call of {name} holds no value")
    try:
        return values.from_plain(reply["value"])
    except (values.NotPlain, RecursionError) as exc:
        raise CandidateFault(f"the reply to the call of {name} is malformed: {exc}") from None


class Remote:
    """An entry point in the judge's namespace: calling it calls the agent's function of that name."""

    def __init__(self, name: str, agent: Agent) -> None:
        self.__name__ = self.__qualname__ = name
        self._agent = agent

    def __call__(self, *args: object, **kwargs: object) -> object:
        return self._agent.call(self.__name__, args, kwargs)

    def __repr__(self) -> str:
        return f"<the agent's {self.__name__}>"


def on_alarm(signum: int, frame: object) -> None:
    raise TestTimeout()


def limited(fn: Callable[[], object], seconds: float) -> object:
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def tb_text(exc: BaseException) -> str:
    """The exception and its last three frames, this file's left out."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != __file__]
    lines = traceback.format_list(frames[-3:]) + traceback.format_exception_only(type(exc), exc)
    return "".join(lines).rstrip()


def register(name: str, source: str) -> None:
    """Let tracebacks show the lines of `source` under `name`."""
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)


def explain(source: str, namespace: dict, test_s: float) -> str:
    """For a failed `assert a == b`: what `a` gave (or raised)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return ""
    test = tree.body[0].test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return ""
    try:
        got = limited(lambda: eval(compile(ast.Expression(test.left), "<test>", "eval"), namespace), test_s)
        return "\n  got: " + cap(repr(got), 300)
    except (TestTimeout, AgentGone):
        return ""
    except BaseException as exc:
        return "\n  raised: " + cap(type(exc).__name__ + ": " + str(exc), 300)


def run_test(spec: dict, index: int, source: str, namespace: dict) -> tuple[str, str]:
    """One test in a copy of the judge's namespace: (status, detail)."""
    test_s = spec["limits"]["test_s"]
    name = f"test_{index}.py"
    try:
        register(name, source)
        limited(lambda: exec(compile(source, name, "exec"), dict(namespace)), test_s)
    except TestTimeout:
        return "timeout", f"took more than {test_s:g} s"
    except AssertionError as exc:
        detail = tb_text(exc)
        if spec["explain"]:
            detail += explain(source, dict(namespace), test_s)
        return "failed", detail
    except AgentGone as exc:
        return "error", f"the process died during this test ({exc})"
    except BaseException as exc:
        return "error", tb_text(exc)
    return "passed", ""


def judge_namespace(spec: dict, names: list[str], agent: Agent) -> dict:
    """The task's setup run here, then each entry point bound to the agent's function."""
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    register("setup.py", spec["setup"])
    limited(lambda: exec(compile(spec["setup"], "setup.py", "exec"), namespace), spec["limits"]["test_s"])
    for name in names:
        namespace[name] = Remote(name, agent)
    return namespace


def entry_points(spec: dict, load: dict) -> list[str]:
    """The spec's entry points, else every function the agent's code says it defines."""
    if spec["entry_points"] is not None:
        return list(spec["entry_points"])
    names = load.get("names") if isinstance(load.get("names"), list) else []
    return [n for n in names[:MAX_NAMES] if isinstance(n, str) and n.isidentifier()]


def set_limits(limits: dict) -> None:
    """The agent's CPU and memory limits hold here too: a reply the size of `value_bytes` fits in them."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory"], limits["memory"]))


def strings(items: object) -> list[str]:
    return [cap(x, 300) for x in items[:100]] if type(items) is list else []


def run(spec: dict, report: Report, agent: Agent) -> None:
    limits = spec["limits"]
    ready = agent.expect("ready")
    if ready is None:
        report.emit(event="gone", during="start")
        return
    report.emit(event="ready", isolation=strings(ready.get("isolation")), notes=strings(ready.get("notes")))
    load = agent.expect("load")
    if load is None:
        report.emit(event="gone", during="load")
        return
    ok, error = load.get("ok") is True, cap(load.get("error", ""), limits["detail_chars"] * 2)
    namespace: dict = {}
    if ok:
        try:
            namespace = judge_namespace(spec, entry_points(spec, load), agent)
        except BaseException as exc:
            ok, error = False, "the task's setup failed in the judge: " + cap(tb_text(exc), limits["detail_chars"])
    report.emit(event="load", ok=ok, error=error)
    for i, test in enumerate(spec["tests"] if ok else []):
        report.emit(event="start", index=i)
        t0 = time.perf_counter()
        status, detail = run_test(spec, i, test["source"], namespace)
        if agent.gone and status != "error":  # a test that swallowed the agent's end does not pass
            status, detail = "error", "the process died during this test"
        report.emit(event="test", index=i, status=status, detail=cap(detail, limits["detail_chars"]),
                    seconds=time.perf_counter() - t0)
        if agent.gone:
            report.emit(event="gone", during=i)
            return
    output = agent.goodbye()
    report.emit(event="output", stdout=cap(output.get("stdout", ""), limits["output_chars"]),
                stderr=cap(output.get("stderr", ""), limits["output_chars"]),
                dropped=output.get("dropped") if type(output.get("dropped")) is int else 0)


def main() -> None:
    spec = json.loads(sys.stdin.buffer.read())
    sys.stdin = io.StringIO("")
    set_limits(spec["limits"])
    signal.signal(signal.SIGALRM, on_alarm)
    report = Report(spec["token"], spec["result_fd"])
    agent = Agent(spec["reply_fd"], spec["request_fd"], spec["limits"]["value_bytes"])
    run(spec, report, agent)
    report.emit(event="done")
    os._exit(0)


if __name__ == "__main__":
    main()
