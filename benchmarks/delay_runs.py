"""benchmarks/delay.py's runs: one measured (or kept from before), several at once, the baseline's staleness sweep."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import BenchmarkError, RunResult, console, first_at_target, ratio, read_metrics, train
from delay_parts import best_staleness, staleness_summary, success_at_walls, wall_marks

from learner.metrics import GuardWatch

TARGET, WINDOW = 0.8, 2048
HALF = 0.5  # a second, lower target: where neither arm reaches 0.8 within the cap, how fast each got half-way
STEP_LATENCY_S = 0.01  # --step-latency-s default: a tool call, every env step waits this long (both arms)


def throughput(run: RunResult, tail: float = 1.0) -> tuple[float | None, float | None]:
    """(trajectories/s, trajectories per learner update) between the learner's first and last metrics line, or over
    the last `tail` of its lines (a policy that learns to play longer episodes gets slower as it learns: on the hunt,
    the start of a run overstates what the rest of it generates)."""
    lines = run.lines[-max(2, math.ceil(tail * len(run.lines))):]
    if len(lines) < 2:
        return None, None
    first, last = lines[0], lines[-1]
    finished = last["trajectories_finished"] - first["trajectories_finished"]
    return ratio(finished, last["wall_s"] - first["wall_s"]), ratio(finished, last["version"] - first["version"])


def d_from_updates(run: RunResult, delay_s: float) -> float | None:
    """The run's learner updates per second (between its first and last metrics line) × the judge delay."""
    if len(run.lines) < 2:
        return None
    per_s = ratio(run.lines[-1]["version"] - run.lines[0]["version"], run.lines[-1]["wall_s"] - run.lines[0]["wall_s"])
    return None if per_s is None else round(delay_s * per_s, 1)


def bound_needed(lines: list[dict]) -> int | None:
    """The 90th percentile over the run's metrics lines of `correction_bound_needed` (learner/metrics.py), recomputed
    from the lines so runs logged before the learner wrote it get it too: the correction bound at which the guard
    would not have held this run's learner."""
    watch = GuardWatch()
    needed = sorted(watch.update(m["wall_s"], m.get("guard_held_s", 0.0), m.get("staleness_max_correction", 0))
                    ["correction_bound_needed"] for m in lines if "wall_s" in m)
    return needed[min(len(needed) - 1, int(0.9 * len(needed)))] if needed else None


def bound_used(lines: list[dict]) -> int | None:
    """The largest correction bound in use once the first outcome was in: before it `auto` is its cap (the judge's
    delay is not known yet: replay/guard.py), which says nothing about the judge. The bound is set once per version,
    so the first line with a finished trajectory may still carry the cap: it is skipped too."""
    after = [m for m in lines if m.get("trajectories_finished", 0) > 0][1:]
    return max((m.get("correction_bound", 0) for m in after), default=None)


def measure(run: RunResult, delay_s: float, per_update: float, marks: list[float]) -> dict:
    hit = first_at_target(run.lines, TARGET, WINDOW, key="success_rate_long")
    half = first_at_target(run.lines, HALF, WINDOW, key="success_rate_long")
    last = run.lines[-1] if run.lines else {}
    per_s, _ = throughput(run)
    return {
        "env_steps_to_target": hit and hit["env_steps"],
        "wall_s_to_target": hit and round(hit["wall_s"], 1),
        "env_steps_to_half": half and half["env_steps"],
        "wall_s_to_half": half and round(half["wall_s"], 1),
        "d_measured": None if per_s is None else round(delay_s * per_s / per_update, 1),
        # the run's own learner updates during one judge delay: D by its definition for outcome-only+step (its every
        # update is an outcome-only one); not comparable for the arms that also step on immediate items
        "d_from_updates": d_from_updates(run, delay_s),
        "trajectories_per_s": per_s and round(per_s, 1),
        "credit_dropped": last.get("credit_dropped", 0),
        "guard_held_s": round(last.get("guard_held_s", 0.0), 1),
        "bound_needed": bound_needed(run.lines),
        "bound_used_max": bound_used(run.lines),
        "env_steps_end": last.get("env_steps"),
        "versions": run.summary["versions"],
        "wall_s": round(last["wall_s"], 1) if "wall_s" in last else None,
        "final_success_long": last.get("success_rate_long", 0.0),
        "success_at_wall": success_at_walls(run.lines, marks),
        "stop_reason": run.summary["stop_reason"],
    }


