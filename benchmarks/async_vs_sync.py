"""The system benchmark: asynchronous training against a true lock-step baseline, on a latency-bound workload.

Both variants train the same rule (`algo.updates=outcome-only`, `algo.credit=outcome+step`: asynchrony alone is
compared, not immediate updates) on an agent workload where waiting dominates, not this machine's CPU: every
environment step sleeps `env.kwargs.step_latency_s` × a per-trajectory factor from a log-normal with σ =
`env.kwargs.step_latency_sigma` (long-tailed trajectory durations: a slow tool, a long generation), every outcome
waits `env.kwargs.outcome_delay_s` (a judge), and one rollout worker keeps `rollout.max_inflight` trajectories in
flight. They differ in one key:
  sync    algo.mode=sync    lock-step (docs/algorithm.md, "Lock-step mode"): a round of groups_per_step (8) groups
                            is generated, exactly its items are trained, then the next round's leases open;
  async   algo.mode=async   (the default) rollout runs ahead of the learner by up to algo.max_staleness (4)
                            versions, and the learner trains whatever is ready.
Each run stops at the target success rate (the learner's own stop rule: `success_rate_long`, over the last
`replay.long_success_window` = 2,048 finished trajectories) or a wall-time cap. The variants run in the same
invocation, interleaved (sync, async, sync, async, ...), with OMP_NUM_THREADS=1 in every process: the machine is
shared and noisy, so only ratios async ÷ sync are reported:
  throughput       trajectories finished per second between the learner's first and last step (startup excluded);
  learner busy     the sum of the learner's step times over the same span: the fraction of wall time it computes;
  time to target   seconds from launch to the learner step that met the target (the run's stop);
each averaged over repetitions before the ratio is taken; plus the staleness the async runs actually trained at.
The last stdout line is the JSON of the headline figures.

    python benchmarks/async_vs_sync.py           # 2 repetitions, target 0.5, cap 240 s per run (~16 min)
    python benchmarks/async_vs_sync.py --quick   # 1 repetition, 30 s per run, throughput only (~70 s)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402 - benchmarks/ is not a package; scripts run as `python benchmarks/NAME.py`
    OUT_DIR,
    RunResult,
    console,
    emit,
    fmt,
    machine,
    markdown_table,
    print_table,
    ratio,
    train,
)

STEP_LATENCY_S = 0.05
STEP_LATENCY_SIGMA = 1.0
OUTCOME_DELAY_S = 1.0
MAX_INFLIGHT = 128  # one lock-step round (8 groups of 16) in flight at once
WORKLOAD = [
    f"env.kwargs.step_latency_s={STEP_LATENCY_S}",
    f"env.kwargs.step_latency_sigma={STEP_LATENCY_SIGMA}",
    f"env.kwargs.outcome_delay_s={OUTCOME_DELAY_S}",
    f"rollout.max_inflight={MAX_INFLIGHT}",
    "algo.updates=outcome-only",
    "algo.credit=outcome+step",
    "run.max_versions=1000000",
    "run.eval_samples_per_task=0",  # the final evaluation is not part of what is timed
]
VARIANTS = {"sync": ["algo.mode=sync"], "async": ["algo.mode=async"]}


def span(run: RunResult) -> float:
    """Wall seconds between the learner's first and last metrics line."""
    return run.lines[-1]["wall_s"] - run.lines[0]["wall_s"] if len(run.lines) > 1 else 0.0


def throughput(run: RunResult) -> float | None:
    """Trajectories finished per second over the learner's span (startup and model loading excluded)."""
    finished = run.lines[-1]["trajectories_finished"] - run.lines[0]["trajectories_finished"] if run.lines else 0
    return ratio(finished, span(run))


def learner_busy(run: RunResult) -> float | None:
    """Fraction of the learner's span spent in optimizer steps (the first line's step opens the span)."""
    return ratio(sum(line["step_s"] for line in run.lines[1:]), span(run))


def sync_rounds(run: RunResult) -> int:
    """Lock-step rounds completed, from the replay's last metrics line (written when it stops): the learner's lines
    carry the count as of the batch they trained, before that batch's ack opened the next round."""
    replay_lines = run.run_dir / "metrics" / "replay.jsonl"
    if replay_lines.exists():
        text = replay_lines.read_text().strip().splitlines()
        if text:
            return int(json.loads(text[-1]).get("sync_rounds", 0))
    return run.lines[-1].get("sync_rounds", 0) if run.lines else 0


def measure(run: RunResult) -> dict:
    lines = run.lines
    return {
        "throughput": throughput(run),
        "learner_busy": learner_busy(run),
        "time_to_target": lines[-1]["wall_s"] if run.summary["stop_reason"] == "target_success" else None,
        "versions": run.summary["versions"],
        "final_success": run.summary["final_success_rate"],
        "stop_reason": run.summary["stop_reason"],
        "staleness_mean": statistics.mean(line["staleness_mean"] for line in lines) if lines else None,
        "staleness_max": max((max(line["staleness_max_immediate"], line["staleness_max_correction"])
                              for line in lines), default=None),
        "staleness_max_immediate": max((line["staleness_max_immediate"] for line in lines), default=None),
        # How synchronous the run really was: admission refusals, and immediate items too stale to train.
        "leases_denied": lines[-1]["leases_denied"] if lines else 0,
        "sync_rounds": sync_rounds(run),
        "immediate_trained": sum(line["items_immediate"] for line in lines),
        "immediate_skipped_stale": lines[-1]["immediate_skipped_stale"] if lines else 0,
    }


