"""The long-horizon hunt: does `async-rl train env.name=hunt` reach 0.8, and does the policy need its observations?

For each seed, one `async-rl train env.name=hunt` (the default config otherwise, with `run.seed`, `env.seed` and
`env.kwargs.seed` set to the seed) runs to `run.target_success` (0.8 over the last 2,048 trajectories) or
`--max-wall` seconds. Its final weights are then evaluated twice on every house (`run.eval_samples_per_task`
samples each): as trained, and `--blind` (every tool answer replaced by `?`). Runs go `--parallel` at a time (two
runs share the two cores: each gets about one).

    python benchmarks/hunt.py                  # seeds 0 1 2, two at a time, up to 15 min each
    python benchmarks/hunt.py --quick          # one seed, 5 versions: the shape of the output, no learning
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common import OUT_DIR, RunResult, emit, machine, markdown_table, pinned_env, print_table, train  # noqa: E402


def evaluate(run: RunResult, blind: bool, samples: int) -> dict:
    args = [sys.executable, "-m", "launch.cli", "evaluate", "--config", str(run.run_dir / "config.yaml"),
            f"run.eval_samples_per_task={samples}", "run.log_level=WARNING"]
    done = subprocess.run(args + (["--blind"] if blind else []), capture_output=True, text=True, env=pinned_env(),
                          cwd=REPO, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def one_seed(seed: int, max_wall_s: float, extra: list[str], samples: int) -> dict:
    overrides = ["env.name=hunt", f"run.seed={seed}", f"env.seed={seed}", f"env.kwargs.seed={seed}",
                 f"run.max_wall_s={max_wall_s}", *extra]
    run = train(OUT_DIR / "hunt", f"seed{seed}", overrides, timeout_s=max_wall_s + 300)
    seeing, blind = evaluate(run, False, samples), evaluate(run, True, samples)
    return {
        "seed": seed,
        "reached": run.summary.get("stop_reason") == "target_success",
        "train_wall_s": run.summary.get("wall_s"),
        "end_to_end_s": run.elapsed_s,
        "env_steps": run.summary.get("env_steps"),
        "versions": run.summary.get("versions"),
        "final_success": run.summary.get("final_success_rate"),
        "eval": seeing["eval_success_rate"],
        "eval_blind": blind["eval_success_rate"],
        "eval_turns": seeing["eval_turns_mean"],
        "eval_trap_rate": seeing.get("eval_trap_rate"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-wall", type=float, default=900.0, help="seconds of training per run (default 900)")
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time (default 2)")
    parser.add_argument("--quick", action="store_true", help="one seed, 5 versions, 2 samples per house")
    args = parser.parse_args()
    seeds, extra, samples = args.seeds, [], 16
    if args.quick:
        seeds, extra, samples = [0], ["run.max_versions=5", "run.target_success=null"], 2
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        rows = list(pool.map(lambda s: one_seed(s, args.max_wall, extra, samples), seeds))
    columns = ["seed", "reached 0.8", "training wall s", "end to end s", "env steps", "versions",
               "success (last 2,048)", "eval", "eval blind", "eval turns"]
    table = [[str(r["seed"]), "yes" if r["reached"] else "no", f"{r['train_wall_s']:.0f}", f"{r['end_to_end_s']:.0f}",
              f"{r['env_steps']:,}", f"{r['versions']:,}", f"{r['final_success']:.2f}", f"{r['eval']:.2f}",
              f"{r['eval_blind']:.2f}", f"{r['eval_turns']:.1f}"] for r in rows]
    command = "python benchmarks/hunt.py" + (" --quick" if args.quick else "")
    print_table("env.name=hunt: time to 0.8, and the policy without its observations", columns, table)
    print(markdown_table(columns, table, command))
    walls = [r["train_wall_s"] for r in rows]
    emit({"machine": machine(), "parallel": args.parallel, "runs": rows,
          "reached": sum(r["reached"] for r in rows), "train_wall_s_median": statistics.median(walls),
          "train_wall_s_range": [min(walls), max(walls)]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
