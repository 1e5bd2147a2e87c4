"""`async-rl train` end to end: real replay, learner and rollout processes over real ZeroMQ sockets."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from project_commands import project_command
from test_faults import killed_on_failure
from test_sandbox import NAMESPACES

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent

SHORT_RUN = [
    "wandb.mode=disabled",
    "run.target_success=null",
    "rollout.workers=2",
    "rollout.group_size=4",
    "env.kwargs.num_tasks=4",
    "env.kwargs.step_latency_s=0.01",
    "env.kwargs.outcome_delay_s=0.3",
    "learner.min_batch_items=4",
    "learner.batch_wait_s=0.2",
    "algo.max_staleness=2",
]


def train(tmp_path: Path, *overrides: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess, Path]:
    args = [sys.executable, "-m", "launch.cli", "train", f"run.dir={tmp_path}", "run.name=t", *SHORT_RUN, *overrides]
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    return done, tmp_path / "t"


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_children_gone(run_dir: Path) -> None:
    for name, pid in json.loads((run_dir / "processes.json").read_text()).items():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
            pytest.fail(f"{name} (pid {pid}) is still running")


def test_default_mode_streams_stages_and_keeps_every_invariant(tmp_path):
    """Slow: a real run of 25 versions (checkpoints at 10 and 20) and the final evaluation this test checks. The
    immediate hold is 0 here, so that every immediate item is served as soon as its stage group is complete: this
    judge (0.3 s) is about two steps' worth of this run's generation, past the default hold, but not by much."""
    done, run_dir = train(tmp_path, "run.max_versions=25", "learner.checkpoint_every=10",  # groups close at checkpoints
                          "algo.immediate_hold=0")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["versions"] == 25 and result["run_dir"] == str(run_dir)
    assert result["eval_version"] == 25 and 0.0 <= result["eval_success_rate"] <= 1.0  # the final weights, evaluated
    lines = metrics(run_dir)
    assert [m["version"] for m in lines] == list(range(1, 26))
    for m in lines:
        assert m["staleness_max_immediate"] <= 2
        assert m["ledger_residual_max"] < 1e-6
    # Immediate items were trained while their trajectories were still running (outcomes take 0.3 s).
    assert sum(m["immediate_before_outcome"] for m in lines) > 0
    assert sum(m["items_immediate"] for m in lines) > 0 and sum(m["items_correction"] for m in lines) > 0
    assert lines[-1]["groups_closed"] > 0
    assert lines[-1]["rejected"] == 0 and lines[-1]["steps_skipped_nonfinite"] == 0, "honest traffic is never refused"
    assert_children_gone(run_dir)


def test_outcome_only_trains_no_immediate_items(tmp_path):
    """Slow: a real `async-rl train` run (three processes) of 6 versions; its final evaluation is not this test's."""
    done, run_dir = train(tmp_path, "run.max_versions=6", "algo.updates=outcome-only", "run.eval_samples_per_task=0")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = metrics(run_dir)
    assert all(m["items_immediate"] == 0 for m in lines)
    assert sum(m["items_correction"] for m in lines) > 0


def test_under_the_default_hold_an_instant_judge_trains_as_outcome_only(tmp_path):
    """Slow: a real `async-rl train` run of 6 versions with the shipped `algo.immediate_hold` (one learner step's
    worth of generation, ~0.1 s here) and an instant judge: the outcomes land while the immediate items wait, so the
    corrections carry the whole credit in one update each (docs/algorithm.md, "Immediate hold") and the ledger is
    exact."""
    done, run_dir = train(tmp_path, "run.max_versions=6", "run.eval_samples_per_task=0", "env.kwargs.outcome_delay_s=0")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = metrics(run_dir)
    assert lines[-1]["immediate_held_over"] > 0 and all(m["immediate_hold_s"] != 0 for m in lines)
    immediates, corrections = (sum(m[key] for m in lines) for key in ("items_immediate", "items_correction"))
    assert corrections > 0 and immediates <= 0.1 * corrections, (immediates, corrections)
    assert all(m["ledger_residual_max"] < 1e-6 for m in lines)


def test_immediate_only_trains_no_corrections(tmp_path):
    """Slow: a real `async-rl train` run (three processes) of 6 versions; its final evaluation is not this test's."""
    done, run_dir = train(tmp_path, "run.max_versions=6", "algo.updates=immediate-only", "run.eval_samples_per_task=0")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = metrics(run_dir)
    assert all(m["items_correction"] == 0 for m in lines)
    assert sum(m["items_immediate"] for m in lines) > 0


def _wait_for(path: Path, timeout: float = 120) -> None:
    """Until `path` has a first complete line (the learner creates metrics.jsonl before its first step)."""
    deadline = time.monotonic() + timeout
    while not (path.exists() and "\n" in path.read_text()):
        assert time.monotonic() < deadline, f"{path} never got a line"
        time.sleep(0.2)