def mean_or_none(values: list[float | None]) -> float | None:
    """The mean over repetitions; None if any repetition has no value (e.g. missed the target)."""
    return None if not values or any(v is None for v in values) else statistics.mean(values)


def summarize(measured: dict[str, list[dict]], target: float) -> dict:
    means = {v: {key: mean_or_none([m[key] for m in ms]) for key in ("throughput", "learner_busy", "time_to_target")}
             for v, ms in measured.items()}
    sync, asynchronous = means["sync"], means["async"]
    return {
        "throughput_ratio": ratio(asynchronous["throughput"], sync["throughput"]),
        "time_to_target_ratio": ratio(asynchronous["time_to_target"], sync["time_to_target"]),
        "speedup_to_target": ratio(sync["time_to_target"], asynchronous["time_to_target"]),
        # Per repetition (same seed for both variants): a pair where either missed the target gives null.
        "time_to_target_ratio_per_rep": [ratio(run["time_to_target"], base["time_to_target"])
                                         for base, run in zip(measured["sync"], measured["async"], strict=True)],
        "throughput_ratio_per_rep": [ratio(run["throughput"], base["throughput"])
                                     for base, run in zip(measured["sync"], measured["async"], strict=True)],
        "learner_busy": {v: means[v]["learner_busy"] for v in measured},
        "learner_busy_ratio": ratio(asynchronous["learner_busy"], sync["learner_busy"]),
        "async_staleness": {
            "mean": statistics.mean(m["staleness_mean"] for m in measured["async"]),
            "max": max(m["staleness_max"] for m in measured["async"]),
            "max_immediate": max(m["staleness_max_immediate"] for m in measured["async"]),
        },
        "target": target,
        "workload": {"step_latency_s": STEP_LATENCY_S, "step_latency_sigma": STEP_LATENCY_SIGMA,
                     "outcome_delay_s": OUTCOME_DELAY_S, "max_inflight": MAX_INFLIGHT, "workers": 1},
        "repetitions": len(measured["sync"]),
        "means": means,
        "runs": measured,
    }


def table_rows(result: dict) -> list[list[str]]:
    rows = []
    for variant, runs in result["runs"].items():
        for rep, m in enumerate(runs):
            rows.append([variant, str(rep), fmt(m["throughput"], ".2f"), fmt(m["learner_busy"], ".3f"),
                         fmt(m["time_to_target"], ".1f"), str(m["versions"]),
                         f"{fmt(m['staleness_mean'], '.2f', '-')} / {m['staleness_max']}", str(m["leases_denied"]),
                         f"{m['immediate_trained']} / {m['immediate_skipped_stale']}"])
    rows.append(["async ÷ sync", "mean", fmt(result["throughput_ratio"], ".2f"),
                 fmt(result["learner_busy_ratio"], ".2f"), fmt(result["time_to_target_ratio"], ".2f"), "", "", "", ""])
    return rows


COLUMNS = ["variant", "rep", "trajectories/s", "learner busy", "s to target", "versions", "staleness mean / max",
           "leases denied", "immediate trained / skipped stale"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 repetition, 30 s per run, no target (~70 s)")
    parser.add_argument("--repetitions", type=int, default=None, help="sync/async pairs (default 2, quick 1)")
    parser.add_argument("--target", type=float, default=None, help="target success rate (default 0.5, quick 0.3)")
    parser.add_argument("--max-wall-s", type=float, default=None, help="cap per run (default 240, quick 30)")
    args = parser.parse_args()
    repetitions = args.repetitions or (1 if args.quick else 2)
    target = args.target or (0.99 if args.quick else 0.5)  # quick: the cap ends the run; throughput only
    max_wall_s = args.max_wall_s or (30.0 if args.quick else 240.0)
    out_dir = OUT_DIR / ("async_vs_sync-quick" if args.quick else "async_vs_sync")
    info = machine()

    measured: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
    for rep in range(repetitions):
        for variant, overrides in VARIANTS.items():  # interleaved: a busy stretch of the machine hits both alike
            name = f"{variant}-rep{rep}"
            console.print(f"[bold]async_vs_sync[/] {name}: to success {target} or {max_wall_s:.0f} s")
            run = train(out_dir, name, [*WORKLOAD, *overrides, f"run.seed={rep}", f"env.kwargs.seed={rep}",
                                        f"env.seed={rep}",
                                        f"run.target_success={target}", f"run.max_wall_s={max_wall_s}"],
                        timeout_s=max_wall_s + 120)
            if not run.lines:  # nothing to measure: say which run and where its logs are, not a format error
                raise SystemExit(f"async_vs_sync {name}: the learner wrote no metrics line in {max_wall_s:.0f} s "
                                 f"(stop reason {run.summary.get('stop_reason')}); its logs: {run.run_dir}/logs; "
                                 "on a loaded host raise --max-wall-s")
            measured[variant].append(measure(run))
            console.print(f"  {measured[variant][-1]}")

    result = summarize(measured, target)
    result["machine"] = info
    result["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    command = "python benchmarks/async_vs_sync.py" + (" --quick" if args.quick else "")
    (out_dir / "result.json").write_text(json.dumps(result, indent=2))
    (out_dir / "table.md").write_text(markdown_table(COLUMNS, table_rows(result), command))
    print_table(f"async vs lock-step: {STEP_LATENCY_S} s steps (σ {STEP_LATENCY_SIGMA}), {OUTCOME_DELAY_S} s "
                f"outcomes, {MAX_INFLIGHT} in flight, target {target}", COLUMNS, table_rows(result))
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
