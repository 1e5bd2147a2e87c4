"""Print (and plot) the learning curve of one finished run from its metrics.jsonl.

    python benchmarks/run_curve.py runs/local [--png docs/img/local_run.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument("--rows", type=int, default=8)
    args = parser.parse_args()
    lines = [json.loads(line) for line in (args.run_dir / "metrics.jsonl").read_text().splitlines()]
    config = yaml.safe_load((args.run_dir / "config.yaml").read_text())
    short, long = config["replay"]["success_window"], config["replay"]["long_success_window"]
    picks = sorted({round(i * (len(lines) - 1) / (args.rows - 1)) for i in range(args.rows)})
    print(f"| wall s | version | env steps | success (last {short}) | success (last {long}) | stage reward "
          "| items imm / corr |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for m in (lines[i] for i in picks):
        print(f"| {m['wall_s']:.0f} | {m['version']} | {m['env_steps']} | {m['success_rate']:.2f} | "
              f"{m['success_rate_long']:.2f} | "
              f"{m['stage_reward_mean']:.2f} | {m['items_immediate']} / {m['items_correction']} |")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.2))
        wall = [m["wall_s"] for m in lines]
        ax.plot(wall, [m["success_rate"] for m in lines], label=f"success (last {short})", lw=0.8)
        ax.plot(wall, [m["success_rate_long"] for m in lines], label=f"success (last {long})")
        ax.plot(wall, [m["stage_reward_mean"] for m in lines], label="stage reward", alpha=0.7)
        ax.set_xlabel("wall time (s)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        ax.set_title(f"async-rl train: {args.run_dir}")
        fig.tight_layout()
        args.png.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
