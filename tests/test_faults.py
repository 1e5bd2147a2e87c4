"""Fault injection: `async-rl train` with a role SIGKILLed at a random (seeded) point, then restarted or resumed
(docs/architecture.md, "Resume after a crash"). Every trial checks that the run reaches its budget, that no acked
record is lost (the replay's counts of acked records never go back), that no item is trained twice in the surviving
lineage (the learner lists the item ids it trained, `learner.log_item_ids`), that the ledger stays exact across the
restart, and that no process of the run is left behind.

One trial per fault in CI; `ASYNC_RL_FAULT_TRIALS=5 python -m pytest tests/test_faults.py` is the full form
(docs/results.md, "Fault injection").
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow

TRIALS = int(os.environ.get("ASYNC_RL_FAULT_TRIALS", "1"))
MAX_VERSIONS = 30
FAULT_RUN = [
    "wandb.mode=disabled",
    "run.target_success=null",
    "run.eval_samples_per_task=0",
    "rollout.workers=2",
    "rollout.group_size=4",
    "env.kwargs.num_tasks=4",
    "env.kwargs.step_latency_s=0.01",
    "env.kwargs.outcome_delay_s=0.3",
    "learner.min_batch_items=4",
    "learner.batch_wait_s=0.2",
    "learner.checkpoint_every=5",
    "learner.log_item_ids=true",
    "algo.max_staleness=2",
    "replay.lease_timeout_s=5",
    "learner.request_timeout_s=3",  # a request lost with a killed replay is sent again soon
]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]


def wait_for_versions(run_dir: Path, versions: int, launcher: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert launcher.poll() is None, "the run ended before the fault"
        if (run_dir / "metrics.jsonl").exists() and len(metrics(run_dir)) >= versions:
            return
        time.sleep(0.05)
    pytest.fail(f"no version {versions} within {timeout_s} s")


def surviving_lineage(lines: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the lines of the lineage that survived, the lines of versions that died with a killed learner): a resumed
    learner writes again from its checkpoint's version + 1, so earlier lines at or above that version died."""
    surviving: list[dict] = []
    died: list[dict] = []
    for line in lines:
        while surviving and surviving[-1]["version"] >= line["version"]:
            died.append(surviving.pop())
        surviving.append(line)
    return surviving, died


def processes_of(run_dir: Path) -> list[psutil.Process]:
    """Every live process started for this run (its roles name the run's config.yaml on their command line)."""
    target = (run_dir / "config.yaml").resolve()
    found = []
    for process in psutil.process_iter(["cmdline", "cwd"]):
        for part in process.info["cmdline"] or []:
            if part.endswith("config.yaml") and (Path(process.info["cwd"] or "/") / part).resolve() == target:
                found.append(process)
                break
    return found


def check_run(run_dir: Path, max_versions: int) -> dict:
    """The invariants every trial must keep; returns the numbers the docs table reports."""
    lines = metrics(run_dir)
    surviving, died = surviving_lineage(lines)
    assert [line["version"] for line in surviving] == list(range(1, max_versions + 1)), "the budget is reached"
    trained = [item for line in surviving for item in line["item_ids"]]
    assert len(trained) == len(set(trained)), "an item was trained twice in the surviving lineage"
    for key in ("env_steps", "trajectories_finished", "groups_started"):  # acked records are never lost
        counts = [line[key] for line in lines]
        assert counts == sorted(counts), f"{key} went back: the replay lost acked records"
    assert max(line["ledger_residual_max"] for line in lines) < 1e-6
    last = surviving[-1]
    assert last["groups_closed"] > 0
    if died:  # acks above the checkpoint were rolled back, once
        assert last["rollbacks"] == 1 and last["items_rolled_back"] >= 1
    assert not processes_of(run_dir), "a process of the run is still running"
    return {"versions_lost": len(died), "items_rolled_back": last["items_rolled_back"],
            "trajectories_abandoned": last["trajectories_abandoned"], "items_trained": len(trained)}


def wait_for_checkpoint(run_dir: Path, version: int, launcher: subprocess.Popen,
                        timeout_s: float = 180) -> int:
    """Polls the learner's checkpoints until DeepSpeed's `latest` (written once a checkpoint is complete) names
    v`version` or later; returns how many metrics lines there were at that moment."""
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert launcher.poll() is None, "the run ended before the fault"
        try:
            tag = latest.read_text().strip()
        except OSError:
            tag = ""
        if tag[1:].isdigit() and int(tag[1:]) >= version:
            return len(metrics(run_dir))
        time.sleep(0.002)
    pytest.fail(f"no checkpoint v{version} within {timeout_s} s")


