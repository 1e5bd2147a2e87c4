"""`async-rl swe make` (tasks from a PyPI package's sdist) and `async-rl demos` on its tasks, each run as
docs/environments.md prints it; the AST mutations it injects; the shipped task file is what the printed command
writes."""

from __future__ import annotations

import ast
import json
import os
import subprocess

import pytest
from project_commands import REPO, docs_command, project_command

from rollout.envs.swe_mutate import remove_tests, sites

SHIPPED = REPO / "tests" / "data" / "swe" / "inflection.jsonl"
SOURCE = '''def pick(items, limit=3, strict=False):
    """Docstring: 1 < 2 stays."""
    if not items:
        return []
    out = [x for x in items if x < limit]
    return sorted(out, key=None) if strict else max(out, 0)
'''


def run_printed(command: list[str], cwd, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([project_command(), *command[1:]], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_every_kind_of_mutation_is_found_and_parses():
    found = sites(SOURCE, "m.py")
    assert {m.kind for m in found} == {"flipped-comparison", "off-by-one", "dropped-branch", "swapped-arguments",
                                       "changed-constant"}
    for mutation in found:
        mutated = mutation.apply(SOURCE)
        ast.parse(mutated)
        assert mutated != SOURCE and "1 < 2 stays" in mutated  # the docstring is never mutated
        assert mutation.function == "pick"
    flipped = next(m for m in found if m.kind == "flipped-comparison").apply(SOURCE)
    assert "x >= limit" in flipped and flipped.count("\n") == SOURCE.count("\n")
    dropped = next(m for m in found if m.kind == "dropped-branch").apply(SOURCE)
    assert "    pass\n" in dropped and "return []" not in dropped


def test_hidden_tests_are_removed_with_their_decorators():
    tests = ("import pytest\n\n\nclass TestA:\n    @pytest.mark.x\n    def test_a(self):\n        pass\n\n\n"
             "@pytest.mark.parametrize('v', [1])\ndef test_b(v):\n    assert v\n\n\ndef test_c():\n    pass\n")
    left = remove_tests(tests, {("TestA", "test_a"), ("test_b",)})
    ast.parse(left)
    assert "test_a" not in left and "test_b" not in left and "parametrize" not in left and "def test_c" in left
    assert "class TestA:\n    pass\n" in left


@pytest.mark.slow  # downloads the sdist from PyPI and judges each kept task twice: ~1 min
def test_swe_make_as_printed_writes_the_shipped_tasks(tmp_path):
    command = docs_command("docs/environments.md", "async-rl swe make")
    done = run_printed(command, tmp_path, 900)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["kept"] == 3 and summary["tried"] >= 3 and len(summary["judge_s"]) == 3
    made = [json.loads(line) for line in (tmp_path / "tests/data/swe/inflection.jsonl").read_text().splitlines()]
    shipped = [json.loads(line) for line in SHIPPED.read_text().splitlines()]
    assert made == shipped  # the same mutants, hidden tests, statements and patches: seeded
    for record in made:
        assert 1 <= len(record["FAIL_TO_PASS"]) <= 10 and record["PASS_TO_PASS"] and record["test_patch"]
        assert (tmp_path / "tests/data/swe" / record["repo_dir"]).is_file()
        assert "def test_" not in record["problem_statement"]  # what the failures report, never the tests' code


@pytest.mark.slow  # plays two gold fixes through the env (two test runs and two judgements): ~30 s
def test_demos_on_the_shipped_tasks_as_printed(tmp_path):
    command = docs_command("docs/environments.md", "async-rl demos --out runs/swe-demos.jsonl")
    (tmp_path / "tests" / "data").mkdir(parents=True)
    (tmp_path / "tests" / "data" / "swe").symlink_to(SHIPPED.parent)
    done = run_printed(command, tmp_path, 600)
    assert done.returncode == 0, done.stderr[-3000:]
    demos = [json.loads(line) for line in (tmp_path / "runs" / "swe-demos.jsonl").read_text().splitlines()]
    assert len(demos) == 2
    for demo in demos:
        calls = [m["tool_calls"][0]["function"]["name"] for m in demo["messages"] if m["role"] == "assistant"]
        assert calls[0] == "read_file" and "str_replace" in calls and calls[-2:] == ["run_tests", "submit"]
        report = [m["content"] for m in demo["messages"] if m["role"] == "tool"][-1]  # submit ends it: no answer
        passed, total = report.split(" ")[0].split("/")
        assert passed == total, report  # the visible suite passes once the gold fix is in
