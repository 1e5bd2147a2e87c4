"""Immediate credit against late outcomes: env steps and wall time to 0.8 as the judge delay grows.

The gain of immediate updates can only come from timing (the sum of credit is the same either way): it should grow
with D, the number of outcome-only learner updates' worth of data generated while a group's outcome is pending,

    D ≈ judge delay × trajectories/s ÷ trajectories per outcome-only update.

This script first measures, per trap setting, trajectories/s and trajectories per update of `outcome-only+step`
with an instant judge (the calibration: `--parallel` runs side by side, as the arms will run, since two runs on
two cores each get about half the throughput of one alone), sets each judge delay from the D asked for, and prints
the D each run got (its own trajectories/s × delay ÷ the calibrated trajectories per update), and beside it the
judge delay × the run's own learner updates/s (D exactly, for outcome-only+step, whose every update is an
outcome-only one; not comparable for the arms that also step on immediate items). With the instant-judge
calibration alone a run gets about half the D asked on the trap env (its episodes lengthen as it learns, and
throughput falls while outcomes are pending); `--fit-d K` then refits each delay K times under the judge itself
(outcome-only+step runs of `--fit-steps` env steps at the delay, the delay scaled by D asked ÷ D got).
Arms, all with `credit=outcome+step`:
  outcome-only+step      the final credit, trained once a group's outcomes are in
  immediate+correction   this project: stage credit after the hold (`algo.immediate_hold`, the config's), corrected
                         when the outcome lands
  immediate-at-once      the same with `algo.immediate_hold=0`: stage credit as soon as its stage group is complete
  immediate-only         stage credit only (the trap check: it should learn the traps and stall)
Every run: the trap env (`env.kwargs.traps`; `--env hunt`: the long-horizon hunt, its judge delayed by
`env.kwargs.judge_delay_s`), a simulated tool latency at every env step, the same in every arm and stated in the
caption and the JSON (`--step-latency-s`, default 0.01 s, what the published cells used; 0: none),
`learner.lr` from the sweep, `algo.aggregation` and
`algo.entropy_per` (and `algo.entropy_coef`) as given (default token-sum, the config's step and 0.2), the default
`algo.max_correction_staleness` (the config's `auto`, which follows the judge; `--max-correction-staleness N`
fixes it) with the correction-staleness guard on, and `algo.max_staleness` = ceil(D) + 4:
admission must let D updates' worth of groups be in flight, or it, not the rule, sets the pace (the default 4
throttles an outcome-only arm while the judge is pending). `--baseline-staleness 4,8,16,32` (the default of
`--shipped`, where the other arms keep the config's 4) gives outcome-only+step its own best admission instead: short
runs at each value first (`--sweep-seeds`, the first seeds, capped at `--sweep-wall-s`, half the cap by default,
under the cell's judge), the best = the fewest median wall s to 0.8, else the highest success at the sweep's cap;
its arm then runs at that value, printed in the caption and recorded under `baseline_staleness`. A run stops at
0.8 success over the last 2,048 trajectories (`replay.long_success_window`, the learner's stop rule), the env-step
budget or the wall cap.
`--batch-scales` sweeps the learner's batch beside the lr (`learner.batch_tokens` and `learner.min_batch_items` at
a fraction of the config's): immediate+correction steps on every stage's items and so takes several times the
optimizer steps per env step of outcome-only+step; a baseline given smaller batches takes more steps too, so that
best against best compares the rules, not their step counts.
Reported per (traps, D, arm): the best lr and batch scale (fewest median env steps to 0.8, a missed seed counting as
infinite) and its median env steps and wall seconds to 0.8; its success at fixed wall times (a quarter, half,
three quarters and all of the cap: median, min and max over seeds, a second table and `success_at_wall`), so that
a miss within the cap shows as a curve; the ratios immediate+correction ÷ outcome-only+step,
best setting vs best setting; `credit_dropped` and the seconds the guard held the learner, per run.

    python benchmarks/delay.py --quick     # traps 2, D ≈ 5, the two main arms, 1 seed, 2,000 env steps (~1 min)
    # the claim with the shipped config: only the env and its judge delay set (no lr sweep, no per-cell flags);
    # the baseline at its best max_staleness of 4,8,16,32 (2 seeds x 450 s each, before the cell's runs)
    python benchmarks/delay.py --shipped --d 0,20,50 --traps 2 --arms outcome-only+step,immediate+correction --seeds 5
    python benchmarks/delay.py --shipped --env hunt --d 0,20,50 --arms outcome-only+step,immediate+correction --seeds 5
    python benchmarks/delay.py --d 0,20,50 --traps 2,0 --lrs 2.5e-4,5e-4,1e-3 --seeds 5   # the full form
    python benchmarks/delay.py --env hunt --d 0,20,50 --lrs 2.5e-4,5e-4,1e-3 --seeds 5    # on the hunt
    # the first cells (docs/research/log.md; 5 seeds, one lr, the guard's bound above the D asked for; ~1 h each):
    python benchmarks/delay.py --d 50,0 --traps 0 --arms outcome-only+step,immediate+correction --lrs 5e-4 \
        --seeds 5 --max-correction-staleness auto --parallel 2 --max-wall-s 900 --budget 800000 \
        --calibrate-steps 20000 --out delay-traps0
    # D ≈ 50 as asked, not ~half of it: the judge delay refit twice under the judge (docs/research/log.md):
    python benchmarks/delay.py --d 50 --traps 0 --arms outcome-only+step,immediate+correction --lrs 5e-4 \
        --seeds 5 --max-correction-staleness auto --parallel 2 --max-wall-s 1200 --budget 1000000 \
        --calibrate-steps 20000 --fit-d 2 --out delay-traps0-d50
    # traps 2 at D ≈ 50: fits over 200,000 env steps, the span of the baseline's climb (60,000 gave D ~35):
    python benchmarks/delay.py --d 50 --traps 2 --arms outcome-only+step,immediate+correction --lrs 2.5e-4 \
        --seeds 5 --entropy-per credit --max-correction-staleness 256 --parallel 2 --max-wall-s 1200 \
        --budget 1000000 --calibrate-steps 20000 --fit-d 2 --fit-steps 200000 --out delay-traps2-d50-credit-long
    # on the hunt (its episodes lengthen as it learns: throughput from the calibration's second half):
    python benchmarks/delay.py --env hunt --d 20 --arms outcome-only+step,immediate+correction --lrs 5e-4 \
        --seeds 5 --max-correction-staleness auto --parallel 2 --max-wall-s 900 --budget 800000 \
        --calibrate-steps 100000 --calibrate-tail 0.5 --out delay-hunt
    # the hunt at D ≈ 50 (its fits run 200,000 env steps there by default, to reach the phase where it learns):
    python benchmarks/delay.py --env hunt --d 50 --arms outcome-only+step,immediate+correction --lrs 5e-4 \
        --seeds 5 --max-correction-staleness 256 --parallel 2 --max-wall-s 1200 --budget 1000000 \
        --calibrate-steps 100000 --calibrate-tail 0.5 --fit-d 2 --out delay-hunt-d50-long
    # the hunt's baseline with a quarter of the batch (~4x its optimizer steps), beside the config's, instant judge:
    python benchmarks/delay.py --env hunt --d 0 --arms outcome-only+step --lrs 5e-4 --batch-scales 1,0.25 \
        --seeds 5 --max-correction-staleness auto --parallel 2 --max-wall-s 900 --budget 800000 \
        --calibrate-steps 100000 --calibrate-tail 0.5 --out delay-hunt-d0-batch

Each finished run (and calibration) is saved under `benchmarks/out/<--out>/done/` as soon as it ends; `--reuse`
keeps those of an interrupted invocation with the same arguments and runs only the missing ones. With
`--parallel 2` the arms of one seed start side by side (jobs are ordered seed, lr, arm).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402 - benchmarks/ is not a package; scripts run as `python benchmarks/NAME.py`
    OUT_DIR,
    chosen,
    console,
    emit,
    machine,
    markdown_table,
    print_table,
    train,
)
from delay_parts import (  # noqa: E402
    columns,
    curve_table,
    held_too_long,
    label,
    ratio_text,
    run_key,
    sweep_text,
    tabulate,
    wall_marks,
)
from delay_runs import (  # noqa: E402 - bound_used: tests/test_benchmarks.py reads it here
    STEP_LATENCY_S,
    TARGET,
    WINDOW,
    bound_used,  # noqa: F401
    run_all,
    run_job,
    sweep_staleness,
    throughput,
)

from async_rl.config import AlgoConfig, LearnerConfig  # noqa: E402

ARMS = {
    "outcome-only+step": ["algo.updates=outcome-only", "algo.credit=outcome+step"],
    "immediate+correction": ["algo.updates=immediate+correction", "algo.credit=outcome+step"],
    "immediate-at-once": ["algo.updates=immediate+correction", "algo.credit=outcome+step", "algo.immediate_hold=0"],
    "immediate-only": ["algo.updates=immediate-only", "algo.credit=outcome+step"],
}
DEFAULT_ARMS = ("outcome-only+step", "immediate+correction", "immediate-only")
LEARNER_DEFAULTS = LearnerConfig()  # what --batch-scales scales
BATCH_TOKENS, MIN_BATCH_ITEMS = LEARNER_DEFAULTS.batch_tokens, LEARNER_DEFAULTS.min_batch_items
BASELINE_STALENESS = "4,8,16,32"  # --shipped: the admission bounds swept for outcome-only+step


def side_by_side(args: argparse.Namespace, out_dir: Path, name: str,
                 overrides: list[str]) -> tuple[float, float] | None:
    """`--parallel` outcome-only+step runs at once (seeds 0, 1, ...; the throughput that sets a judge delay must be
    measured under the same sharing of the cores as the runs it is set for): their mean (trajectories/s,
    trajectories per update) over `--calibrate-tail`, or None if one took too few learner steps to tell."""
    def one(copy: int) -> tuple[float | None, float | None]:
        run = train(out_dir, f"{name}-{copy}", [*overrides, f"run.seed={copy}"], timeout_s=args.max_wall_s + 180)
        return throughput(run, tail=args.calibrate_tail)

    with ThreadPoolExecutor(args.parallel) as pool:
        measured = list(pool.map(one, range(args.parallel)))
    if not all(per_s and per_update for per_s, per_update in measured):
        return None
    return (sum(m[0] for m in measured) / len(measured), sum(m[1] for m in measured) / len(measured))


def fit_delay(args: argparse.Namespace, out_dir: Path, done_dir: Path, traps: int | str, d: float, attempt: int,
              delay: float, per_update: float, overrides: list[str]) -> tuple[float, float]:
    """One refit of a judge delay under the judge itself: `--parallel` outcome-only+step runs at `delay`, side by
    side as the arms will run; D got = their mean trajectories/s (over `--calibrate-tail`) × delay ÷ per update.
    Returns (the delay scaled by D asked ÷ D got, D got). Saved under done/ like a calibration (`--reuse`)."""
    name = f"fit-{label(traps)}-D{d:g}-{attempt}"
    saved = done_dir / f"{name}.json"
    if saved.exists():
        kept = json.loads(saved.read_text())
        console.print(f"[bold]delay[/] {name}: reused from {saved}")
        return kept["next_delay_s"], kept["d_got"]
    console.print(f"[bold]delay[/] {name}: {args.parallel} x {args.fit_steps:,} env steps side by side, "
                  f"judge {delay} s")
    measured = side_by_side(args, out_dir, name, [*overrides, f"{delay_key(traps)}={delay}"])
    if measured is None:
        raise SystemExit(f"{name}: too few learner steps to measure D under the judge; raise --fit-steps")
    got = round(delay * measured[0] / per_update, 1)
    next_delay = round(delay * d / got, 2)
    saved.write_text(json.dumps({"delay_s": delay, "d_got": got, "next_delay_s": next_delay}))
    console.print(f"  D {got} at a {delay} s judge: next {next_delay} s")
    return next_delay, got


def staleness_arg(value: str) -> list[int]:
    if value.lower() == "none":
        return []
    values = [int(v) for v in value.split(",") if v.isdigit()]
    if not values or len(values) != len(value.split(",")) or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1 or none, got {value!r}")
    return values


def bound_arg(value: str) -> str:
    if value != "auto" and not (value.isdigit() and int(value) >= 0):
        raise argparse.ArgumentTypeError(f"expected a non-negative integer or auto, got {value!r}")
    return value


def scales_arg(value: str) -> list[float]:
    try:
        scales = [float(s) for s in value.split(",")]
    except ValueError:
        scales = []
    if not scales or not all(math.isfinite(s) and 0 < s <= 1 for s in scales):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers in (0, 1], got {value!r}")
    return scales


def batch_overrides(scale: float) -> list[str]:
    """The learner's batch at `scale` x the config's: its token budget and the items it waits for (scale 1: none)."""
    if scale == 1:
        return []
    return [f"learner.batch_tokens={max(1, round(BATCH_TOKENS * scale))}",
            f"learner.min_batch_items={max(1, round(MIN_BATCH_ITEMS * scale))}"]


def env_overrides(traps: int | str) -> list[str]:
    return ["env.name=hunt"] if traps == "hunt" else [f"env.kwargs.traps={traps}"]


def delay_key(traps: int | str) -> str:
    """The env's judge delay: the trap env's outcome_delay_s, the hunt's judge_delay_s."""
    return "env.kwargs.judge_delay_s" if traps == "hunt" else "env.kwargs.outcome_delay_s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="traps 2, D 5, 2 arms at once, 1 seed, 2k env steps (8k on the hunt)")
    parser.add_argument("--d", default="0,20,50", help="the D values asked for (default 0,20,50)")
    parser.add_argument("--traps", default="2,0", help="env.kwargs.traps settings (default 2,0)")
    parser.add_argument("--env", choices=("trap", "hunt"), default="trap",
                        help="trap: the trap env at each --traps; hunt: the long-horizon env (env.name=hunt, its "
                             "judge delayed by env.kwargs.judge_delay_s; --traps ignored)")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                        help=f"arms (default {', '.join(DEFAULT_ARMS)})")
    parser.add_argument("--lrs", default="2.5e-4,5e-4,1e-3", help="learner.lr sweep per arm")
    parser.add_argument("--batch-scales", default="1", type=scales_arg, metavar="S,...",
                        help="a sweep of the learner's batch size per arm, beside the lr: learner.batch_tokens and "
                             f"learner.min_batch_items at S x the config's ({BATCH_TOKENS}, {MIN_BATCH_ITEMS}); "
                             "0.25 takes ~4x the optimizer steps per env step (default 1: the config's)")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--budget", type=int, default=400_000, help="env steps per run")
    parser.add_argument("--max-wall-s", type=float, default=900.0, help="wall cap per run")
    parser.add_argument("--calibrate-steps", type=int, default=30_000, help="env steps of the calibration run")
    parser.add_argument("--calibrate-tail", type=float, default=1.0, metavar="F",
                        help="measure the calibration's throughput over the last F of its run (default 1: all of it; "
                             "0.5 on the hunt, whose episodes lengthen as the policy learns)")
    parser.add_argument("--fit-d", type=int, default=0, metavar="K",
                        help="refit each judge delay K times under the judge itself: --parallel outcome-only+step "
                             "runs of --fit-steps env steps at the delay, D measured over their --calibrate-tail, "
                             "the delay scaled by D asked / D got (default 0: the delay from the instant-judge "
                             "calibration alone, which gets ~half the D asked on the trap env: throughput falls as "
                             "episodes lengthen and while outcomes are pending)")
    parser.add_argument("--fit-steps", type=int, default=None,
                        help="env steps of each --fit-d run (default 60,000; 200,000 on the hunt, whose fits must "
                             "reach the phase where the baseline learns and plays longer episodes: at 60,000 they "
                             "see only its start and set half the delay needed; at traps 2 and D 50, 60,000-step "
                             "fits set a judge under which the runs measured D ~35, 200,000-step fits one that gave "
                             "~43)")
    parser.add_argument("--shipped", action="store_true",
                        help="the shipped config as a user runs it: only the environment, its judge delay, the seeds "
                             "and the budget set; no lr sweep, no learner flags, the config's max_staleness and its "
                             "auto correction bound (issue: the claim with the shipped defaults); outcome-only+step "
                             "at its best max_staleness of --baseline-staleness (default 4,8,16,32)")
    parser.add_argument("--baseline-staleness", type=staleness_arg, default=None, metavar="N,...|none",
                        help="sweep outcome-only+step's algo.max_staleness over these values (short runs: "
                             "--sweep-seeds x --sweep-wall-s, under each cell's judge) and run its arm at the best: "
                             "the fewest median wall s to 0.8, else the highest success at the sweep's cap (default "
                             f"with --shipped {BASELINE_STALENESS}: the config's 4 throttles it while the judge is "
                             "pending; else none: every arm at ceil(D) + 4); the other arms keep theirs")
    parser.add_argument("--sweep-seeds", type=int, default=2, help="seeds of each --baseline-staleness value "
                        "(the first ones; default 2, at most --seeds)")
    parser.add_argument("--sweep-wall-s", type=float, default=None,
                        help="wall cap of each --baseline-staleness run (default half of --max-wall-s)")
    parser.add_argument("--step-latency-s", type=float, default=STEP_LATENCY_S,
                        help="env.kwargs.step_latency_s of every run, both arms, the calibration and fits: a tool "
                             f"call's wait at every env step (default {STEP_LATENCY_S}, what docs/results.md's cells "
                             "used; 0: none); printed in the table's caption and the JSON")
    parser.add_argument("--aggregation", default="token-sum", help="algo.aggregation of every arm")
    parser.add_argument("--entropy-per", default="step", choices=["step", "credit"],
                        help="algo.entropy_per of every arm (default the config's, step)")
    parser.add_argument("--entropy-coef", type=float, default=None,
                        help="algo.entropy_coef of every arm (default the config's, 0.2)")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default=None,
                        help="learner.optimizer of every arm (default the config's, adamw); sgd: each step lr x the "
                             "gradient, so two steps on a stage's credit and its correction move the weights as one "
                             "step on their sum (the check of whether Adam's per-step normalisation is the gap at D 0)")
    parser.add_argument("--grad-clip", type=float, default=None,
                        help="learner.grad_clip of every arm (default the config's, 1.0; 0: off)")
    parser.add_argument("--ppo-epochs", type=int, default=None,
                        help="algo.ppo_epochs of every arm (default the config's, 1): > 1 trains each batch that many "
                             "steps (the decoupled PPO loss), so a baseline trains each token as often as "
                             "immediate+correction does (twice)")
    parser.add_argument("--omega", type=float, default=None,
                        help="algo.omega of every arm (default the config's, 1.0): the weight of stage credit in "
                             "A_final and A_imm")
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time (2 on 2 cores halves the wall)")
    parser.add_argument("--out", default=None, help="folder under benchmarks/out (default delay, delay-quick)")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the runs (and calibrations) of an earlier invocation with the same --out whose "
                             "result is on disk; run only the missing ones (a kept run made with other learner "
                             "flags, e.g. --entropy-per or --ppo-epochs, is an error)")
    parser.add_argument("--max-correction-staleness", default="auto", metavar="N|auto", type=bound_arg,
                        help="algo.max_correction_staleness of every run (default auto, the config's: twice the "
                             "judge's measured delay in versions, from 16; a fixed 16 cut D 50 to 4-10)")
    args = parser.parse_args()
    if not 0.0 < args.calibrate_tail <= 1.0:
        parser.error(f"--calibrate-tail: expected 0 < F <= 1, got {args.calibrate_tail}")
    if args.entropy_coef is not None and not (math.isfinite(args.entropy_coef) and args.entropy_coef >= 0):
        parser.error(f"--entropy-coef: expected a finite number >= 0, got {args.entropy_coef}")
    if args.grad_clip is not None and not (math.isfinite(args.grad_clip) and args.grad_clip >= 0):
        parser.error(f"--grad-clip: expected a finite number >= 0, got {args.grad_clip}")
    if args.ppo_epochs is not None and args.ppo_epochs < 1:
        parser.error(f"--ppo-epochs: expected an integer >= 1, got {args.ppo_epochs}")
    if args.omega is not None and not (math.isfinite(args.omega) and args.omega >= 0):
        parser.error(f"--omega: expected a finite number >= 0, got {args.omega}")
    if args.fit_steps is None:
        args.fit_steps = 200_000 if args.env == "hunt" else 60_000
    if args.fit_d < 0 or args.fit_steps <= 0:
        parser.error(f"--fit-d and --fit-steps: expected >= 0 and > 0, got {args.fit_d} and {args.fit_steps}")
    if not (math.isfinite(args.step_latency_s) and args.step_latency_s >= 0):
        parser.error(f"--step-latency-s: expected a finite number >= 0, got {args.step_latency_s}")
    if args.sweep_seeds < 1 or (args.sweep_wall_s is not None and not args.sweep_wall_s > 0):
        parser.error(f"--sweep-seeds and --sweep-wall-s: expected >= 1 and > 0, got {args.sweep_seeds} and "
                     f"{args.sweep_wall_s}")
    if args.quick:
        args.d, args.traps, args.arms, args.lrs, args.seeds = "5", "2", "outcome-only+step,immediate+correction", \
            "5e-4", 1
        args.budget, args.calibrate_steps, args.max_wall_s, args.parallel = 2_000, 2_000, 120.0, 2
        if args.env == "hunt":  # ~15 steps a trajectory, 16 a group: 2k steps are too few learner steps to calibrate
            args.budget = args.calibrate_steps = 8_000
        args.sweep_seeds = 1  # a --baseline-staleness sweep only where asked: one seed a value
    if args.baseline_staleness is None:
        args.baseline_staleness = staleness_arg(BASELINE_STALENESS) if args.shipped else []
    if args.sweep_wall_s is None:
        args.sweep_wall_s = args.max_wall_s / 2
    ds = [float(d) for d in args.d.split(",")]
    # a setting: the trap env's env.kwargs.traps, or "hunt"
    traps_list: list[int | str] = ["hunt"] if args.env == "hunt" else [int(t) for t in args.traps.split(",")]
    arms = chosen(parser, "--arms", args.arms, ARMS)
    if args.shipped:
        tuned = [name for name, value in (("--entropy-coef", args.entropy_coef), ("--optimizer", args.optimizer),
                                          ("--grad-clip", args.grad_clip), ("--ppo-epochs", args.ppo_epochs),
                                          ("--omega", args.omega)) if value is not None]
        if tuned or args.batch_scales != [1.0] or args.max_correction_staleness != "auto":
            parser.error(f"--shipped runs the config as shipped; drop {tuned or 'the batch scales or bound'}")
        args.lrs = str(LEARNER_DEFAULTS.lr)
    lrs = [float(lr) for lr in args.lrs.split(",")]
    settings = [(lr, scale) for lr in lrs for scale in args.batch_scales]
    out_dir = OUT_DIR / (args.out or ("delay-quick" if args.quick else "delay"))
    done_dir = out_dir / "done"  # one JSON per finished run or calibration, written as soon as it finishes
    done_dir.mkdir(parents=True, exist_ok=True)
    if not args.reuse:
        for stale in done_dir.glob("*.json"):
            stale.unlink()
    info = machine()
    learner = [] if args.shipped else [f"algo.aggregation={args.aggregation}", f"algo.entropy_per={args.entropy_per}"]
    if args.entropy_coef is not None:
        learner.append(f"algo.entropy_coef={args.entropy_coef}")
    if args.optimizer is not None:
        learner.append(f"learner.optimizer={args.optimizer}")
    if args.grad_clip is not None:
        learner.append(f"learner.grad_clip={args.grad_clip}")
    if args.ppo_epochs is not None:
        learner.append(f"algo.ppo_epochs={args.ppo_epochs}")
    if args.omega is not None:
        learner.append(f"algo.omega={args.omega}")
    common = ["run.max_versions=1000000", f"env.kwargs.step_latency_s={args.step_latency_s}", *learner]
    marks = wall_marks(args.max_wall_s)

    result: dict = {"machine": info, "target": TARGET, "window": WINDOW, "learner": learner, "calibration": {},
                    "runs": {}, "best": {}, "ratios": {}, "fits": {},
                    "fit_steps": args.fit_steps if args.fit_d else None,
                    # the simulated tool latency every run had, every arm alike (nothing hidden in one arm)
                    "step_latency_s": args.step_latency_s, "wall_marks_s": marks, "baseline_staleness": {}}
    jobs: list[tuple[str, list[str], dict]] = []
    for traps in traps_list:
        # Calibration: outcome-only+step, instant judge, the middle lr: trajectories/s and per update.
        name = f"calibrate-{label(traps)}"
        saved = done_dir / f"{name}.json"
        if saved.exists():
            per_s, per_update = (json.loads(saved.read_text())[k] for k in ("per_s", "per_update"))
            console.print(f"[bold]delay[/] {name}: reused from {saved}")
        else:
            console.print(f"[bold]delay[/] {name}: {args.parallel} x {args.calibrate_steps:,} env steps side by side, "
                          "instant judge")
            measured = side_by_side(args, out_dir, name, [
                *ARMS["outcome-only+step"], *common, *env_overrides(traps),
                f"run.max_env_steps={args.calibrate_steps}", "run.target_success=null"])
            if measured is None:
                raise SystemExit(f"{name}: too few learner steps to calibrate; raise --calibrate-steps")
            per_s, per_update = measured
            saved.write_text(json.dumps({"per_s": per_s, "per_update": per_update}))
        result["calibration"][traps] = {"trajectories_per_s": round(per_s, 1),
                                        "trajectories_per_update": round(per_update, 1)}
        console.print(f"  {per_s:.1f} trajectories/s, {per_update:.1f} per outcome-only update")
        for d in ds:
            delay = round(d * per_update / per_s, 2)
            # --shipped: the config's admission bound, else D updates' worth above it
            max_staleness = AlgoConfig().max_staleness if args.shipped else math.ceil(d) + 4
            bound = args.max_correction_staleness
            fits = []
            for attempt in range(args.fit_d if d > 0 else 0):
                delay, got = fit_delay(args, out_dir, done_dir, traps, d, attempt, delay, per_update, [
                    *ARMS["outcome-only+step"], *common, *env_overrides(traps), f"algo.max_staleness={max_staleness}",
                    f"algo.max_correction_staleness={bound}", f"run.max_env_steps={args.fit_steps}",
                    "run.target_success=null"])
                fits.append({"d_got": got, "next_delay_s": delay})
            cell = f"{label(traps)}-D{d:g}"
            if fits:
                result["fits"][cell] = fits
            staleness = dict.fromkeys(arms, max_staleness)
            if args.baseline_staleness and "outcome-only+step" in arms:
                lr, scale = settings[0]
                sweep = sweep_staleness(args, out_dir, done_dir, cell, args.baseline_staleness, [
                    *ARMS["outcome-only+step"], *common, *env_overrides(traps), f"{delay_key(traps)}={delay}",
                    f"algo.max_correction_staleness={bound}", f"learner.lr={lr}", *batch_overrides(scale)], {
                    "traps": traps, "d": d, "arm": "outcome-only+step", "lr": lr, "batch_scale": scale,
                    "delay_s": delay, "max_correction_staleness": bound, "per_update": per_update,
                    "learner": learner, "step_latency_s": args.step_latency_s})
                result["baseline_staleness"][cell] = sweep
                staleness["outcome-only+step"] = sweep["chosen"]
            # seed outermost and arm innermost: with --parallel 2 the arms of one seed and lr run side by side,
            # under the same load
            for seed in range(args.seeds):
                for lr, scale in settings:
                    for arm in arms:
                        key = run_key(traps, d, arm, lr, scale, seed)
                        overrides = [*ARMS[arm], *common, *env_overrides(traps),
                                     f"{delay_key(traps)}={delay}", f"algo.max_staleness={staleness[arm]}",
                                     f"algo.max_correction_staleness={bound}", f"learner.lr={lr}",
                                     *batch_overrides(scale),
                                     f"run.seed={seed}", f"env.kwargs.seed={seed}", f"env.seed={seed}",
                                     f"run.max_env_steps={args.budget}",
                                     f"run.max_wall_s={args.max_wall_s}"]
                        meta = {"traps": traps, "d": d, "arm": arm, "lr": lr, "batch_scale": scale, "seed": seed,
                                "delay_s": delay, "max_staleness": staleness[arm],
                                "max_correction_staleness": bound, "per_update": per_update, "learner": learner,
                                "step_latency_s": args.step_latency_s}
                        jobs.append((key, overrides, meta))

    done = run_all(args, jobs, lambda job: run_job(args, out_dir, done_dir, job, marks))
    result["runs"] = dict(done)

    rows = tabulate(result, traps_list, ds, arms, settings, marks)
    result["credit_dropped_total"] = sum(m["credit_dropped"] for m in result["runs"].values())
    result["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    header = columns()
    caption = (f"every run (both arms, calibration, fits): a {args.step_latency_s:g} s simulated tool latency at each "
               "env step; ")
    caption += "".join(sweep_text(cell, sweep) + "; " for cell, sweep in result["baseline_staleness"].items())
    caption += "ratios imm+corr ÷ outcome-only+step (env steps, wall; to 0.8, then to 0.5): " + "; ".join(
        ratio_text(cell, r) for cell, r in result["ratios"].items())
    held = held_too_long(result["runs"].values())
    if held:
        result["guard_bound_warning"] = held
        caption += ("; the guard held the learner over a quarter of the wall time in " + ", ".join(held) +
                    ": the correction bound, not the rule, set their pace (raise --max-correction-staleness)")
    print_table("delay: immediate credit vs late outcomes", header, rows, caption)
    curve_header, curve_rows = curve_table(result, marks)
    print_table("delay: success over the last 2,048 trajectories at fixed wall times (median (min–max) over seeds)",
                curve_header, curve_rows)
    command = " ".join(["python benchmarks/delay.py", *sys.argv[1:]])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "table.md").write_text(markdown_table(header, rows, command) + f"\n{caption}\n\n"
                                      + markdown_table(curve_header, curve_rows, command))
    (out_dir / "result.json").write_text(json.dumps(result, indent=2))
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