@contextmanager
def killed_on_failure(launcher: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """A failed test must not leave a run behind: a launcher still running when the block ends (an assertion or a
    timeout inside it) is killed, and its children follow it."""
    try:
        yield launcher
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def train_with_fault(tmp_path: Path, role: str, seed: int, *overrides: str,
                     at_checkpoint: int | None = None) -> tuple[subprocess.CompletedProcess, Path, int]:
    """`async-rl train` with `role` SIGKILLed after a random number of versions, or the moment a checkpoint at or
    above v`at_checkpoint` is complete; the launcher restarts it. Returns the launcher's result, the run directory,
    and the number of metrics lines there were at the kill."""
    run_dir = tmp_path / "t"
    kill_after = random.Random(seed).randint(6, 20)
    args = [sys.executable, "-m", "launch.cli", "train", f"run.dir={tmp_path}", "run.name=t", *FAULT_RUN,
            f"run.max_versions={MAX_VERSIONS}", f"run.seed={seed}", *overrides]
    launcher = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with killed_on_failure(launcher):
        if at_checkpoint is None:
            wait_for_versions(run_dir, kill_after, launcher)
        else:
            kill_after = wait_for_checkpoint(run_dir, at_checkpoint, launcher)
        os.kill(json.loads((run_dir / "processes.json").read_text())[role], signal.SIGKILL)
        out, err = launcher.communicate(timeout=240)
    return subprocess.CompletedProcess(args, launcher.returncode, out, err), run_dir, kill_after


@pytest.mark.parametrize("trial", range(TRIALS))
def test_a_killed_learner_is_restarted_and_resumes_from_its_checkpoint(tmp_path, trial):
    """Slow: a real run to 30 versions whose learner is killed mid-run, restarted and resumed from its checkpoint."""
    done, run_dir, kill_after = train_with_fault(tmp_path, "learner", seed=trial)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "learner died (exit code -9); restart 1 of 3" in done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["versions"] == MAX_VERSIONS
    numbers = check_run(run_dir, MAX_VERSIONS)
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert "resumed from checkpoint" in learner_log or numbers["versions_lost"] < 5  # killed before v5: no checkpoint
    print(json.dumps({"fault": "learner", "trial": trial, "killed_after_versions": kill_after, **numbers}))


def test_a_learner_killed_the_moment_it_checkpoints_loses_no_version(tmp_path):
    """The learner writes a step's metrics line before its checkpoint: killed right after a checkpoint vN (N >= 10)
    is complete, the line of vN is there (it once was not, and the resumed run had no line for vN)."""
    done, run_dir, lines_then = train_with_fault(tmp_path, "learner", seed=7, at_checkpoint=10)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "learner died (exit code -9); restart 1 of 3" in done.stderr
    resumed = re.search(r"resumed from checkpoint v(\d+)", (run_dir / "logs" / "learner.log").read_text())
    assert resumed and int(resumed[1]) >= 10, "the restarted learner resumed from the checkpoint it was killed at"
    checkpoint = int(resumed[1])
    assert lines_then >= checkpoint, f"checkpoint v{checkpoint} was complete with {lines_then} metrics lines written"
    check_run(run_dir, MAX_VERSIONS)


@pytest.mark.parametrize("trial", range(TRIALS))
def test_a_killed_rollout_worker_is_restarted_and_its_leases_abandoned(tmp_path, trial):
    """Slow: a real run to 30 versions whose only rollout worker is killed mid-run and restarted."""
    # The only worker: the run cannot reach its budget without the restarted one.
    done, run_dir, kill_after = train_with_fault(tmp_path, "rollout-0", 100 + trial, "rollout.workers=1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rollout-0 died (exit code -9); restart 1 of 3" in done.stderr
    numbers = check_run(run_dir, MAX_VERSIONS)
    last = metrics(run_dir)[-1]
    assert last["workers_restarted"] == 1 and last["rollbacks"] == 0 and last["trajectories_abandoned"] > 0
    print(json.dumps({"fault": "rollout-0", "trial": trial, "killed_after_versions": kill_after, **numbers}))


@pytest.mark.parametrize("trial", range(TRIALS))
def test_a_killed_replay_is_restarted_and_rebuilds_its_state(tmp_path, trial):
    """Slow: a real run to 30 versions whose replay is killed mid-run, restarted and rebuilt from its log."""
    done, run_dir, kill_after = train_with_fault(tmp_path, "replay", seed=200 + trial)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "replay died (exit code -9); restart 1 of 3" in done.stderr
    numbers = check_run(run_dir, MAX_VERSIONS)
    assert "rebuilt the replay from" in (run_dir / "logs" / "replay.log").read_text()
    print(json.dumps({"fault": "replay", "trial": trial, "killed_after_versions": kill_after, **numbers}))


def test_resume_continues_a_stopped_run_in_its_run_directory(tmp_path):
    """`async-rl train --resume runs/local run.max_versions=20` (README) after a run that stopped at 10: the same
    directory, and versions and metrics.jsonl continue."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    first = subprocess.run([sys.executable, "-m", "launch.cli", "train", *FAULT_RUN, "rollout.workers=1",
                            "run.max_versions=10"],
                           capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "runs" / "local"
    resumed = subprocess.run([sys.executable, "-m", "launch.cli", "train", "--resume", "runs/local",
                              "run.max_versions=20"], capture_output=True, text=True, timeout=240, cwd=tmp_path,
                             env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert result["versions"] == 20 and result["run_dir"] == str(run_dir.resolve())
    assert sorted(p.name for p in run_dir.parent.iterdir()) == ["local"], "no fresh run directory"
    assert [line["version"] for line in metrics(run_dir)] == list(range(1, 21))
    assert "resumed from checkpoint v10" in (run_dir / "logs" / "learner.log").read_text()
    assert "max_versions: 20" in (run_dir / "config.yaml").read_text()
    assert not processes_of(run_dir)
