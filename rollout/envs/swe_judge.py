"""The swe env's test runs: pytest in a sandbox with each test's outcome read off a pipe, and the judge.

`run_pytest` runs a task's `test_cmd` (node ids appended) in a runtime (the namespace shell sandbox,
rollout/sandbox/shell.py, or podman, rollout/sandbox/podman.py) with the outcomes plugin
(rollout/sandbox/pytest_plugin/) writing each test's outcome, signed with a fresh token, on a pipe only this
process reads; what the code under test prints is never parsed. A test passes when its call passed (or was an
expected failure) and neither its setup nor its teardown failed; a test with no outcome did not pass.

`judge` is SWE-bench's rule, in a fresh copy of the base outside every process the agent touched: the agent's
changes to non-test files only (rollout/envs/swe_tasks.py `is_protected`), then `test_patch`, then FAIL_TO_PASS
and PASS_TO_PASS; success only when all pass; score: FAIL_TO_PASS's fraction passing times PASS_TO_PASS's.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from async_rl.env_types import Judgement
from rollout.envs.swe_tasks import SweTask, agent_changes, apply_changes, apply_patch, copy_repo
from rollout.sandbox.processes import force_rmtree
from rollout.sandbox.shell import ShellResult

PLUGIN_DIR = str(Path(__file__).resolve().parent.parent / "sandbox" / "pytest_plugin")
PYTEST_OPTIONS = "-p async_rl_outcomes -p no:cacheprovider -rN"


class Runtime(Protocol):
    def run(self, command: str, workdir: str, env: dict[str, str] | None = None, wall_s: float | None = None,
            pass_fds: tuple[int, ...] = (), binds: tuple[str, ...] = (), readonly: bool = False) -> ShellResult: ...


@dataclass
class TestRun:
    __test__ = False  # not a pytest test class

    outcomes: dict[str, str]  # node id -> passed, failed, error, skipped
    messages: dict[str, str]  # node id -> what its failure reported (pytest's crash line)
    shell: ShellResult
    collect_errors: list[str] = field(default_factory=list)

    def passed(self, node_ids: list[str]) -> list[str]:
        return [n for n in node_ids if self.outcomes.get(n) == "passed"]

    @property
    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for status in self.outcomes.values():
            counts[status] = counts.get(status, 0) + 1
        return counts


def run_pytest(runtime: Runtime, workdir: Path, test_cmd: str, node_ids: list[str], wall_s: float) -> TestRun:
    token = secrets.token_hex(16)
    read_fd, write_fd = os.pipe()
    lines: list[bytes] = []
    reader = threading.Thread(target=_read_all, args=(read_fd, lines), daemon=True)  # a full pipe would block pytest
    reader.start()
    env = {"PYTHONPATH": PLUGIN_DIR, "PYTEST_ADDOPTS": PYTEST_OPTIONS, "ASYNC_RL_OUTCOMES_FD": str(write_fd),
           "ASYNC_RL_OUTCOMES_TOKEN": token}
    command = test_cmd + "".join(" " + shlex.quote(n) for n in node_ids)
    try:
        shell = runtime.run(command, str(workdir), env=env, wall_s=wall_s, pass_fds=(write_fd,), binds=(PLUGIN_DIR,))
    finally:
        os.close(write_fd)
        reader.join(timeout=10)
    return _outcomes(b"".join(lines), token, shell)


def _read_all(fd: int, into: list[bytes]) -> None:
    try:
        while chunk := os.read(fd, 65536):
            into.append(chunk)
    finally:
        os.close(fd)


def _outcomes(data: bytes, token: str, shell: ShellResult) -> TestRun:
    reports: dict[str, dict[str, tuple[str, bool]]] = {}
    messages: dict[str, str] = {}
    collect_errors: list[str] = []
    for line in data.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not isinstance(event, dict) or event.get("token") != token:
            continue
        node, when = str(event.get("nodeid")), str(event.get("when"))
        if when == "collect":
            collect_errors.append(node)
            messages[node] = str(event.get("message", ""))
            continue
        reports.setdefault(node, {})[when] = (str(event.get("outcome")), bool(event.get("xfail")))
        if event.get("message"):
            messages.setdefault(node, str(event["message"]))
    outcomes = {}
    for node, phases in reports.items():
        setup, call, teardown = phases.get("setup"), phases.get("call"), phases.get("teardown")
        if setup and setup[0] == "failed":
            outcomes[node] = "error"
        elif call is None:
            outcomes[node] = "skipped" if setup and setup[0] == "skipped" else "error"
        elif call[0] == "passed" or (call[0] == "skipped" and call[1]):
            outcomes[node] = "failed" if teardown and teardown[0] == "failed" else "passed"
        else:
            outcomes[node] = call[0]
    return TestRun(outcomes, messages, shell, collect_errors)


def judge(task: SweTask, base: Path, agent_copy: Path | None, runtime: Runtime, wall_s: float, work_root: str,
          max_bytes: int = 8 << 20) -> Judgement:
    """SWE-bench's rule on the agent's copy (None: the base unchanged), in a fresh copy of the base."""
    started = time.monotonic()
    fresh = Path(tempfile.mkdtemp(prefix="judge-", dir=work_root))
    try:
        repo = fresh / "repo"
        copy_repo(base, repo)
        changes = agent_changes(base, agent_copy, max_bytes) if agent_copy is not None else None
        if changes is not None:
            apply_changes(repo, changes)
        info = {"files_changed": float(len(changes.written) + len(changes.deleted)) if changes else 0.0,
                "changes_dropped": float(len(changes.dropped)) if changes else 0.0}
        why = apply_patch(repo, task.test_patch)
        if why:
            info.update(test_patch_failed=1.0, judge_s=time.monotonic() - started)
            return Judgement(0.0, False, info)
        ids = task.fail_to_pass + task.pass_to_pass
        run = run_pytest(runtime, repo, task.test_cmd, ids, wall_s)
        f2p, p2p = run.passed(task.fail_to_pass), run.passed(task.pass_to_pass)
        info.update(fail_to_pass=len(f2p) / len(task.fail_to_pass),
                    pass_to_pass=len(p2p) / len(task.pass_to_pass) if task.pass_to_pass else 1.0,
                    judge_timeout=float(run.shell.timed_out), test_patch_failed=0.0,
                    judge_s=time.monotonic() - started)
        # SWE-bench's success; the score is FAIL_TO_PASS's fraction scaled by PASS_TO_PASS's: the plain fraction of
        # both lists gave an unchanged base 0.98 on a made inflection task (449 PASS_TO_PASS, 6 FAIL_TO_PASS)
        score = info["fail_to_pass"] * info["pass_to_pass"]
        return Judgement(score, len(f2p) + len(p2p) == len(ids), info)
    finally:
        remove_tree(fresh)


def remove_tree(path: Path) -> None:
    """A tree the sandbox's uid wrote (root removes it; a directory made unwritable is made writable first)."""
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        force_rmtree(str(path))
