"""Every role's metrics reach W&B (one run per role, one group per training run), and `async-rl train`'s display."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from wandb.proto import wandb_internal_pb2

from async_rl.config_load import config_from_dict
from launch.dashboard import _table
from launch.supervise import Child

REPO = Path(__file__).resolve().parent.parent


def read_offline_run(run_file: Path) -> tuple[wandb_internal_pb2.RunRecord, list[dict[str, str]]]:
    """The run record and the history rows of an offline W&B run file (`run-<id>.wandb`): a 7-byte W&B header,
    then LevelDB-log records in 32 KiB blocks (checksum 4, length 2, type 1: full / first / middle / last), each a
    `Record` protobuf. wandb 0.31 ships no Python reader for them."""
    data = run_file.read_bytes()
    assert data[:4] == b":W&B", f"{run_file} is not a W&B run file"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        if kind in (1, 4):
            records.append(pending)
    run, history = None, []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            history.append({item.key or "/".join(item.nested_key): item.value_json for item in record.history.item})
    assert run is not None, f"no run record in {run_file}"
    return run, history


@pytest.mark.slow
def test_every_role_logs_its_metrics_to_one_wandb_group(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "launch.cli", "train", f"run.dir={tmp_path}", "run.name=t", "wandb.mode=offline",
         "run.metrics_every_s=1", "run.target_success=null", "run.max_versions=12", "run.eval_samples_per_task=0",
         "rollout.workers=2", "rollout.group_size=4", "env.kwargs.num_tasks=4", "env.kwargs.step_latency_s=0.01",
         "env.kwargs.outcome_delay_s=0.3", "learner.min_batch_items=4", "learner.batch_wait_s=0.2"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "t"
    runs = {}
    for run_file in (run_dir / "wandb").glob("offline-run-*/run-*.wandb"):
        run, history = read_offline_run(run_file)
        runs[run.display_name] = (run, history)
    assert set(runs) == {"learner", "replay", "rollout-0", "rollout-1"}
    group = (run_dir / "wandb_group").read_text()
    for role, (run, history) in runs.items():
        assert run.run_group == group and run.run_id == f"{group}-{role}", "one group per training run"
        assert run.job_type == role.split("-")[0]
        assert history, f"{role} logged nothing"
    expected = {
        "learner": {"loss", "grad_norm", "lr", "tokens_per_s", "step_s", "is_ratio_mean", "staleness_mean"},
        "replay": {"queue_immediate", "queue_correction", "leases_held", "admission_wait_s_mean",
                   "queue_staleness_mean", "rejected", "leases_denied", "credit_dropped"},
        "rollout-0": {"trajectories_per_s", "tokens_per_s", "turns_mean", "response_tokens_mean",
                      "step_latency_s_mean", "judge_latency_s_mean", "engine_utilisation", "in_flight"},
    }
    expected["rollout-1"] = expected["rollout-0"]
    for role, keys in expected.items():
        logged = set().union(*runs[role][1])
        assert keys <= logged, f"{role} lacks {keys - logged}"
    learner_rows = runs["learner"][1]
    assert any(float(row["grad_norm"]) > 0 for row in learner_rows)
    assert all(float(row["lr"]) > 0 for row in learner_rows)
    judged = [float(row["judge_latency_s_mean"]) for row in runs["rollout-0"][1] if float(row["trajectories_finished"])]
    assert judged and min(judged) >= 0.3, "the 0.3 s judge is measured"
    for role in expected:  # the same lines as files in the run directory
        path = run_dir / ("metrics.jsonl" if role == "learner" else f"metrics/{role}.jsonl")
        assert path.read_text().count("\n") == len(runs[role][1])


def _finished_child(tmp_path: Path, name: str, code: int) -> Child:
    process = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
    process.wait()
    log_path = tmp_path / f"{name}.log"
    return Child(name, process, log_path, log_path.open("w"))


def _display(tmp_path: Path, run: dict) -> str:
    config = config_from_dict({"run": run})
    children = [_finished_child(tmp_path, "learner", 0), _finished_child(tmp_path, "rollout-0", 3)]
    metrics = {"version": 50, "env_steps": 1000, "wall_s": 100.0, "success_rate": 0.5, "success_rate_long": 0.4,
               "tokens_per_s": 1234.0}
    console = Console(record=True, width=160)
    console.print(_table(metrics, 110.0, children, config))
    for child in children:
        child.log_file.close()
    return console.export_text()


def test_the_display_shows_progress_to_the_target_the_cap_throughput_and_finished_roles_as_done(tmp_path):
    """The run stops at run.target_success (the default) long before its version cap: the bar is the success rate
    against the target (0.4 of 0.8: half-filled), the cap and its ETA follow."""
    text = _display(tmp_path, {"max_versions": 200, "target_success": 0.8})
    assert "success 0.400 of target 0.8; cap: 25% of 200 versions, ETA 300 s" in text  # 100 s for the first quarter
    assert "━" * 15 in text and "━" * 16 not in text  # the 30-wide bar, half-filled by 0.4 / 0.8
    assert "10.0 env steps/s, 0.50 versions/s, 1234 tokens/s trained" in text
    assert "0.500 (0.400), target 0.8" in text
    assert "learner done" in text and "rollout-0 exited 3" in text


def test_without_a_target_the_display_shows_progress_to_the_nearest_budget(tmp_path):
    text = _display(tmp_path, {"max_versions": 200, "target_success": None, "max_wall_s": 1000})
    assert "25% of 200 versions, ETA 300 s" in text and "target" not in text


ROLE_SCRIPT = """
import sys, time
from async_rl.config_load import config_to_dict, load_config
from async_rl.telemetry import MetricsSettings, RoleMetrics
config = load_config(None, [f"run.dir={sys.argv[1]}", "run.name=r", "wandb.mode=offline"])
metrics = RoleMetrics(MetricsSettings(run_dir=config.run_dir, name=config.run.name, wandb=config.wandb,
                                      run_config=config_to_dict(config)), "replay")
