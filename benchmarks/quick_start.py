"""The quick start's time: the README's first training command, `async-rl train`, run several times one after the
other, each timed from the command to its exit (the summary line is its last output).

Each run is the packaged default config untouched but for `run.dir` (its run directory under benchmarks/out/, so
that `runs/` is left alone). Reported: the median and range of the wall time, and per run the figures of its
summary line (`final_success_rate`, `eval_success_rate`, versions, env steps) and the seconds from the command to
the learner's first version (start-up: every role imports torch; the learner DeepSpeed too). Run it on an idle
machine: the figure is a wall time.

    python benchmarks/quick_start.py              # 3 runs (docs/results.md, "The quick start")
    python benchmarks/quick_start.py --quick      # 1 run of 3 versions (the script runs end to end)
    # the packaged config against itself with one setting changed, runs alternating (A B A B ...) so that both
    # meet the same machine; the ratio is taken pair by pair (docs/results.md, "Delay": the auto bound at D 0)
    python benchmarks/quick_start.py --runs 5 --against algo.max_correction_staleness=16
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common import OUT_DIR, emit, machine, markdown_table, print_table  # noqa: E402


def command() -> list[str]:
    """`async-rl train` as the README prints it: the console script installed beside this interpreter, else the one on
    PATH, else the module it runs."""
    script = shutil.which("async-rl", path=str(Path(sys.executable).parent)) or shutil.which("async-rl")
    return [script, "train"] if script else [sys.executable, "-m", "launch.cli", "train"]


def one_run(out: Path, n: int, overrides: list[str], timeout_s: float) -> dict:
    run_dir = out / f"run-{n}"
    shutil.rmtree(out / f"run-{n}", ignore_errors=True)
    args = [*command(), f"run.dir={out}", f"run.name=run-{n}", *overrides]
    started = time.time()
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    wall_s = time.time() - started
    if done.returncode != 0:
        raise SystemExit(f"run {n} failed (exit {done.returncode}); its log: {run_dir / 'logs'}\n{done.stderr[-2000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    first = json.loads((run_dir / "metrics.jsonl").open().readline())
    return {"wall_s": round(wall_s, 1), "first_version_s": round(first["wall_s"], 1), **{
        k: summary.get(k) for k in ("final_success_rate", "eval_success_rate", "versions", "env_steps", "stop_reason")}}


def table(title: str, results: list[dict], cmd: str) -> list[float]:
    walls = [r["wall_s"] for r in results]
    columns = ["run", "wall s", "first version s", "final success", "eval success", "versions", "env steps"]
    rows = [[str(n), f"{r['wall_s']:.1f}", f"{r['first_version_s']:.1f}", f"{r['final_success_rate']:.2f}",
             f"{r['eval_success_rate'] or 0:.2f}", str(r["versions"]), f"{r['env_steps']:,}"]
            for n, r in enumerate(results, 1)]
    print_table(f"{title}, {len(results)} run(s): median {statistics.median(walls):.1f} s "
                f"({min(walls):.1f}–{max(walls):.1f})", columns, rows)
    print(markdown_table(columns, rows, cmd))
    return walls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one run of 3 versions, no evaluation")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    parser.add_argument("--against", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for a second series (repeatable): the runs alternate as shipped / "
                             "with these, and the wall-time ratio shipped ÷ these is taken pair by pair")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs: expected >= 1, got {args.runs}")
    if bad := [o for o in args.against if "=" not in o]:
        parser.error(f"--against: expected KEY=VALUE, got {bad[0]!r}")
    quick = ["run.max_versions=3", "run.target_success=null", "run.eval_samples_per_task=0"]
    runs, overrides = (1, quick) if args.quick else (args.runs, [])
    out = OUT_DIR / "quick_start"
    results, against = [], []
    for n in range(1, runs + 1):
        results.append(one_run(out, n, overrides, args.timeout_s))
        if args.against:
            against.append(one_run(out, runs + n, [*overrides, *args.against], args.timeout_s))
    cmd = "python benchmarks/quick_start.py" + (" --quick" if args.quick else f" --runs {runs}") + "".join(
        f" --against {o}" for o in args.against)
    walls = table("async-rl train", results, cmd)
    summary = {"runs": results, "wall_s_median": statistics.median(walls), "wall_s_min": min(walls),
               "wall_s_max": max(walls), "machine": machine()}
    if args.against:
        b_walls = table("async-rl train " + " ".join(args.against), against, cmd)
        ratios = sorted(a / b for a, b in zip(walls, b_walls, strict=True))
        print(f"shipped ÷ {' '.join(args.against)}, pair by pair: median {statistics.median(ratios):.2f} "
              f"({ratios[0]:.2f}–{ratios[-1]:.2f})")
        summary |= {"against": args.against, "against_runs": against,
                    "against_wall_s_median": statistics.median(b_walls),
                    "ratio_median": round(statistics.median(ratios), 3),
                    "ratio_min": round(ratios[0], 3), "ratio_max": round(ratios[-1], 3)}
    emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
