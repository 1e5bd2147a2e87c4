"""`async-rl swe make`: SWE-bench tasks made here from a real PyPI package's sdist, in the manner of SWE-smith.

    async-rl swe make --package NAME==VERSION --out FILE.jsonl [--n N]

1. `pip download` the pinned sdist and run its own test suite in the shell sandbox (the tests that pass are the
   ones a mutant may break);
2. inject a bug into a function (rollout/envs/swe_mutate.py; the five kinds taken in turn, in a seeded order) and
   run the suite again; keep the mutant when it breaks 1 to 10 tests, collects cleanly and the rest pass;
3. hide part of the broken tests (about half their functions, at least one) behind `test_patch`: the base the agent
   gets lacks them; FAIL_TO_PASS is every broken test, PASS_TO_PASS the other tests of the same files;
4. write the problem statement from what the hidden failures report (the function that misbehaves and pytest's
   crash lines), as a user would, never the tests' code; the gold `patch` is the inverse diff of the mutation;
5. validate with the env's own judge: the unfixed base must fail and the base with the gold patch succeed.

Each task's base is written as `<FILE>.repos/<instance_id>.tar.gz` beside the task file (its `repo_dir`). The
summary (mutants tried, kept, why the others were not, the judge's seconds per task) is returned and printed.
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from async_rl.errors import AsyncRLError
from rollout.envs.swe_judge import judge, remove_tree, run_pytest
from rollout.envs.swe_mutate import Mutation, remove_tests, sites
from rollout.envs.swe_tasks import (
    DEFAULT_TEST_CMD,
    SweTask,
    apply_patch,
    copy_repo,
    files_of,
    is_protected,
    unified_diff,
    unpack,
)
from rollout.sandbox.shell import ShellLimits, ShellSandbox

log = logging.getLogger("async_rl.swe")
MAX_BROKEN = 10
NOT_MUTATED = {"setup.py", "versioneer.py", "_version.py", "conf.py", "__main__.py"}


def download_sdist(spec: str, into: Path) -> Path:
    """The sdist of NAME==VERSION from PyPI, through pip."""
    name, sep, version = spec.partition("==")
    if not sep or not name.strip() or not version.strip():
        raise AsyncRLError(f"--package: expected NAME==VERSION (a pinned release), got {spec!r}")
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                           "--no-build-isolation", "-q", "-d", str(into), spec], capture_output=True, text=True,
                          timeout=600)
    archives = sorted(into.glob("*.tar.gz"))
    if done.returncode != 0 or not archives:
        raise AsyncRLError(f"--package {spec}: pip could not download its sdist: {done.stderr.strip()[-800:]}")
    return archives[0]


def _test_key(node_id: str) -> tuple[str, tuple[str, ...]]:
    """(file, (class?, function)) of a node id, parameters dropped."""
    path, *names = node_id.split("[")[0].split("::")
    return path, tuple(names)


def _statement(mutation: Mutation, hidden: list[str], messages: dict[str, str], broken: int) -> str:
    module = mutation.path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    lines = [f"`{module}.{mutation.function}` does not behave as it should any more: {broken} of the project's "
             f"tests {'fail' if broken != 1 else 'fails'}. What a failing check reports:", ""]
    for node in hidden[:2]:
        report = [line for line in messages.get(node, "").splitlines() if line.strip()][:4]
        lines += ["    " + line for line in report or ["(no message)"]] + [""]
    lines.append("It used to work; please fix the library so that it behaves as documented again.")
    return "\n".join(lines)


def make_tasks(spec: str, out: Path, n: int = 5, seed: int = 0, max_tries: int = 60,
               shell: ShellSandbox | None = None) -> dict:
    """Up to `n` validated tasks of package `spec` into `out`; the summary."""
    if n < 1:
        raise AsyncRLError(f"--n: expected >= 1, got {n}")
    shell = shell or ShellSandbox(ShellLimits(wall_s=300, cpu_s=600, output_chars=4000))
    work = Path(tempfile.mkdtemp(prefix="async-rl-swe-make-"))
    repos = out.with_name(out.name.removesuffix(".jsonl") + ".repos")
    try:
        pristine = unpack(str(download_sdist(spec, work / "sdist")), work / "pristine")
        return _make(spec, pristine, work, out, repos, n, seed, max_tries, shell)
    finally:
        remove_tree(work)


def _make(spec: str, pristine: Path, work: Path, out: Path, repos: Path, n: int, seed: int, max_tries: int,
          shell: ShellSandbox) -> dict:
    name, _, version = spec.partition("==")
    trial = work / "trial"
    copy_repo(pristine, trial)
    started = time.monotonic()
    baseline = run_pytest(shell, trial, DEFAULT_TEST_CMD, [], 300)
    suite_s = time.monotonic() - started
    passing = {node for node, status in baseline.outcomes.items() if status == "passed"}
    if not passing:
        raise AsyncRLError(f"--package {spec}: its sdist's test suite passed no test here "
                           f"({baseline.counts or 'none ran'}): {baseline.shell.output[-600:]}")
    by_kind: dict[str, list[Mutation]] = defaultdict(list)
    for rel, path in sorted(files_of(pristine).items()):
        if rel.endswith(".py") and not is_protected(rel) and Path(rel).name not in NOT_MUTATED \
                and not rel.startswith(("docs/", "doc/", "examples/", "benchmarks/")):
            for mutation in sites(path.read_text(), rel):
                by_kind[mutation.kind].append(mutation)
    rng = random.Random(f"swe-make/{spec}/{seed}")
    queues = [rng.sample(m, len(m)) for _, m in sorted(by_kind.items())]
    order = [q[i] for i in range(max((len(q) for q in queues), default=0)) for q in queues if i < len(q)]
    summary: dict = {"package": spec, "tests": len(passing), "suite_s": round(suite_s, 2), "tried": 0, "kept": 0,
                     "rejected": defaultdict(int), "judge_s": []}
    repos.mkdir(parents=True, exist_ok=True)
    lines = []
    for mutation in order:
        if summary["kept"] >= n or summary["tried"] >= max_tries:
            break
        summary["tried"] += 1
        original = (pristine / mutation.path).read_text()
        (trial / mutation.path).write_text(mutation.apply(original))
        try:
            # generous: a loaded machine slows a suite several times over; only a mutant that loops should time out
            run = run_pytest(shell, trial, DEFAULT_TEST_CMD, [], max(10 * suite_s + 60, 120))
        finally:
            (trial / mutation.path).write_text(original)
        broken = sorted(node for node in passing if run.outcomes.get(node) != "passed")
        why = ("timeout" if run.shell.timed_out else "collection-error" if run.collect_errors else
               "breaks-nothing" if not broken else f"breaks-over-{MAX_BROKEN}" if len(broken) > MAX_BROKEN else "")
        if why:
            summary["rejected"][why] += 1
            continue
        record = _task(f"{name}-{version}-{summary['kept']}", mutation, pristine, passing, broken, run.messages,
                       rng, repos, out.parent)
        if record is None:
            summary["rejected"]["tests-not-removable"] += 1
            continue
        verdict = _validate(record, out.parent, shell, work)
        if verdict is None:
            summary["rejected"]["not-validated"] += 1
            (out.parent / record["repo_dir"]).unlink(missing_ok=True)
            continue
        summary["judge_s"].append(round(verdict, 2))
        record["mutation"] = {"kind": mutation.kind, "function": mutation.function, "path": mutation.path,
                              "line": mutation.line}
        lines.append(record)
        summary["kept"] += 1
        log.info("kept %s: %s in %s (%d broken)", record["instance_id"], mutation.kind, mutation.function, len(broken))
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    times = summary["judge_s"]
    summary.update(rejected=dict(summary["rejected"]), out=str(out),
                   judge_s_median=statistics.median(times) if times else None,
                   judge_s_range=[min(times), max(times)] if times else None)
    return summary


def _task(instance_id: str, mutation: Mutation, pristine: Path, passing: set[str], broken: list[str],
          messages: dict[str, str], rng: random.Random, repos: Path, folder: Path) -> dict | None:
    """The SWE-bench record of a kept mutant (its base written as a .tar.gz), or None when its tests cannot be
    hidden cleanly."""
    groups = sorted({_test_key(node) for node in broken})
    hidden_groups = set(rng.sample(groups, max(1, len(groups) // 2))) if len(groups) > 1 else set(groups)
    hidden = [node for node in broken if _test_key(node) in hidden_groups]
    files = sorted({path for path, _ in hidden_groups})
    base = repos / f".{instance_id}"
    copy_repo(pristine, base)
    try:
        mutated = mutation.apply((pristine / mutation.path).read_text())
        (base / mutation.path).write_text(mutated)
        test_patch = ""
        for path in files:
            source = (pristine / path).read_text()
            try:
                lacking = remove_tests(source, {names for p, names in hidden_groups if p == path})
                compile(lacking, path, "exec")
            except (SyntaxError, ValueError):
                return None
            (base / path).write_text(lacking)
            test_patch += unified_diff(path, lacking, source)
        archive = repos / f"{instance_id}.tar.gz"
        with tarfile.open(archive, "w:gz") as tar:
            tar.add(base, arcname=instance_id)
    finally:
        remove_tree(base)
    test_files = {_test_key(node)[0] for node in broken}
    return {
        "instance_id": instance_id,
        "problem_statement": _statement(mutation, hidden, messages, len(broken)),
        "patch": unified_diff(mutation.path, mutated, (pristine / mutation.path).read_text()),
        "test_patch": test_patch,
        "FAIL_TO_PASS": broken,
        "PASS_TO_PASS": sorted(node for node in passing if _test_key(node)[0] in test_files and node not in broken),
        "repo_dir": str(archive.relative_to(folder)),
        "test_cmd": DEFAULT_TEST_CMD,
    }


def _validate(record: dict, folder: Path, shell: ShellSandbox, work: Path) -> float | None:
    """The judge's seconds on the gold fix when the unfixed base fails and the gold fix succeeds, else None."""
    task = SweTask(record["instance_id"], record["problem_statement"], record["patch"], record["test_patch"],
                   record["FAIL_TO_PASS"], record["PASS_TO_PASS"], str(folder / record["repo_dir"]))
    check = Path(tempfile.mkdtemp(prefix="validate-", dir=work))
    try:
        base = unpack(task.repo_dir, check / "base")
        unfixed = judge(task, base, None, shell, 300, str(work))
        gold = check / "gold"
        copy_repo(base, gold)
        if apply_patch(gold, task.patch):
            return None
        fixed = judge(task, base, gold, shell, 300, str(work))
    finally:
        remove_tree(check)
    if unfixed.success or not fixed.success:
        log.warning("%s not validated: unfixed %s, gold %s", task.instance_id, unfixed.info, fixed.info)
        return None
    return fixed.info["judge_s"]