metrics.write({"x": 1.0}, step=int(sys.argv[2]))
print("ready", flush=True)
if sys.argv[2] == "0":
    time.sleep(120)  # SIGKILLed here
metrics.close()
"""


@pytest.mark.slow
def test_a_role_killed_and_restarted_beside_a_shared_wandb_service_starts_again(tmp_path):
    """A parent that started a wandb-core service (a notebook, a test runner) passes WANDB_SERVICE to its children.
    A role SIGKILLed in that shared service left its run stream open there, and the restarted role died at init
    ("run ID ... is in use"): each role now starts its own service."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import os, time, wandb; wandb.init(mode='offline', dir=os.getcwd(), id='holder'); "
         "print(os.environ['WANDB_SERVICE'], flush=True); time.sleep(300)"],
        cwd=tmp_path, stdout=subprocess.PIPE, text=True,
    )
    try:
        service = holder.stdout.readline().strip()
        assert service, "the holder started no wandb service"
        env = {**os.environ, "WANDB_SERVICE": service}
        first = subprocess.Popen([sys.executable, "-c", ROLE_SCRIPT, str(tmp_path), "0"], env=env, cwd=tmp_path,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert first.stdout.readline().strip() == "ready", first.stderr.read()
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        again = subprocess.run([sys.executable, "-c", ROLE_SCRIPT, str(tmp_path), "1"], env=env, cwd=tmp_path,
                               capture_output=True, text=True, timeout=120)
        assert again.returncode == 0, again.stderr[-3000:]
    finally:
        holder.kill()
        holder.wait(10)
    lines = (tmp_path / "r" / "metrics" / "replay.jsonl").read_text().splitlines()
    assert len(lines) == 2, lines


def test_the_launchers_metrics_tail_reads_whole_lines_only(tmp_path):
    """`async-rl train`'s display follows metrics.jsonl while the learner appends. A line caught half-written waits
    for its newline (reading it as text once returned the first half, then the rest as a line of its own, and
    json.loads of that killed a run); a line that is not JSON is skipped, never fatal."""
    from launch.dashboard import MetricsTail

    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.poll() == {}  # no file yet
    path.write_bytes(b'{"version": 1}\n{"version": 2, "env_st')
    assert tail.poll() == {"version": 1}
    with open(path, "ab") as f:
        f.write(b'eps": 10}\n')
    assert tail.poll() == {"version": 2, "env_steps": 10}
    with open(path, "ab") as f:
        f.write(b'\n: 0.5, "half": true}\nnot json\n[1, 2]\n{"version": 3}\n')
    assert tail.poll() == {"version": 3}
    assert tail.poll() == {"version": 3} and tail.offset == path.stat().st_size
