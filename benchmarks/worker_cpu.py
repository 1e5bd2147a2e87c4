"""The rollout worker's CPU per trajectory on vs_trl's one-token task, with env calls inline (the default) and on
pools (`rollout.inline_budget_s=0`), measured side by side in one invocation.

Each run is `async-rl train` on benchmarks/vs_trl.py's task (trap, 1 stage, no traps: a one-token action, an
instant step and judge) for --seconds, with no success target, so every run does the same kind of work until its
time is up. The roles' CPU (utime + stime from /proc, their pids from the run's processes.json) and the trajectories
finished (outcome lines of the worker's ack journal) are read at two moments: 5 s after the first outcome (start-up
and the first weight loads left out) and at the last poll before the run stops; CPU per trajectory is the
difference of the two over the difference of the other. Arms alternate run by run; each arm's median and range is
printed, then the ratio of the medians. CPU time, not wall time: another process on the machine slows a run but
hardly changes what the worker spends on one trajectory.

    python benchmarks/worker_cpu.py                  # 3 runs per arm, 30 s each
    python benchmarks/worker_cpu.py --profile        # and py-spy's share of the worker's samples by part, per arm
    python benchmarks/worker_cpu.py --quick          # 1 run per arm, 15 s each (the suite's form)

The last stdout line is JSON: {"worker_ms_per_trajectory": {arm: median}, "ratio_inline_to_pools": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import OUT_DIR, console, emit, machine, pinned_env, print_table  # noqa: E402
from vs_trl import TASK  # noqa: E402 - the very task TRL is compared on

ARMS = {"inline": [], "pools": ["rollout.inline_budget_s=0"]}
ROLES = ("rollout-0", "replay", "learner")
TICK_S = os.sysconf("SC_CLK_TCK")
# py-spy frames (file names) that say which part of the worker a sample is in, first match wins
PARTS = [("env calls on pool threads", ("plugin_calls.py",)), ("ack journal", ("ack_journal.py",)),
         ("replay link (ZeroMQ, acks)", ("link.py", "transport.py")),
         ("engine", ("torch_engine.py", "engine_calls.py")),
         ("env calls inline", ("inline_calls.py",)), ("runner (phases, records)", ("runner.py", "env_calls.py")),
         ("worker loop", ("worker.py",))]


def cpu_s(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK_S  # utime, stime


def outcomes(journal: Path) -> int:
    return journal.read_bytes().count(b'"k":"outcome"') if journal.exists() else 0


def one_run(arm: str, index: int, seconds: float, profile: bool) -> dict:
    out = OUT_DIR / "worker_cpu"
    run_dir = out / f"{arm}-{index}"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = TASK + [f"run.dir={out}", f"run.name={arm}-{index}", "run.target_success=null",
                        f"run.max_wall_s={seconds}", "run.eval_samples_per_task=0", "rollout.group_size=16",
                        "wandb.mode=disabled", "run.log_level=WARNING", *ARMS[arm]]
    proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "train", *overrides], env=pinned_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    journal = run_dir / "acks" / "rollout-0.jsonl"
    first: tuple[float, dict, int] | None = None
    last: tuple[float, dict, int] | None = None
    spy = None
    first_outcome_at = None
    while proc.poll() is None:
        time.sleep(0.25)
        try:
            pids = json.loads((run_dir / "processes.json").read_text())
        except (OSError, ValueError):
            continue
        now, done = time.monotonic(), outcomes(journal)
        if done and first_outcome_at is None:
            first_outcome_at = now
        if first_outcome_at is None or now - first_outcome_at < 5:
            continue
        cpus = {role: cpu_s(pids[role]) for role in ROLES if role in pids}
        if any(v is None for v in cpus.values()):
            break  # a role has exited: the run is stopping
        if first is None:
            first = (now, cpus, done)
            if profile:
                spy = subprocess.Popen(["py-spy", "record", "-p", str(pids["rollout-0"]), "-r", "200", "-f", "raw",
                                        "-o", str(run_dir / "worker.spy"), "--nonblocking",
                                        "-d", str(max(1, int(seconds / 2)))],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        last = (now, cpus, done)
    stderr = proc.communicate()[1]
    if spy is not None:
        spy.wait(timeout=120)
    if proc.returncode != 0 or first is None or last is None or last[2] <= first[2]:
        raise SystemExit(f"{arm} run {index} failed (exit {proc.returncode}): {stderr[-2000:]}")
    trajectories = last[2] - first[2]
    worker_lines = (run_dir / "metrics" / "rollout-0.jsonl").read_text().splitlines()
    result = {"arm": arm, "trajectories": trajectories, "seconds": last[0] - first[0],
              "loop_moves": json.loads(worker_lines[-1]).get("loop_moves") if worker_lines else None,
              **{f"{role}_ms": 1000 * (last[1][role] - first[1][role]) / trajectories for role in first[1]}}
    if spy is not None and (run_dir / "worker.spy").exists():
        result["parts"] = parts(run_dir / "worker.spy")
    return result


def parts(raw: Path) -> dict[str, float]:
    """Share of the worker's non-idle samples by part: the innermost frame of ours (or a pool thread's) decides."""
    counts: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        part = "other (Python, torch, threads starting)"
        for frame in reversed(frames):
            hit = next((name for name, files in PARTS if any(f in frame for f in files)), None)
            if hit:
                part = hit
                break
        counts[part] += int(n)
    total = sum(counts.values()) or 1
    return {part: counts[part] / total for part, _ in counts.most_common()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per arm (default 3)")
    parser.add_argument("--seconds", type=float, default=30.0, help="run.max_wall_s of each run (default 30)")
    parser.add_argument("--profile", action="store_true", help="py-spy the worker in each arm's first run")
    parser.add_argument("--quick", action="store_true", help="1 run per arm, 15 s each")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.seconds = 1, 15.0
    if args.profile and not shutil.which("py-spy"):
        parser.error("--profile needs py-spy on the PATH (the bench extra: pip install -e '.[bench]')")
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for index in range(args.runs):
        for arm in (ARMS if index % 2 == 0 else reversed(list(ARMS))):
            result = one_run(arm, index, args.seconds, args.profile and index == 0)
            console.print(f"{arm} run {index}: {result['trajectories']} trajectories, worker "
                          f"{result['rollout-0_ms']:.3f} ms each")
            results[arm].append(result)
    rows, medians = [], {}
    for arm, runs in results.items():
        row = [arm]
        for role in ROLES:
            values = [r[f"{role}_ms"] for r in runs]
            medians[(arm, role)] = statistics.median(values)
            row.append(f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})")
        row.append(f"{statistics.median(r['trajectories'] / r['seconds'] for r in runs):.0f}")
        rows.append(row)
    print_table("CPU ms per trajectory (median and range over runs)", ["arm", *ROLES, "trajectories/s"], rows)
    for arm, runs in results.items():
        if "parts" in runs[0]:
            print(f"{arm}: worker samples by part: " + ", ".join(f"{p} {100 * v:.0f}%" for p, v in
                                                                 runs[0]["parts"].items()))
    payload = {"worker_ms_per_trajectory": {arm: medians[(arm, "rollout-0")] for arm in ARMS},
               "ratio_inline_to_pools": medians[("inline", "rollout-0")] / medians[("pools", "rollout-0")],
               "replay_ratio": medians[("inline", "replay")] / medians[("pools", "replay")],
               "runs": results, "machine": machine()}
    emit(payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
