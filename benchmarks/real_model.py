"""The claim on a real model: SmolLM2-135M-Instruct, warmed up on demonstrations, trained by each update rule.

The model is `--model DIR` (imported first with `async-rl model import smollm2-135m-instruct DIR --dtype bf16` when
DIR has no config.json). The task and every training setting are the README's warm-start recipe,
configs/smollm2-chain.yaml (the `chain` env: 3 look-ups, 2 of them forks with a dead end, a stage reward per call
that advances), with the shipped config's rule (`algo.immediate_hold` at its default); only the judge is made slow.
Phases:

  1. warm start     `async-rl demos --n N` then `async-rl sft` (full fine-tune, or LoRA with --lora-rank; lr 1e-4
                    full, 1e-3 LoRA), as the README prints them; kept in the out dir under a name made from its
                    settings, so a rerun with --reuse skips it
  2. held out       `async-rl evaluate` of the base and of the warmed-up model on the env's eval split (all 200
                    tasks x 1 sample: success with its 95% Wilson interval, the share of episodes with a
                    well-formed tool call)
  3. training       per seed, the arms (benchmarks/real_model_seeds.py) as `async-rl train` runs AT ONCE from the
                    warmed-up model (the cores are shared alike), each stopped by `run.max_wall_s` = --minutes; the
                    judge sleeps --judge-delay-s, so outcomes arrive late. `immediate+correction` (the shipped hold)
                    and `immediate-at-once` (hold 0) at the recipe's lr; `outcome-only+step` on seed 0 at each of
                    --baseline-lrs, the best held out chosen there, then at that rate on the other seeds
  4. final eval     each run's last weights on the same held-out episodes, same sampling seed (judge delay 0: it
                    changes no verdict)

Per run: held-out success with its Wilson interval, the gain over the warm start in points, versions, D = judge
latency x learner versions per second (the outcome's delay in versions; the judge delay that would give D = 5 at
the run's pace beside it), `immediate_held_over`, tool calls, peak PSS of the run's processes, and the wall time at
which the training success (the learner's window of 64 trajectories) first reached warm start + --target-points.
Per seed: McNemar's exact paired test between the arms on the same episodes. Across seeds: per arm the median and
range of the gain over the warm start, and of the ratio of gains (immediate+correction / outcome-only+step, where
the baseline gained). A seed is saved to the out dir's done/ as soon as all its runs are evaluated: with --reuse a
later session runs only the seeds missing. Plot: out dir's real_model.png (without --quick also
docs/img/real_model.png, or real_model-lora.png).

    python benchmarks/real_model.py --quick    # LoRA 8, 4 demos x 4 epochs, 1 version a run, 1 seed, 2 episodes
    python benchmarks/real_model.py --quick --warm-model models/smollm2-chain   # from the README's warm start
    python benchmarks/real_model.py --minutes 45 --judge-delay-s 600 --seeds 3 --reuse    # the claim
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402 - benchmarks/ is not a package; scripts run as `python benchmarks/NAME.py`
    DOCS_IMG,
    OUT_DIR,
    console,
    emit,
    fmt,
    machine,
    markdown_table,
    print_table,
)
from real_model_parts import RECIPE, ensure_model, held_out, plot, warm_start  # noqa: E402
from real_model_seeds import ARMS, BASELINE, SHIPPED, SeedPlan, across_seeds, run_seed  # noqa: E402

DEFAULT_MODEL = OUT_DIR / "smollm2"
# --quick proves the script end to end, not learning: a version is one group of 2, and admission at staleness 0
# (`algo.max_staleness=0`) starts no group past the one that version trains, so the learner's step does not share
# the 2 cores with the rollout of groups that the run never trains (two arms side by side are four such processes).
QUICK_SETTINGS = ["algo.groups_per_step=1", "rollout.group_size=2", "learner.min_batch_items=2",
                  "rollout.max_inflight=2", "algo.max_staleness=0"]


def interval(measured: dict[str, Any]) -> str:
    low, high = measured["ci95"]
    return f"{measured['success']:.3f} ({low:.2f}-{high:.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="the suite's form: LoRA rank 8, 4 demonstrations, 4 SFT steps, 1 version of 1 group of "
                             "2 a run, 1 seed, 2 held-out episodes")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                        help="the base model directory (default benchmarks/out/smollm2; imported when it has no "
                             "config.json)")
    parser.add_argument("--minutes", type=float, default=None, help="run.max_wall_s of each run (default 45, quick 4)")
    parser.add_argument("--judge-delay-s", type=float, default=None,
                        help="env.kwargs.judge_delay_s while training (default 600, quick 2): set it so that D, "
                             "measured and printed per run, is >= 5")
    parser.add_argument("--seeds", type=int, default=None, help="seeds (default 3, quick 1)")
    parser.add_argument("--at-once-seeds", type=int, default=1,
                        help="run the immediate-at-once arm on the first N seeds (default 1)")
    parser.add_argument("--lora-rank", type=int, default=None,
                        help="LoRA rank of the warm start and of RL (default 0: full fine-tune; quick 8)")
    parser.add_argument("--lr", type=float, default=None,
                        help="RL learner.lr of the immediate arms (default the recipe's 1e-5 full, 1e-4 LoRA)")
    parser.add_argument("--baseline-lrs", default=None,
                        help="outcome-only+step's candidate rates, comma-separated, run on seed 0; the best held out "
                             "is used on the other seeds (default 1e-5,3e-5; LoRA 1e-4,3e-4)")
    parser.add_argument("--side-by-side", type=int, default=2,
                        help="runs at once, in the seed's order (default 2: an immediate arm beside a baseline; two "
                             "full fine-tunes of this model peaked at 8.7 and 9.1 GB RSS side by side on 24 GB)")
    parser.add_argument("--demos", type=int, default=None, help="demonstrations of the warm start (default 100, "
                                                                 "quick 4)")
    parser.add_argument("--sft-lr", type=float, default=None, help="the warm start's lr (default 1e-4 full, 1e-3 LoRA)")
    parser.add_argument("--sft-epochs", type=int, default=None,
                        help="the warm start's --epochs (default 1; quick 4: 4 steps on the 4 demonstrations)")
    parser.add_argument("--sft-max-steps", type=int, default=None,
                        help="the warm start's --max-steps (default: every epoch's data)")
    parser.add_argument("--eval-tasks", type=int, default=None, help="held-out tasks (default 200: all, quick 2)")
    parser.add_argument("--eval-samples", type=int, default=None,
                        help="samples per held-out task (default 1; the paired test needs 1)")
    parser.add_argument("--target-points", type=float, default=10.0,
                        help="the training target: the warm start's held-out success + this many points (default 10)")
    parser.add_argument("--max-versions", type=int, default=None, help="run.max_versions (default none, quick 1)")
    parser.add_argument("--out", default=None, help="the folder under benchmarks/out/, or an absolute path (default "
                                                    "real_model, real_model-lora<rank>, real_model-quick)")
    parser.add_argument("--warm-model", type=Path, default=None,
                        help="a model already warmed up on the recipe (the README's `async-rl demos` and `async-rl "
                             "sft`): skip phase 1 and start from it (the suite shares one warm start this way)")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the out dir's warm start, base and warm evals and finished seeds of the same "
                             "settings; run only what is missing")
    args = parser.parse_args()
    quick = args.quick
    minutes = args.minutes if args.minutes is not None else (4.0 if quick else 45.0)
    delay = args.judge_delay_s if args.judge_delay_s is not None else (2.0 if quick else 600.0)
    seeds = args.seeds or (1 if quick else 3)
    at_once_seeds = args.at_once_seeds
    rank = args.lora_rank if args.lora_rank is not None else (8 if quick else 0)
    lr = args.lr if args.lr is not None else (1e-4 if rank else 1e-5)
    baseline_lrs = ([float(v) for v in args.baseline_lrs.split(",")] if args.baseline_lrs
                    else [1e-4, 3e-4] if rank else [1e-5, 3e-5])
    side_by_side = args.side_by_side
    warm_settings = {"demos": args.demos or (4 if quick else 100), "lora_rank": rank,
                     "lr": args.sft_lr if args.sft_lr is not None else (1e-3 if rank else 1e-4),
                     "epochs": args.sft_epochs or (4 if quick else 1), "max_steps": args.sft_max_steps}
    eval_tasks, eval_samples = args.eval_tasks or (2 if quick else 200), args.eval_samples or 1
    max_versions = args.max_versions or (1 if quick else None)
    model = args.model.resolve()
    out_dir = OUT_DIR / (args.out or ("real_model-quick" if quick else f"real_model-lora{rank}" if rank
                                      else "real_model"))
    (out_dir / "done").mkdir(parents=True, exist_ok=True)
    if not args.reuse:
        for stale in (out_dir / "done").glob("*.json"):
            stale.unlink()
    info = machine()
    started = time.monotonic()

    ensure_model(model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    if args.warm_model is not None:
        warm_model, warm_run = args.warm_model.resolve(), {"given": str(args.warm_model.resolve())}
    else:
        warm_model, warm_run = warm_start(out_dir, model, warm_settings, args.reuse)
    eval_args = [f"run.eval_samples_per_task={eval_samples}", f"run.eval_max_tasks={eval_tasks}",
                 "env.kwargs.judge_delay_s=0"]
    console.print(f"[bold]real_model[/] held-out eval of the base and warmed-up models: {eval_tasks} tasks x "
                  f"{eval_samples} sample(s)")
    for name in ("base", "warm"):
        if (out_dir / "evals" / name).exists():
            shutil.rmtree(out_dir / "evals" / name)
    with ThreadPoolExecutor(2) as pool:
        evals = {name: pool.submit(held_out, out_dir, name, ["--config", str(RECIPE), f"model.path={path}",
                                                             f"run.dir={out_dir / 'evals'}", f"run.name={name}"],
                                   eval_args, args.reuse)
                 for name, path in (("base", model), ("warm", warm_model))}
        base, warm = evals["base"].result(), evals["warm"].result()
    console.print(f"  held out: base {interval(base)}, warm start {interval(warm)} (well-formed call in "
                  f"{fmt(warm['called_tool'], '.3f', 'n/a')} of episodes)")
    target = warm["success"] + args.target_points / 100

    training = ["--config", str(RECIPE), f"model.path={warm_model}", f"replay.vocab_size={vocab}",
                f"env.kwargs.judge_delay_s={delay}", f"run.max_wall_s={minutes * 60}",
                f"run.max_versions={max_versions or 1_000_000}", f"learner.lora.rank={rank}",
                *(QUICK_SETTINGS if quick else [])]
    timeout_s = minutes * 60 + 900  # startup, the last step, shutdown
    by_seed: dict[int, dict[str, Any]] = {}
    chosen: float | None = None
    for seed in range(seeds):  # seed 0 first: it chooses the baseline's rate the others use
        plan = SeedPlan(seed, lr, baseline_lrs, chosen, at_once=seed < at_once_seeds)
        by_seed[seed] = run_seed(out_dir, plan, training, timeout_s, eval_args, warm, target, delay, side_by_side,
                                 args.reuse)
        chosen = by_seed[0]["baseline_lr"]["chosen"]
        report_seed(seed, by_seed[seed])
    summary = across_seeds(by_seed)

    tuning = f"LoRA rank {rank}" if rank else "full fine-tune"
    plot({arm: [by_seed[s]["arms"][arm] for s in by_seed if arm in by_seed[s]["arms"]] for arm in ARMS}, warm,
         target, f"SmolLM2-135M on chain, {tuning}, judge {delay:g} s, {seeds} seed(s)", out_dir / "real_model.png")
    if not quick:
        shutil.copy(out_dir / "real_model.png", DOCS_IMG / ("real_model-lora.png" if rank else "real_model.png"))
    result = {
        "base": base,
        "warm": warm,
        "warm_start": warm_run,
        "seeds": {str(seed): runs for seed, runs in by_seed.items()},
        **summary,
        "train_target": round(target, 4),
        "recipe": str(RECIPE.relative_to(RECIPE.parents[1])),
        "judge_delay_s": delay,
        "minutes": minutes,
        "lora_rank": rank,
        "lr": lr,
        "baseline_lrs": baseline_lrs,
        "baseline_lr_chosen": chosen,
        "side_by_side": side_by_side,
        "max_versions": max_versions,
        "eval_tasks": eval_tasks,
        "eval_samples_per_task": eval_samples,
        "model": str(model),
        "vocab_size": vocab,
        "quick": quick,
        "total_s": round(time.monotonic() - started, 1),
        "machine": info,
    }
    columns = ["arm", "seed", "lr", "held-out success (95%)", "vs warm (pts)", "McNemar vs baseline", "versions",
               "D (versions)", "held over", "s to train target", "tool calls / errors", "peak PSS MiB"]
    rows = [[arm, str(seed), f"{m['lr']:g}", interval(m["held_out"]), f"{m['delta_points']:+.1f}",
             mcnemar_cell(runs["paired"].get(f"{arm} vs {BASELINE}")), str(m["versions"]),
             fmt(m["d_versions"], ".2f", "n/a"), str(m["immediate_held_over"]), fmt(m["wall_s_to_train_target"], ".0f"),
             f"{m['tool_calls']} / {m['tool_call_errors']}", f"{m['peak_pss_mib']:,.0f}"]
            for seed, runs in by_seed.items() for arm, m in runs["arms"].items()]
    for arm, m in summary["arms"].items():
        rows.append([arm, "median", "", fmt(m["held_out_success"]["median"], ".3f", "n/a"),
                     fmt(m["delta_points"]["median"], "+.1f", "n/a"), "", "", "", "",
                     fmt(m["wall_s_to_train_target_median"], ".0f"), "", ""])
    gain, times = summary["held_out_gain_ratio"], summary["train_time_to_target_ratio"]
    given = f"given: {warm_run['given']}" if "given" in warm_run else ""
    warm_words = given or f"{tuning}, {warm_settings['demos']} demos, SFT lr {warm_settings['lr']:g}"
    caption = (f"warm start ({warm_words}): held out {interval(base)} -> {interval(warm)}; RL lr {lr:g} "
               f"(baseline {chosen:g}, best held out on seed 0 of {', '.join(f'{v:g}' for v in baseline_lrs)}), "
               f"{minutes:g} min a run, {side_by_side} side by side, judge {delay:g} s; "
               f"{eval_tasks * eval_samples} held-out episodes; {SHIPPED} / {BASELINE}: held-out gain "
               f"{span(gain, '.2f')}, time to training target {target:.2f}: {span(times, '.2f')}; total "
               f"{result['total_s']:.0f} s")
    print_table("real model after a warm start: held-out success of each arm", columns, rows, caption)
    command = "python benchmarks/real_model.py " + " ".join(sys.argv[1:])
    (out_dir / "table.md").write_text(markdown_table(columns, rows, command.strip()) + f"\n{caption}\n")
    (out_dir / "result.json").write_text(json.dumps(result, indent=2))
    emit(result)
    return 0


def mcnemar_cell(test: dict[str, Any] | None) -> str:
    if test is None or test["p"] is None:
        return ""
    return f"{test['only_first']}:{test['only_second']}, p {test['p']:.3f}"


def span(values: dict[str, Any], spec: str) -> str:
    """'median (min-max)' of a spread over seeds, or n/a."""
    if values["median"] is None:
        return "n/a"
    return f"{values['median']:{spec}} ({values['min']:{spec}}-{values['max']:{spec}}, {values['seeds']} seed(s))"


def report_seed(seed: int, result: dict[str, Any]) -> None:
    """A seed's figures as soon as it is done, the paired tests and D against the judge needed for D >= 5."""
    for arm, m in result["arms"].items():
        low = m["d_versions"] is not None and m["d_versions"] < 5
        console.print(f"  seed {seed} {arm}: held out {interval(m['held_out'])} ({m['delta_points']:+.1f} pts), "
                      f"{m['versions']} versions, D {fmt(m['d_versions'], '.2f', 'n/a')}"
                      + (f" [yellow](< 5: a judge of {m['judge_delay_s_for_d5']} s would give 5)[/]" if low else ""))
    for pair, test in result["paired"].items():
        console.print(f"  seed {seed} McNemar {pair}: {mcnemar_cell(test) or 'n/a'}")
    console.print(f"  seed {seed} baseline lr: {result['baseline_lr']}")


if __name__ == "__main__":
    sys.exit(main())
