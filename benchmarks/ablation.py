"""The algorithm ablation on the trap environment: which updates make the agent learn.

Variants (`algo.updates`, `algo.credit`):
  outcome-only          updates=outcome-only, credit=outcome       plain GRPO: the outcome reward, once per trajectory
  outcome-only+step     updates=outcome-only, credit=outcome+step  the final credit with step returns, no immediate
  immediate-only        updates=immediate-only                     stage rewards at once, never corrected (traps)
  immediate+correction  updates=immediate+correction (default)     this project
  imm+corr-no-entropy   the same with algo.entropy_coef=0          what the entropy bonus buys (docs/algorithm.md)

Every variant runs the default config (configs/local.yaml) with the same seeds (`run.seed` and `env.seed` together)
and the same budget of environment steps (`run.max_env_steps`; `run.target_success=null` so every run spends all
of it). Reported per variant:
  steps to 80%   env steps at the first learner step whose success rate over the last 256 finished trajectories
                 (`replay.success_window=256`, see common.TASK_SET_WINDOW) is >= 0.8; the median
                 over seeds, where a seed that never gets there counts as infinitely many steps, so the median is
                 "not reached" once half or more of the seeds miss;
  final success  the success rate of the last learner step, mean (min-max) over seeds;
  steps_ratio    steps(immediate+correction) / steps(outcome-only); null if either is not reached. When only
                 outcome-only misses, `steps_ratio_upper_bound` = steps(immediate+correction) / budget.
The plot (success rate vs env steps, mean and min-max band over seeds on a common grid) goes to docs/img/ablation.png
(the --quick run's to benchmarks/out/ablation-quick/). The last stdout line is the JSON of the headline figures.

    python benchmarks/ablation.py            # 5 variants x 3 seeds x 250k env steps, ~30 min on 2 cores
    python benchmarks/ablation.py --quick    # 3 variants x 1 seed x 3k env steps: it runs end to end (~1 min)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402 - benchmarks/ is not a package; scripts run as `python benchmarks/NAME.py`
    DOCS_IMG,
    OUT_DIR,
    TASK_SET_WINDOW,
    RunResult,
    chosen,
    console,
    emit,
    first_at_target,
    fmt,
    machine,
    markdown_table,
    median_or_none,
    print_table,
    ratio,
    steps_to_target,
    train,
)

TARGET = 0.8
WINDOW = TASK_SET_WINDOW
VARIANTS = {
    "outcome-only": ["algo.updates=outcome-only", "algo.credit=outcome"],
    "outcome-only+step": ["algo.updates=outcome-only", "algo.credit=outcome+step"],
    "immediate-only": ["algo.updates=immediate-only"],
    "immediate+correction": ["algo.updates=immediate+correction"],
    "imm+corr-no-entropy": ["algo.updates=immediate+correction", "algo.entropy_coef=0"],
}
DEFAULT_VARIANTS = list(VARIANTS)
# --quick's: the ones tests/test_benchmarks.py checks. A quick run's cost is mostly its processes' start-up (~25 CPU-s
# here; 1k env steps instead of 3k saved 10% and left a run 1 version), so each variant left out saves a fifth.
QUICK_VARIANTS = ["outcome-only", "immediate-only", "immediate+correction"]
DESCRIPTION = {
    "outcome-only": "GRPO (credit=outcome)",
    "outcome-only+step": "no immediate, credit=outcome+step",
    "immediate-only": "no corrections",
    "immediate+correction": "this project",
    "imm+corr-no-entropy": "this project without the entropy bonus",
}


def summarize(runs: dict[str, list[RunResult]], budget: int) -> dict:
    hits = {v: [first_at_target(r.lines, TARGET, WINDOW) for r in rs] for v, rs in runs.items()}
    steps = {v: [hit and hit["env_steps"] for hit in h] for v, h in hits.items()}
    wall = {v: [hit and round(hit["wall_s"], 1) for hit in h] for v, h in hits.items()}
    finals = {v: [r.lines[-1]["success_rate"] if r.lines else 0.0 for r in rs] for v, rs in runs.items()}
    stage_rewards = {v: [r.lines[-1]["stage_reward_mean"] if r.lines else 0.0 for r in rs] for v, rs in runs.items()}
    median = {v: median_or_none(s) for v, s in steps.items()}
    ours, grpo = median.get("immediate+correction"), median.get("outcome-only")
    return {
        "steps_to_target": median,
        "wall_s_to_target": {v: median_or_none(w) for v, w in wall.items()},
        "wall_s_to_target_per_seed": wall,
        "final_success": {v: statistics.mean(f) for v, f in finals.items()},
        "steps_ratio": ratio(ours, grpo),
        "steps_ratio_upper_bound": ratio(ours, budget) if ours is not None and grpo is None else None,
        "target": TARGET,
        "success_window": WINDOW,
        "budget_env_steps": budget,
        "seeds": len(next(iter(runs.values()))),
        "steps_to_target_per_seed": steps,
        "final_success_per_seed": finals,
        "final_stage_reward": {v: statistics.mean(s) for v, s in stage_rewards.items()},
        "versions": {v: [r.summary["versions"] for r in rs] for v, rs in runs.items()},
        "stop_reasons": {v: [r.summary["stop_reason"] for r in rs] for v, rs in runs.items()},
    }


def table_rows(result: dict) -> list[list[str]]:
    rows = []
    for variant in result["steps_to_target_per_seed"]:
        per_seed = result["steps_to_target_per_seed"][variant]
        finals = result["final_success_per_seed"][variant]
        reached = sum(s is not None for s in per_seed)
        rows.append([
            variant,
            DESCRIPTION[variant],
            fmt(result["steps_to_target"][variant], ",.0f"),
            fmt(result["wall_s_to_target"][variant], ".0f"),
            f"{reached}/{len(per_seed)}",
            f"{result['final_success'][variant]:.3f} ({min(finals):.2f}-{max(finals):.2f})",
            f"{result['final_stage_reward'][variant]:.3f}",
        ])
    return rows


def plot(runs: dict[str, list[RunResult]], budget: int, path: Path) -> None:
    """Success rate vs env steps: per variant the mean over seeds and a min-max band, on one env-step grid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grid = np.linspace(0, budget, 200)
    fig, ax = plt.subplots(figsize=(7.5, 5), dpi=120)
    for variant, results in runs.items():
        curves = []
        for run in results:
            steps = [line["env_steps"] for line in run.lines]
            success = [line["success_rate"] for line in run.lines]
            # Before the first step nothing was learned (0); after the last the policy no longer changes (hold).
            curves.append(np.interp(grid, [0, *steps], [0.0, *success]))
        curves = np.array(curves)
        (line,) = ax.plot(grid, curves.mean(axis=0), label=f"{variant}: {DESCRIPTION[variant]}")
        ax.fill_between(grid, curves.min(axis=0), curves.max(axis=0), color=line.get_color(), alpha=0.2)
    ax.axhline(TARGET, color="grey", linestyle="--", linewidth=1)
    seeds = len(next(iter(runs.values())))
    ax.set(xlabel="environment steps", ylabel=f"success rate (last {WINDOW} trajectories)", ylim=(-0.02, 1.02),
           title=f"Trap environment: {seeds} seed(s) per variant, mean and min-max")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


