"""A pytest plugin the swe env loads (`-p async_rl_outcomes`): each test's outcome as one JSON line on a pipe.

The pipe's descriptor and a per-run token come in the environment and are taken out of it when pytest configures,
before the repository's code is imported; each line carries the token, so text the code prints is never read as an
outcome. Lines: {"token", "nodeid", "when" (setup, call, teardown, collect), "outcome", "xfail", "message"}.
"""

import json
import os

_state = {}


def pytest_configure(config):
    fd = os.environ.pop("ASYNC_RL_OUTCOMES_FD", None)
    _state["token"] = os.environ.pop("ASYNC_RL_OUTCOMES_TOKEN", "")
    _state["fd"] = int(fd) if fd else None


def _send(nodeid, when, outcome, xfail, message):
    fd = _state.get("fd")
    if fd is None:
        return
    line = json.dumps({"token": _state["token"], "nodeid": nodeid, "when": when, "outcome": outcome,
                       "xfail": xfail, "message": message[:600]}) + "\n"
    data = line.encode()
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        pass


def _message(report):
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None:
        return str(crash.message)
    return str(getattr(report, "longrepr", "") or "")[-600:]


def pytest_runtest_logreport(report):
    _send(report.nodeid, report.when, report.outcome, hasattr(report, "wasxfail"),
          _message(report) if report.failed else "")


def pytest_collectreport(report):
    if report.failed:
        _send(report.nodeid, "collect", "failed", False, _message(report))
