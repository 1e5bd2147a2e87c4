"""The agent's process: isolate itself, load the agent's code, then call its functions for the judge, one at a time.

Run by rollout/sandbox/parent.py as `python -I -S -B <this file>` (no site, no user path, no bytecode written):
standard library only; it loads its two siblings by path before anything else (isolation.py: the mechanisms,
values.py: the wire format). It reads its spec (code, setup, limits, the two pipes to the judge) from stdin,
isolates itself (rollout/sandbox/isolation.py), tells the judge what is in force, and only then loads the setup and
the code as a fresh `__main__` module. From then on it answers the judge's calls (rollout/sandbox/judge.py): each
request names a function of the module and holds its arguments as plain values; the reply holds what it returned,
copied to plain values (anything else is refused), or the exception it raised, or that it ran past `test_s`.

No test runs here and nothing here is believed: the judge compares the replies in its own process. Whatever the
agent's code does to this interpreter (builtins, `assert`, `__eq__`, these functions, the pipe) changes at most the
values it sends.
"""

from __future__ import annotations

import importlib.util
import io
import json
import linecache
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from types import ModuleType


def sibling(name: str) -> ModuleType:
    """rollout/sandbox/<name>.py, loaded by path (this process has no project on its sys.path)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
    spec = importlib.util.spec_from_file_location("_sandbox_" + name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and the like look their module up here
    spec.loader.exec_module(module)
    return module


def cap(text: object, n: int) -> str:
    text = str(text)
    return text if len(text) <= n else text[: n - 20] + " ...[truncated]"


class Capped(io.TextIOBase):
    """stdout or stderr of the agent's code, kept up to `limit` characters (the rest counted)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.parts: list[str] = []
        self.size, self.dropped = 0, 0

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        s = str(s)
        room = self.limit - self.size
        if room > 0:
            self.parts.append(s[:room])
            self.size += min(room, len(s))
        self.dropped += max(0, len(s) - max(room, 0))
        return len(s)

    def value(self) -> str:
        return "".join(self.parts)


class CallTimeout(BaseException):
    """A call (or loading the code) ran past `test_s`."""


def on_alarm(signum: int, frame: object) -> None:
    raise CallTimeout()


def limited(fn: Callable[[], object], seconds: float) -> object:
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def frames_text(exc: BaseException) -> str:
    """The last three frames of the exception's traceback, this file's left out."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != __file__]
    return "".join(traceback.format_list(frames[-3:])).rstrip()


def tb_text(exc: BaseException) -> str:
    """The exception and its last three frames, this file's left out."""
    return (frames_text(exc) + "\n" + "".join(traceback.format_exception_only(type(exc), exc))).strip()


def register(name: str, source: str) -> None:
    """Let tracebacks show the lines of `source` under `name`."""
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)


class Judge:
    """The two pipes to the judge: its requests in, this process's messages out (one JSON line each)."""

    def __init__(self, request_fd: int, reply_fd: int) -> None:
        self.requests = os.fdopen(request_fd, "rb")
        self.reply_fd = reply_fd

    def send(self, **message: object) -> None:
        data = (json.dumps(message, separators=(",", ":")) + "\n").encode()
        try:
            while data:
                data = data[os.write(self.reply_fd, data):]
        except OSError:
            pass  # the judge is gone: the parent ends this process

    def calls(self) -> Iterator[dict]:
        """The judge's call requests until it says goodbye (or closes its end)."""
        for line in self.requests:
            request = json.loads(line)
            if request.get("kind") != "call":
                return
            yield request


def fresh_main() -> dict:
    """A fresh __main__ module for the agent's code (pickle, dataclasses and `import __main__` find it)."""
    module = type(sys)("__main__")
    module.__builtins__ = __builtins__
    sys.modules["__main__"] = module
    return module.__dict__


def load(spec: dict, namespace: dict) -> str | None:
    """Run the setup then the code in `namespace`; the load error, or None."""
    test_s = spec["limits"]["test_s"]
    try:
        register("setup.py", spec["setup"])
        register("solution.py", spec["code"])
        limited(lambda: exec(compile(spec["setup"], "setup.py", "exec"), namespace), test_s)
        limited(lambda: exec(compile(spec["code"], "solution.py", "exec"), namespace), test_s)
    except CallTimeout:
        return f"TimeoutError: loading the code took more than {test_s:g} s"
    except SyntaxError as exc:
        return "".join(traceback.format_exception_only(type(exc), exc)).rstrip()
    except BaseException as exc:
        return tb_text(exc)
    return None


def call(request: dict, namespace: dict, limits: dict, values: ModuleType) -> dict:
    """One call of the judge's: the reply, with what the function returned as plain values."""
    reply: dict[str, object] = {"kind": "reply", "id": request.get("id")}

    def run() -> None:
        function = namespace.get(request["name"])
        if not callable(function):
            raise NameError(f"the code defines no function {request['name']!r}")
        args, kwargs = values.from_plain(request["args"]), values.from_plain(request["kwargs"])
        try:
            reply["value"] = values.to_plain(function(*args, **kwargs))
        except values.NotPlain as exc:
            reply["not_plain"] = cap(exc, limits["detail_chars"])

    try:
        limited(run, limits["test_s"])  # copying the result counts too: a cyclic or huge value is not waited for
    except CallTimeout:
        reply["timeout"] = True
    except BaseException as exc:
        reply["raised"] = type(exc).__name__
        try:
            message, trace = limited(lambda e=exc: (str(e), frames_text(e)), limits["test_s"])
            reply["message"], reply["trace"] = cap(message, limits["detail_chars"]), cap(trace, limits["detail_chars"])
        except BaseException:
            reply["message"] = ""
    return reply


def serve(spec: dict, judge: Judge, values: ModuleType) -> None:
    """Load the code, answer the judge's calls, then hand over what the code printed."""
    limits = spec["limits"]
    signal.signal(signal.SIGALRM, on_alarm)
    stdout, stderr = Capped(limits["output_chars"]), Capped(limits["output_chars"])
    sys.stdout, sys.stderr = stdout, stderr
    namespace = fresh_main()
    error = load(spec, namespace)
    names = [] if error else sorted(n for n, v in namespace.items() if callable(v) and not n.startswith("__"))
    judge.send(kind="load", ok=error is None, error=cap(error or "", limits["detail_chars"] * 2), names=names)
    for request in judge.calls():
        judge.send(**call(request, namespace, limits, values))
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    judge.send(kind="output", stdout=stdout.value(), stderr=stderr.value(), dropped=stdout.dropped + stderr.dropped)


def main() -> None:
    spec = json.loads(sys.stdin.buffer.read())
    sys.stdin = io.StringIO("")
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)
    isolation, values = sibling("isolation"), sibling("values")
    judge = Judge(spec["request_fd"], spec["reply_fd"])
    report = isolation.Report()
    allowed = isolation.isolate(spec, report)
    judge.send(kind="ready", isolation=report.isolation, notes=report.notes)  # before any code of the agent's
    if allowed:
        serve(spec, judge, values)
    os._exit(0)


if __name__ == "__main__":
    main()