def run_job(args: argparse.Namespace, out_dir: Path, done_dir: Path, job: tuple[str, list[str], dict],
            marks: list[float]) -> tuple[str, dict]:
    """One run (kept in done/ under --reuse, after checking it was made with the same learner flags and step
    latency), measured: its key and figures. A failed run is reported, not the whole sweep lost."""
    key, overrides, meta = job
    saved = done_dir / f"{key}.json"
    if saved.exists():
        console.print(f"[bold]delay[/] {key}: reused from {saved}")
        kept = json.loads(saved.read_text())
        if kept.get("learner", meta["learner"]) != meta["learner"]:  # runs kept before 2026-11-27 have none
            raise SystemExit(f"{key}: kept in {saved} with the learner settings {kept['learner']}, and this "
                             f"invocation asks for {meta['learner']}: --reuse would mix them; use another --out")
        # runs kept before 2026-11-29 have none: they all ran at STEP_LATENCY_S
        if kept.get("step_latency_s", STEP_LATENCY_S) != meta["step_latency_s"]:
            raise SystemExit(f"{key}: kept in {saved} with a {kept.get('step_latency_s', STEP_LATENCY_S)} s step "
                             f"latency, and this invocation asks for {meta['step_latency_s']} s: --reuse would mix "
                             "them; use another --out")
        kept.setdefault("step_latency_s", STEP_LATENCY_S)
        stdout, run_dir = out_dir / f"{key}.stdout.log", out_dir / key
        if "failed" not in kept and stdout.exists() and (run_dir / "metrics.jsonl").exists():
            # measured again from the run's own files, so that figures added since are filled in too
            summary = json.loads(stdout.read_text().strip().splitlines()[-1])
            run = RunResult(key, run_dir, summary, read_metrics(run_dir), 0.0)
            kept = {**kept, **measure(run, meta["delay_s"], meta["per_update"], marks)}
        return key, kept
    console.print(f"[bold]delay[/] {key}: judge {meta['delay_s']} s, max_staleness {meta['max_staleness']}, "
                  f"max_correction_staleness {meta['max_correction_staleness']}")
    try:
        run = train(out_dir, key, overrides, timeout_s=marks[-1] + 180)
    except BenchmarkError as error:  # one failed run is reported, not the whole sweep lost
        console.print(f"  [red]failed[/]: {error}")
        return key, {**meta, "failed": str(error).splitlines()[0], "env_steps_to_target": None,
                     "wall_s_to_target": None, "d_measured": None, "credit_dropped": 0, "guard_held_s": None}
    measured = {**meta, **measure(run, meta["delay_s"], meta["per_update"], marks)}
    saved.write_text(json.dumps(measured))
    console.print(f"  {measured}")
    return key, measured


def run_all(args: argparse.Namespace, jobs: list, run: Callable) -> list[tuple[str, dict]]:
    """`run` over the jobs, --parallel at a time (in order: with 2, the arms of one seed side by side)."""
    if args.parallel > 1:
        with ThreadPoolExecutor(args.parallel) as pool:
            return list(pool.map(run, jobs))
    return [run(job) for job in jobs]


def sweep_staleness(args: argparse.Namespace, out_dir: Path, done_dir: Path, cell: str, values: list[int],
                    overrides: list[str], meta: dict) -> dict:
    """outcome-only+step's best `algo.max_staleness` in one cell: short runs (`--sweep-seeds` seeds, the first ones,
    capped at `--sweep-wall-s`) at each value, under the cell's judge and everything else as its main runs; the
    best by delay_parts.best_staleness. Kept in done/ (`sweep-<cell>-ms<N>-seed<s>`) like the main runs."""
    marks = wall_marks(args.sweep_wall_s)
    seeds = min(args.sweep_seeds, args.seeds)
    jobs = [(f"sweep-{cell}-ms{value}-seed{seed}",
             [*overrides, f"algo.max_staleness={value}", f"run.seed={seed}", f"env.kwargs.seed={seed}",
              f"env.seed={seed}", f"run.max_env_steps={args.budget}", f"run.max_wall_s={args.sweep_wall_s}"],
             {**meta, "max_staleness": value, "seed": seed})
            for seed in range(seeds) for value in values]
    console.print(f"[bold]delay[/] {cell}: outcome-only+step's max_staleness swept over {values}, {seeds} seed(s) "
                  f"x {args.sweep_wall_s:g} s")
    runs = dict(run_all(args, jobs, lambda job: run_job(args, out_dir, done_dir, job, marks)))
    per_value = {value: staleness_summary([m for m in runs.values() if m["max_staleness"] == value])
                 for value in values}
    chosen = best_staleness(per_value)
    console.print(f"  max_staleness {chosen} for outcome-only+step: {per_value}")
    return {"swept": values, "chosen": chosen, "seeds": seeds, "max_wall_s": args.sweep_wall_s,
            "per_value": {str(v): per_value[v] for v in values}, "runs": runs}
