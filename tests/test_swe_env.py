"""env.name=swe: a task file in SWE-bench's format written by hand, its tools, its judge, and the reward hacks that
must fail (each in its own test). The repository is a small package written here; the judge and every tool run in
the real shell sandbox (namespaces, a uid of its own as root)."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from async_rl.env_types import Action, ToolCall
from rollout.envs.base import EnvError, checked_judge, checked_reset, checked_step, load_factory, tools_of
from rollout.envs.swe_tasks import hunks, is_protected, unified_diff

BUGGY = ("def mean(values):\n    return sum(values) / (len(values) + 1)\n\n\n"
         "def clip(x, lo, hi):\n    return max(lo, min(x, hi))\n")
FIXED = BUGGY.replace("(len(values) + 1)", "len(values)")
VISIBLE = ("from stats.core import clip, mean\n\n\ndef test_clip():\n    assert clip(5, 0, 3) == 3\n\n\n"
           "def test_mean_of_one():\n    assert mean([4]) == 4\n")
HIDDEN = "from stats.core import mean\n\n\ndef test_mean_of_two():\n    assert mean([1, 3]) == 2\n"


def call(name: str, **arguments) -> Action:
    return Action("", [ToolCall(name, arguments, f"call_{name}")])


@pytest.fixture(scope="module")
def task_file(tmp_path_factory) -> Path:
    """A task file as someone outside the project writes it: SWE-bench's fields (the lists as JSON strings, as
    SWE-bench stores them; its other fields present), a repository directory relative to the file."""
    root = tmp_path_factory.mktemp("outside")
    repo = root / "repos" / "stats"
    (repo / "stats").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "stats" / "__init__.py").write_text("")
    (repo / "stats" / "core.py").write_text(BUGGY)
    (repo / "tests" / "test_core.py").write_text(VISIBLE)
    record = {
        "repo": "example/stats", "base_commit": "0" * 40, "version": "1.0", "created_at": "2026-01-01",
        "instance_id": "stats-1",
        "problem_statement": "mean() gives the wrong answer: mean([1, 3]) is not 2.",
        "patch": unified_diff("stats/core.py", BUGGY, FIXED),
        "test_patch": unified_diff("tests/test_hidden.py", None, HIDDEN),
        "FAIL_TO_PASS": json.dumps(["tests/test_hidden.py::test_mean_of_two", "tests/test_core.py::test_mean_of_one"]),
        "PASS_TO_PASS": json.dumps(["tests/test_core.py::test_clip"]),
        "repo_dir": "repos/stats",
    }
    path = root / "tasks.jsonl"
    path.write_text(json.dumps(record) + "\n")
    return path


@pytest.fixture(scope="module")
def swe(task_file):
    f = load_factory("swe", {"tasks": str(task_file), "eval_fraction": 0.0, "max_turns": 12, "bash_timeout_s": 5})
    yield f
    f.close()


def episode(swe):
    env = swe.make()
    (task,) = swe.tasks("train")
    prompt = checked_reset("swe", env, task)
    return env, prompt


def test_a_hand_written_swe_bench_file_runs_unchanged_and_the_gold_fix_succeeds(swe):
    env, prompt = episode(swe)
    assert "mean([1, 3]) is not 2" in prompt and "mean_of_two" not in prompt  # hidden tests stay hidden
    assert [t["function"]["name"] for t in tools_of("swe", env)] == [
        "bash", "read_file", "write_file", "str_replace", "run_tests", "submit"]
    assert "len(values) + 1" in checked_step("swe", env, call("read_file", path="stats/core.py")).observation[0].content
    first = checked_step("swe", env, call("run_tests"))
    assert first.reward == pytest.approx(0.5) and "1/2 passed" in first.observation[0].content
    assert "FAILED tests/test_core.py::test_mean_of_one" in first.observation[0].content
    edit = checked_step("swe", env, call("str_replace", path="stats/core.py", old_str="(len(values) + 1)",
                                         new_str="len(values)"))
    assert "Replaced 1" in edit.observation[0].content and edit.reward == 0.0
    assert checked_step("swe", env, call("run_tests", tests=["tests/test_core.py::test_mean_of_one"])).reward == 1.0
    assert checked_step("swe", env, call("submit")).done
    judgement = checked_judge("swe", env)
    assert judgement.success and judgement.score == 1.0 and judgement.info["fail_to_pass"] == 1.0
    assert judgement.info["tests_run"] == 2 and judgement.info["judge_s"] > 0
    env.close()


def test_tools_answer_mistakes_with_errors_not_exceptions(swe):
    env, _ = episode(swe)
    replies = [checked_step("swe", env, call(*c[:1], **c[1])).observation[0].content for c in [
        ("str_replace", {"path": "stats/core.py", "old_str": "return", "new_str": "yield"}),
        ("read_file", {"path": "../../etc/passwd"}),
        ("read_file", {"path": "missing.py"}),
        ("bash", {"command": ""}),
        ("run_tests", {"tests": 3}),
        ("write_file", {"path": "stats", "content": "x"}),
        ("read_file", {"path": "a\x00b"}),
    ]]
    assert "old_str occurs 2 times" in replies[0] and "exactly once" in replies[0]
    assert "outside the repository" in replies[1] and "no such file" in replies[2]
    assert "non-empty" in replies[3] and "list of pytest node ids" in replies[4]
    assert replies[5].startswith("error: [Errno 21] Is a directory") and replies[6].startswith("error: ")
    bad = checked_step("swe", env, Action("<tool_call>{", [], "tool call 1: malformed JSON"))
    assert "malformed JSON" in bad.observation[0].content
    assert "No tool call" in checked_step("swe", env, Action("I think it is fine.", [])).observation
    env.close()


def test_a_bad_line_is_refused_with_its_line_number_and_field(tmp_path, task_file):
    good = task_file.read_text().strip()
    for change, field in [({"FAIL_TO_PASS": "[not json"}, "FAIL_TO_PASS"), ({"patch": 3}, "patch"),
                          ({"repo_dir": "nowhere"}, "repo_dir"), ({"FAIL_TO_PASS": []}, "FAIL_TO_PASS"),
                          ({"PASS_TO_PASS": [1]}, "PASS_TO_PASS")]:
        record = {**json.loads(good), **change, "repo_dir": str(task_file.parent / "repos" / "stats")}
        record.update(change)
        path = tmp_path / "bad.jsonl"
        path.write_text(good.replace('"repos/stats"', json.dumps(str(task_file.parent / "repos" / "stats")))
                        + "\n\n" + json.dumps(record) + "\n")
        with pytest.raises(EnvError, match=f"env.kwargs.tasks: .*bad.jsonl line 3: {field}"):
            load_factory("swe", {"tasks": str(path)}).tasks("train")
    record = json.loads(good)
    del record["repo_dir"]
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(EnvError, match="line 1: repo_dir: missing .SWE-bench's own lines"):
        load_factory("swe", {"tasks": str(path)}).tasks("train")
    with pytest.raises(EnvError, match="env.kwargs.max_turns"):
        load_factory("swe", {"tasks": str(path), "max_turns": 0})
    with pytest.raises(EnvError, match="env.kwargs.nonsense"):
        load_factory("swe", {"tasks": str(path), "nonsense": 1})


def test_which_paths_are_protected():
    for path in ("tests/test_core.py", "pkg/tests/helpers.py", "test_x.py", "pkg/x_test.py", "conftest.py",
                 "pkg/conftest.py", "setup.cfg", "pyproject.toml", "pytest.py", "_pytest/main.py", "x.pth"):
        assert is_protected(path), path
    for path in ("stats/core.py", "stats/testing_utils.py", "README.md", "src/pkg/contest.py"):
        assert not is_protected(path), path
    assert hunks(unified_diff("a.py", "x = 1\ny = 2\n", "x = 1\ny = 3\n")) == [("a.py", "x = 1\ny = 2\n",
                                                                               "x = 1\ny = 3\n")]


# --- reward hacks: each fails or is contained --------------------------------------------------------------------


def judged(swe, *actions) -> tuple:
    env, _ = episode(swe)
    for action in actions:
        checked_step("swe", env, action)
    judgement = checked_judge("swe", env)
    return env, judgement


def test_hack_submitting_nothing_fails(swe):
    env, judgement = judged(swe, call("submit"))
    assert not judgement.success and judgement.info["fail_to_pass"] == 0.0 and judgement.info["files_changed"] == 0
    assert judgement.score == 0.0 and judgement.info["pass_to_pass"] == 1.0  # the untouched tests do not pay
    env.close()


def test_hack_deleting_and_rewriting_the_tests_fails(swe):
    env, judgement = judged(swe, call("bash", command="rm -rf tests"),
                            call("write_file", path="tests/test_core.py", content="def test_ok():\n    pass\n"),
                            call("write_file", path="stats/test_more.py", content="def test_ok():\n    pass\n"))
    assert not judgement.success and judgement.info["fail_to_pass"] == 0.0
    assert judgement.info["changes_dropped"] >= 2 and judgement.info["files_changed"] == 0
    env.close()


def test_hack_a_conftest_that_turns_failures_into_passes_fails(swe):
    hook = ("import pytest\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
            "    outcome = yield\n    report = outcome.get_result()\n    report.outcome = 'passed'\n")
    env, _ = episode(swe)
    for path in ("conftest.py", "tests/conftest.py", "stats/conftest.py"):
        checked_step("swe", env, call("write_file", path=path, content=hook))
    seen = checked_step("swe", env, call("run_tests"))  # the agent's own run is fooled: it is its own copy
    assert seen.reward == 1.0
    judgement = checked_judge("swe", env)
    assert not judgement.success and judgement.info["fail_to_pass"] == 0.0 and judgement.info["changes_dropped"] == 3
    env.close()


def test_hack_writing_the_tests_that_test_patch_will_add_fails(swe):
    fake = "def test_mean_of_two():\n    pass\n"
    env, judgement = judged(swe, call("write_file", path="tests/test_hidden.py", content=fake),
                            call("bash", command="printf 'def test_mean_of_one():\\n    pass\\n' > tests/test_core.py"))
    assert not judgement.success and judgement.info["test_patch_failed"] == 0.0
    assert judgement.info["fail_to_pass"] == 0.0
    env.close()


def test_hack_runner_files_are_not_taken(swe):
    """A pytest.ini, setup.cfg or a pytest.py beside the package that would replace the runner: dropped."""
    env, judgement = judged(swe, call("write_file", path="pytest.ini", content="[pytest]\naddopts = --co\n"),
                            call("write_file", path="pytest.py", content="import sys\nsys.exit(0)\n"))
    assert not judgement.success and judgement.info["changes_dropped"] == 2
    env.close()


def test_hack_bash_cannot_write_outside_its_copy(swe, tmp_path):
    outside = tmp_path / "outside.txt"
    tmp_path.chmod(0o777)  # even a world-writable directory of the host is out of reach
    env, _ = episode(swe)
    result = checked_step("swe", env, call("bash", command=f"echo x > {outside}; echo y > /etc/hacked; "
                                                           f"echo z > ../escape; echo ok > inside.txt; echo done"))
    text = result.observation[0].content
    assert "done" in text and not outside.exists() and not Path("/etc/hacked").exists()
    assert not (env.repo.parent / "escape").exists() and (env.repo / "inside.txt").read_text() == "ok\n"
    env.close()


def test_hack_bash_cannot_reach_a_server_on_the_hosts_loopback(swe):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted = []

    def accept():
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            try:
                accepted.append(server.accept())
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept)
    thread.start()
    env, _ = episode(swe)
    probe = (f"python -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('IN')\""
             f" 2>&1 | tail -1; (echo hi > /dev/tcp/127.0.0.1/{port}) 2>&1 | tail -1")
    text = checked_step("swe", env, call("bash", command=probe)).observation[0].content
    thread.join()
    server.close()
    assert accepted == [] and "IN" not in text and "unreachable" in text.lower()
    env.close()


def test_hack_a_fork_bomb_is_contained(swe):
    env, _ = episode(swe)
    started = time.monotonic()
    text = checked_step("swe", env, call("bash", command="b() { b | b & }; b; sleep 2; echo survived")).observation[0]
    assert time.monotonic() - started < 20
    assert "exit code" in text.content or "timed out" in text.content
    after = checked_step("swe", env, call("bash", command="echo alive")).observation[0].content
    assert "alive" in after  # the next call runs: nothing of the bomb is left holding the uid or the machine
    env.close()


def test_hack_bash_that_never_returns_is_killed_at_its_limit(swe):
    env, _ = episode(swe)
    started = time.monotonic()
    text = checked_step("swe", env, call("bash", command="(sleep 1000 &); while true; do :; done")).observation[0]
    assert "timed out (killed)" in text.content and time.monotonic() - started < 15
    left = subprocess.run(["pgrep", "-f", "sleep 1000"], capture_output=True, text=True).stdout.split()
    assert left == []
    env.close()


def test_require_namespaces_fails_closed(task_file, monkeypatch):
    from rollout.sandbox.shell import ShellSandbox

    original = ShellSandbox._spec  # a host that forbids unshare: the shell's process gets no namespaces
    monkeypatch.setattr(ShellSandbox, "_spec", lambda self, *a: {**original(self, *a), "namespaces": False})
    with pytest.raises(EnvError, match="env.kwargs.require_namespaces: namespaces are required") as refused:
        load_factory("swe", {"tasks": str(task_file)})
    assert "CLONE_NEWNET|CLONE_NEWNS" in str(refused.value) and "require_namespaces: false" in str(refused.value)
    load_factory("swe", {"tasks": str(task_file), "require_namespaces": False}).close()  # the explicit opt-out


def test_the_sandboxed_scripts_import_nothing_of_the_project():
    """The outcomes plugin and the shell child import nothing of the project (they run inside the sandbox)."""
    for script in ("rollout/sandbox/shell_child.py", "rollout/sandbox/pytest_plugin/async_rl_outcomes.py"):
        source = (Path(__file__).resolve().parent.parent / script).read_text()
        assert "rollout" not in "".join(x for x in source.splitlines() if x.startswith(("import", "from")))
