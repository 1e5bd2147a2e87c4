"""What a sandbox execution is given and reports: limits, tests, and the result assembled from the judge's events.

The judge (rollout/sandbox/judge.py) writes one JSON line per event, each signed with the execution's token:
`ready` (the isolation in force in the agent's process), `load`, then `start` and `test` for each test, `gone`
(the agent's process ended early), `output`, `done`. `assemble` turns the events that arrived (and how the
processes ended) into an `ExecutionResult`: a test without an outcome is a timeout, an error or not run, each with
the reason.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass, field

PASSED, FAILED, ERROR, TIMEOUT, NOT_RUN = "passed", "failed", "error", "timeout", "not_run"


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0  # the whole execution (start to exit); then the process group and the uid are killed
    test_s: float = 3.0  # one test, or loading the code (SIGALRM in the child: a timeout, then the next test)
    cpu_s: int = 10  # RLIMIT_CPU of each process
    memory_mb: int = 512  # RLIMIT_AS (address space) of each process
    file_size_mb: int = 16  # RLIMIT_FSIZE: the largest file it can write
    disk_mb: int = 64  # size of the private tmpfs working directory (and 8 MiB for each private /tmp-like dir)
    nproc: int = 16  # RLIMIT_NPROC: processes and threads of its uid
    open_files: int = 64  # RLIMIT_NOFILE
    output_chars: int = 4096  # stdout and stderr each kept up to this; the rest is counted and dropped
    detail_chars: int = 800  # one test's failure detail (assertion, traceback) kept up to this
    nice: int = 10  # the child's niceness: agent code yields the CPU to the worker
    value_bytes: int = 4 << 20  # the largest reply (a call's value as JSON) the judge reads; longer: the call fails


@dataclass
class Test:
    __test__ = False  # not a pytest test class

    name: str
    # Python statements run by the judge in a copy of the setup's namespace, the entry points calling the agent's
    # functions; passes if it raises nothing
    source: str


@dataclass
class TestOutcome:
    name: str
    status: str  # passed, failed (AssertionError), error (another exception), timeout, not_run
    detail: str = ""  # the failing assertion / exception and the last traceback lines (capped)
    seconds: float = 0.0


@dataclass
class ExecutionResult:
    # ok (the judge finished), load_error (the code raised), timeout (wall clock), crash (the agent's process, or the
    # judge, ended early)
    status: str
    tests: list[TestOutcome]
    load_error: str = ""  # the exception of loading the code (a SyntaxError, ...), capped
    stdout: str = ""
    stderr: str = ""
    output_dropped: int = 0  # characters of stdout/stderr over the caps
    exit_code: int | None = None  # of the agent's process when it ended before the judge; negative: by that signal
    wall_s: float = 0.0
    isolation: list[str] = field(default_factory=list)  # the mechanisms that were in force in the agent's process
    notes: list[str] = field(default_factory=list)  # mechanisms that were asked for and could not be set

    @property
    def passed(self) -> int:
        return sum(t.status == PASSED for t in self.tests)

    @property
    def fraction(self) -> float:
        return self.passed / len(self.tests) if self.tests else 0.0


def parse_event(line: bytes, token: str) -> dict | None:
    try:
        event = json.loads(line)
    except ValueError:
        return None
    if not isinstance(event, dict) or event.pop("token", None) != token:
        return None  # not the judge's (it signs each line with a token the agent's process never has)
    return event


@dataclass
class _Events:
    """What the child's events said, folded."""

    isolation: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    load_error: str = ""
    loaded: bool = False
    done: bool = False
    stdout: str = ""
    stderr: str = ""
    dropped: int = 0
    outcomes: dict[int, TestOutcome] = field(default_factory=dict)
    started: int | None = None  # the index of the last test begun
    gone: bool = False  # the agent's process ended before the judge was done with it
    gone_during: object = None  # the index of the test it ended in ("start", "load": before any)

    def fold(self, event: dict, tests: list[Test], limits: Limits) -> None:
        kind = event.get("event")
        if kind == "ready":
            self.isolation = [str(x) for x in event.get("isolation", [])]
            self.notes = [str(x) for x in event.get("notes", [])]
        elif kind == "load":
            self.loaded = event.get("ok") is True
            self.load_error = str(event.get("error", ""))[: limits.detail_chars * 2]
        elif kind == "start":
            self.started = event.get("index")
        elif kind == "test":
            i = event.get("index")
            if isinstance(i, int) and 0 <= i < len(tests):
                status = event.get("status")
                status = status if status in (PASSED, FAILED, ERROR, TIMEOUT) else ERROR
                detail = str(event.get("detail", ""))[: limits.detail_chars]
                self.outcomes[i] = TestOutcome(tests[i].name, status, detail, float(event.get("seconds", 0.0)))
        elif kind == "output":
            self.stdout = str(event.get("stdout", ""))
            self.stderr = str(event.get("stderr", ""))
            self.dropped += int(event.get("dropped", 0))
        elif kind == "gone":
            self.gone, self.gone_during = True, event.get("during")
        elif kind == "done":
            self.done = True


def assemble(
    events: list[dict],
    tests: list[Test],
    exit_code: int | None,
    out: dict[str, bytearray],
    dropped: int,
    timed_out: bool,
    wall_s: float,
    limits: Limits,
) -> ExecutionResult:
    """The result of one execution: the judge's events, the agent's stdout/stderr as read from its pipes, and how it
    ended (`exit_code`: of the agent's process if it ended on its own)."""
    seen = _Events(dropped=dropped)
    for event in events:
        seen.fold(event, tests, limits)
    fd_out = out["stdout"].decode("utf-8", "replace")[: limits.output_chars]
    fd_err = out["stderr"].decode("utf-8", "replace")[: limits.output_chars]
    stdout = (seen.stdout + fd_out)[: limits.output_chars]
    stderr = (seen.stderr + fd_err)[: limits.output_chars]
    if seen.gone:
        status = "crash"
    elif seen.done:
        status = "ok" if seen.loaded else "load_error"
    elif timed_out:
        status = "timeout"
    else:
        status = "crash"
    results = [_outcome(i, test, status, seen, exit_code, limits) for i, test in enumerate(tests)]
    return ExecutionResult(status, results, seen.load_error, stdout, stderr, seen.dropped, exit_code, wall_s,
                           seen.isolation, seen.notes)


def _outcome(i: int, test: Test, status: str, seen: _Events, exit_code: int | None, limits: Limits) -> TestOutcome:
    """Test `i`'s outcome: as the judge reported it, else what the way the execution ended says of it."""
    if seen.gone and seen.gone_during == i:
        return TestOutcome(test.name, ERROR, f"the process died during this test ({_exit_text(exit_code)})")
    if i in seen.outcomes:
        return seen.outcomes[i]
    started = seen.started
    if status == "timeout" and (started == i or (started is None and seen.loaded and not seen.outcomes and i == 0)):
        return TestOutcome(test.name, TIMEOUT, f"killed after the {limits.wall_s:g} s wall-clock limit")
    if status == "crash" and started == i:
        return TestOutcome(test.name, ERROR, f"the process died during this test ({_exit_text(exit_code)})")
    return TestOutcome(test.name, NOT_RUN, "not run: " + _why_not_run(status, exit_code))


def _why_not_run(status: str, exit_code: int | None) -> str:
    if status == "load_error":
        return "the code did not load"
    if status == "timeout":
        return "the execution was killed at its wall-clock limit"
    if status == "crash":
        return f"the process ended before this test ({_exit_text(exit_code)})"
    return "no result"


def _exit_text(code: int | None) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