def test_ctrl_c_stops_every_child_cleanly(tmp_path):
    args = [sys.executable, "-m", "launch.cli", "train", f"run.dir={tmp_path}", "run.name=t", *SHORT_RUN]
    launcher = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with killed_on_failure(launcher):
        _wait_for(tmp_path / "t" / "metrics.jsonl")
        launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=90)
    assert launcher.returncode == 130, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["versions"] >= 1
    assert_children_gone(tmp_path / "t")


def test_a_dead_child_past_its_restarts_is_named_and_stops_the_run(tmp_path):
    args = [sys.executable, "-m", "launch.cli", "train", f"run.dir={tmp_path}", "run.name=t", *SHORT_RUN,
            "run.max_restarts=0"]
    launcher = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(tmp_path / "t" / "metrics.jsonl")
    pids = json.loads((tmp_path / "t" / "processes.json").read_text())
    os.kill(pids["rollout-1"], signal.SIGKILL)
    out, err = launcher.communicate(timeout=90)
    assert launcher.returncode == 1
    assert "rollout-1 died" in err and f"async-rl train --resume {tmp_path / 't'}" in err
    assert_children_gone(tmp_path / "t")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_a_killed_launcher_takes_its_children_with_it(tmp_path):
    """SIGKILL gives the launcher no chance to stop anyone: the kernel's parent-death signal must."""
    args = [sys.executable, "-m", "launch.cli", "train", f"run.dir={tmp_path}", "run.name=t", *SHORT_RUN]
    launcher = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for(tmp_path / "t" / "metrics.jsonl")
    launcher.kill()
    launcher.wait()
    killed = time.monotonic()
    pids = json.loads((tmp_path / "t" / "processes.json").read_text())
    gone_after: dict[str, float] = {}
    deadline = killed + 60
    while len(gone_after) < len(pids) and time.monotonic() < deadline:
        gone_after.update({name: round(time.monotonic() - killed, 1) for name, pid in pids.items()
                           if name not in gone_after and not running(pid)})
        time.sleep(0.1)
    alive = [name for name in pids if name not in gone_after]
    for name in alive:  # do not leave them behind for the rest of the suite
        os.kill(pids[name], signal.SIGKILL)
    assert not alive, f"still running 60 s after the launcher was killed: {alive}"
    # Promptly: a learner stopping with its replay gone waited ACK_GIVE_UP_S (30 s) for the Ack of its last batch.
    assert max(gone_after.values()) < LAUNCHER_DEATH_EXIT_S, gone_after