MARKDOWN_COLUMNS = ["variant", "what", "env steps to 80% (median)", "wall s to 80% (median)", "seeds reaching 80%",
                    "final success, mean (min-max)", "final stage reward"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"1 seed, a 3k env-step budget and the variants {', '.join(QUICK_VARIANTS)} (~1 min)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per variant (default 3, quick 1)")
    parser.add_argument("--budget", type=int, default=None, help="env steps per run (default 250000, quick 3000)")
    parser.add_argument("--variants", default=None,
                        help=f"comma-separated, of {', '.join(VARIANTS)} (default all five; --quick: three)")
    args = parser.parse_args()
    default = QUICK_VARIANTS if args.quick else DEFAULT_VARIANTS
    variants = chosen(parser, "--variants", args.variants or ",".join(default), VARIANTS)
    seeds = args.seeds or (1 if args.quick else 3)
    budget = args.budget or (3_000 if args.quick else 250_000)
    custom = variants != default  # a subset or other variants: its own folder, not docs/img/ablation.png
    out_dir = OUT_DIR / ("ablation-quick" if args.quick else "ablation")
    if custom:
        out_dir = out_dir.with_name(out_dir.name + "-" + "-".join(variants))
    info = machine()

    runs: dict[str, list[RunResult]] = {variant: [] for variant in variants}
    for seed in range(seeds):  # seed-major: a slow stretch of the shared machine hits every variant alike
        for variant in variants:
            overrides = VARIANTS[variant]
            name = f"{variant}-seed{seed}"
            console.print(f"[bold]ablation[/] {name}: {budget:,} env steps")
            run = train(out_dir, name, [
                *overrides, f"run.seed={seed}", f"env.kwargs.seed={seed}", f"env.seed={seed}",
                f"run.max_env_steps={budget}",
                "run.target_success=null", "run.max_versions=1000000", f"replay.success_window={WINDOW}",
            ], timeout_s=900 if not args.quick else 240)
            console.print(f"  {run.summary} in {run.elapsed_s:.0f} s, "
                          f"steps to {TARGET}: {fmt(steps_to_target(run.lines, TARGET, WINDOW), ',')}")
            runs[variant].append(run)

    result = summarize(runs, budget)
    result["machine"] = info
    plot_path = (out_dir / "ablation.png") if args.quick or custom else DOCS_IMG / "ablation.png"
    plot(runs, budget, plot_path)
    result["plot"] = str(plot_path)
    command = " ".join(["python benchmarks/ablation.py", *sys.argv[1:]])
    (out_dir / "result.json").write_text(json.dumps(result, indent=2))
    (out_dir / "table.md").write_text(markdown_table(MARKDOWN_COLUMNS, table_rows(result), command))
    caption = f"{seeds} seed(s), {budget:,} env steps each"
    if {"immediate+correction", "outcome-only"} <= set(variants):
        caption += f"; steps_ratio (immediate+correction / outcome-only) = {fmt(result['steps_ratio'])}"
    columns = ["variant", "what", f"steps to {TARGET:.0%} (median)", f"wall s to {TARGET:.0%}", "reached",
               "final success (min-max)", "final stage reward"]
    print_table(f"ablation: env steps to {TARGET:.0%} success", columns, table_rows(result), caption)
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
