"""Learning while the agent is still working: immediate updates against a slow judge.

The ablation (`ablation.py`) judges outcomes instantly, so immediate updates have nothing to be early for. Here
every outcome takes `env.kwargs.outcome_delay_s` (a slow judge: hidden tests, a grader model) and every tool call
`env.kwargs.step_latency_s`. Two variants with the same final credit (`credit=outcome+step`) and the same seeds:
  immediate+correction   this project: stage credit trained as soon as a stage group completes, corrected later
  outcome-only+step      the same final credit, trained only once the group's outcomes are in
Both run until the success rate over the last `replay.long_success_window` (2,048) trajectories reaches
`run.target_success` (0.8, the default stop rule) or the env-step budget is spent. Reported per variant, the
median over seeds (a seed that misses counts as infinitely slow): wall seconds of training to the target (the
learner's `wall_s`), env steps to the target, and `time_ratio` = time(outcome-only+step) / time(immediate+correction),
both variants run one after the other per seed on the same machine. `algo.max_correction_staleness` is raised
to 256 (`--max-correction-staleness`): with the config's 16, immediate items keep the learner stepping ~10
versions a second, a 2 s judge makes every correction ~20 versions late, and the correction (the outcome's
credit) is dropped; `credit_dropped` is reported per run.

    python benchmarks/slow_judge.py            # 2 variants x 2 seeds, outcome delay 2 s; ~20 min on 2 cores
    python benchmarks/slow_judge.py --quick    # 1 seed, a 3k env-step budget, no target: it completes (~1 min)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402 - benchmarks/ is not a package; scripts run as `python benchmarks/NAME.py`
    OUT_DIR,
    RunResult,
    console,
    emit,
    first_at_target,
    fmt,
    machine,
    markdown_table,
    median_or_none,
    print_table,
    ratio,
    train,
)

VARIANTS = {
    "immediate+correction": ["algo.updates=immediate+correction"],
    "outcome-only+step": ["algo.updates=outcome-only", "algo.credit=outcome+step"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 3k env steps, no target")
    parser.add_argument("--seeds", type=int, default=None, help="seeds (default 2, quick 1)")
    parser.add_argument("--outcome-delay", type=float, default=2.0, help="env.outcome_delay_s (default 2.0)")
    parser.add_argument("--step-latency", type=float, default=0.01, help="env.step_latency_s (default 0.01)")
    parser.add_argument("--budget", type=int, default=None, help="env steps per run (default 500,000, quick 3,000)")
    parser.add_argument("--max-correction-staleness", type=int, default=256,
                        help="algo.max_correction_staleness (default 256; the config's 16 drops most corrections "
                             "when the judge is slow and immediate items keep the learner stepping)")
    args = parser.parse_args()
    seeds = args.seeds or (1 if args.quick else 2)
    budget = args.budget or (3_000 if args.quick else 500_000)
    target, window = 0.8, 2048
    out_dir = OUT_DIR / ("slow_judge-quick" if args.quick else "slow_judge")
    info = machine()
    runs: dict[str, list[RunResult]] = {v: [] for v in VARIANTS}
    hits: dict[str, list[dict | None]] = {v: [] for v in VARIANTS}  # the first line at the target, per seed
    for seed in range(seeds):
        for variant, overrides in VARIANTS.items():
            name = f"{variant}-seed{seed}"
            console.print(f"[bold]slow_judge[/] {name}: outcome delay {args.outcome_delay} s")
            run = train(out_dir, name, [
                *overrides, f"run.seed={seed}", f"env.kwargs.seed={seed}", f"env.seed={seed}",
                f"run.max_env_steps={budget}",
                "run.max_versions=1000000", f"env.kwargs.outcome_delay_s={args.outcome_delay}",
                f"env.kwargs.step_latency_s={args.step_latency}",
                f"algo.max_correction_staleness={args.max_correction_staleness}",
                *(["run.target_success=null"] if args.quick else []),
            ], timeout_s=300 if args.quick else 1500)
            hit = first_at_target(run.lines, target, window, key="success_rate_long")  # the stop rule
            reached = "not reached" if hit is None else f"{hit['wall_s']:.0f} s, {hit['env_steps']:,} env steps"
            console.print(f"  {run.summary['stop_reason']} after {run.summary['wall_s']:.0f} s; to {target}: {reached}")
            runs[variant].append(run)
            hits[variant].append(hit)

    seconds = {v: [h and round(h["wall_s"], 1) for h in hs] for v, hs in hits.items()}
    steps = {v: [h and h["env_steps"] for h in hs] for v, hs in hits.items()}
    time_median = {v: median_or_none(s) for v, s in seconds.items()}
    steps_median = {v: median_or_none(s) for v, s in steps.items()}
    result = {
        "time_to_target_s": time_median,
        "env_steps_to_target": steps_median,
        "time_ratio": ratio(time_median["outcome-only+step"], time_median["immediate+correction"]),
        "time_to_target_per_seed": seconds,
        "env_steps_to_target_per_seed": steps,
        "final_success_long": {v: [r.lines[-1]["success_rate_long"] if r.lines else 0.0 for r in rs]
                               for v, rs in runs.items()},
        "immediate_before_outcome": {v: [sum(line["immediate_before_outcome"] for line in r.lines) for r in rs]
                                     for v, rs in runs.items()},
        "credit_dropped": {v: [r.lines[-1]["credit_dropped"] if r.lines else 0 for r in rs] for v, rs in runs.items()},
        "versions": {v: [r.summary["versions"] for r in rs] for v, rs in runs.items()},
        "max_correction_staleness": args.max_correction_staleness,
        "outcome_delay_s": args.outcome_delay,
        "step_latency_s": args.step_latency,
        "budget_env_steps": budget,
        "target": None if args.quick else target,
        "seeds": seeds,
        "machine": info,
    }
    columns = ["variant", "wall s to 0.8 (median)", "env steps to 0.8 (median)", "per seed (s)"]
    rows = [[v, fmt(time_median[v], ".0f"), fmt(steps_median[v], ",.0f"),
             " / ".join(fmt(s, ".0f") for s in seconds[v])] for v in VARIANTS]
    caption = (f"{seeds} seed(s), outcome delay {args.outcome_delay} s, step latency {args.step_latency} s; "
               f"time_ratio (outcome-only+step / immediate+correction) = {fmt(result['time_ratio'], '.2f')}")
    print_table("slow judge: time to 80% success", columns, rows, caption)
    command = "python benchmarks/slow_judge.py" + (" --quick" if args.quick else "")
    (out_dir / "table.md").write_text(markdown_table(columns, rows, command))
    (out_dir / "result.json").write_text(json.dumps(result, indent=2))
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