LAUNCHER_DEATH_EXIT_S = 10.0  # a role outliving a killed launcher longer than this was waiting on the dead


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:  # a zombie (exited, not yet reaped) is gone for our purpose
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("algo.max_staleness=-1", "algo.max_staleness: expected int >= 0, got -1"),
        ("env.name=no_such_env_module:factory",
         "env 'no_such_env_module:factory': cannot import module 'no_such_env_module'"),
        ("env.kwargs.stages=0", "env.kwargs.stages: expected `int` >= 1, got 0"),
    ],
)
def test_a_bad_config_or_environment_fails_before_anything_starts(tmp_path, override, expected):
    done = subprocess.run(
        [sys.executable, "-m", "launch.cli", "train", f"run.dir={tmp_path}", override],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2
    assert expected in done.stderr
    assert not any(tmp_path.iterdir())


def test_the_documented_command_form_with_a_config_file_then_overrides(tmp_path):
    """`async-rl train --config FILE key=value ...` exactly as the README prints it (the installed script)."""
    command = [project_command()]
    config = tmp_path / "my.yaml"
    config.write_text((REPO / "configs" / "local.yaml").read_text().replace("name: local", "name: mine"))
    done = subprocess.run(
        [*command, "train", "--config", str(config), f"run.dir={tmp_path}", *SHORT_RUN, "run.max_versions=3",
         "run.eval_samples_per_task=2"],
        capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["versions"] == 3 and result["run_dir"] == str(tmp_path / "mine")


def readme_example_command() -> list[str]:
    """README's "Your own environment" command as printed: `PYTHONPATH=examples async-rl train env.name=...`."""
    line = next(line for line in (REPO / "README.md").read_text().splitlines()
                if line.startswith("PYTHONPATH=examples async-rl train "))
    return line.split()


def test_the_example_environment_trains_from_outside_the_project(tmp_path):
    """README's command for examples/guess_env.py (docs/environments.md prints the same file), run as printed in a
    user's directory that holds a copy of examples/, bounded by a few more overrides."""
    (tmp_path / "examples").mkdir()
    shutil.copy(REPO / "examples" / "guess_env.py", tmp_path / "examples" / "guess_env.py")
    assignment, *command = readme_example_command()
    key, value = assignment.split("=", 1)
    assert key == "PYTHONPATH" and command[:2] == ["async-rl", "train"], (assignment, command)
    launcher = [project_command()]
    args = [*launcher, *command[1:], f"run.dir={tmp_path}",
            "run.name=t", "wandb.mode=disabled", "run.target_success=null", "run.max_versions=12",
            "rollout.group_size=4", "learner.min_batch_items=4", "learner.batch_wait_s=0.2", "run.eval_every=4",
            "run.eval_samples_per_task=4"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([value, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(args, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = metrics(tmp_path / "t")
    assert lines[-1]["trajectories_finished"] > 0 and lines[-1]["env_steps"] > 0
    assert max(m["stage_reward_mean"] for m in lines) > 0  # some guesses were right
    assert all(m["ledger_residual_max"] < 1e-6 for m in lines)
    evaluated = [m for m in lines if "eval_success_rate" in m]
    assert evaluated and evaluated[-1]["eval_tasks"] == 1  # during training, on the eval split (1 task)
    # every eval_every=4 versions: at the first version the worker had at or after each multiple of 4 (weights can
    # arrive two versions at a time), so one evaluation per multiple, none before the first
    versions = sorted({int(m["eval_version"]) for m in evaluated})
    assert versions[0] >= 4 and len({v // 4 for v in versions}) == len(versions) and "eval_turns" in evaluated[-1]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["eval_tasks"] == 1 and result["eval_version"] == 12 and len(result["eval_per_task"]) == 1


def test_the_hunt_trains_and_evaluates_blind(tmp_path):
    """Slow: a real `async-rl train env.name=hunt` run, then `async-rl evaluate --blind` of its weights (the run's
    own final evaluation is skipped: the blind one is what this test checks)."""
    done, run_dir = train(tmp_path, "env.name=hunt", "env.kwargs={}", "env.kwargs.num_tasks=2", "run.max_versions=4",
                          "run.eval_samples_per_task=0")
    assert done.returncode == 0, done.stderr[-3000:]
    config = run_dir / "config.yaml"
    blind = subprocess.run([sys.executable, "-m", "launch.cli", "evaluate", "--config", str(config), "--blind",
                            "run.eval_samples_per_task=4"], capture_output=True, text=True, timeout=120)
    assert blind.returncode == 0, blind.stderr[-3000:]
    result = json.loads(blind.stdout.strip().splitlines()[-1])
    assert result["eval_blind"] is True and result["eval_version"] == 4 and result["eval_tasks"] == 2


def test_evaluating_a_run_that_does_not_exist_is_an_error(tmp_path):
    done = subprocess.run([sys.executable, "-m", "launch.cli", "evaluate", f"run.dir={tmp_path}", "run.name=nope"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"no run at {tmp_path / 'nope'}" in done.stderr


def _sandbox_processes() -> list[int]:
    """Processes running as one of the sandbox's uids (rollout/sandbox/parent.py: 61000 + slot)."""
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uid = int(next(line for line in status.read_text().splitlines() if line.startswith("Uid:")).split()[1])
        except (OSError, StopIteration, ValueError):
            continue
        if 61000 <= uid < 61512:
            pids.append(int(status.parent.name))
    return pids


def test_the_coding_environment_trains_end_to_end_through_real_processes(tmp_path):
    """HumanEval through the sandbox with the tiny byte-level model: stages and judged outcomes flow, the run
    stops at its budget, the final weights are evaluated on the eval split, nothing is left running."""
    args = [sys.executable, "-m", "launch.cli", "train", "env.name=coding", f"run.dir={tmp_path}", "run.name=t",
            "wandb.mode=disabled", "model.max_seq_len=2048", "rollout.max_new_tokens=48", "env.kwargs.max_turns=2",
            "run.max_env_steps=40", "rollout.group_size=4", "rollout.max_inflight=8", "learner.min_batch_items=4",
            "run.eval_samples_per_task=1", "run.eval_max_tasks=2"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert summary["stop_reason"] == "max_env_steps" and summary["env_steps"] >= 40
    assert summary["trajectories_finished"] > 0 and summary["env_errors"] == 0  # judged through the sandbox
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["eval_tasks"] == 2 and result["eval_abandoned"] == 0 and "eval_hidden_fraction" in result
    # how the sandbox isolated the agent's code is said: in the run's result and on every worker metrics line
    lines = [json.loads(x) for x in (tmp_path / "t" / "metrics" / "rollout-0.jsonl").read_text().splitlines()]
    assert all("sandbox_executions_without_namespaces" in line for line in lines)
    assert "eval_judged_without_namespaces" in result  # the random policy may never write code: counts can be 0
    last = [json.loads(path.read_text().splitlines()[-1]) for path in (tmp_path / "t" / "metrics").glob("rollout-*")]
    for key in ("sandbox_executions", "sandbox_executions_without_namespaces"):  # in the run's summary too
        assert summary[key] == result[key] == sum(line[key] for line in last), key
    if NAMESPACES:
        assert lines[-1]["sandbox_executions_without_namespaces"] == 0 and result["eval_judged_without_namespaces"] == 0
    assert_children_gone(tmp_path / "t")
    assert not _sandbox_processes()
