"""What the benchmark scripts share: run `async-rl train` as a subprocess, read its metrics, summarize, report.

Every training run is a real `python -m launch.cli train` with `section.key=value` overrides, its own run
directory under `benchmarks/out/`, W&B disabled, fresh loopback ports and `OMP_NUM_THREADS=1` in its
environment (the launcher also pins each child through `run.threads_per_process=1`): the two cores are shared.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "benchmarks" / "out"
DOCS_IMG = REPO / "docs" / "img"
SUCCESS_WINDOW = 64  # replay.success_window's default: success_rate is over the last this-many trajectories
# The window the benchmarks use instead (`replay.success_window=256`). The default 64 trajectories are 4 groups, i.e.
# 4 of the 16 tasks: a policy that solves some tasks and is trapped on others swings across 0.8 on the luck of which
# 4 tasks came last. 256 trajectories (16 groups) cover the task set, so "80% success" means 80% over the tasks.
TASK_SET_WINDOW = 256


console = Console(stderr=True)  # progress goes to stderr; stdout holds the table and the final JSON line


class BenchmarkError(RuntimeError):
    """A training run failed or timed out: the benchmark cannot report a number for it."""


@dataclass
class RunResult:
    name: str
    run_dir: Path
    summary: dict[str, Any]  # the launcher's final stdout JSON line
    lines: list[dict[str, Any]]  # metrics.jsonl, one dict per learner step
    elapsed_s: float  # wall time of the whole subprocess, launch to exit


def pinned_env() -> dict[str, str]:
    """The environment of a timed subprocess: one BLAS/OpenMP thread per process."""
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def train(out_dir: Path, name: str, overrides: list[str], timeout_s: float) -> RunResult:
    """One `async-rl train` run in `out_dir/name` (replaced if it exists). Raises BenchmarkError on failure.

    Endpoints stay `auto` (Unix sockets in the run directory), so concurrent runs never race for a port. A run
    whose env-step budget is spent stops by itself even when nothing is left to train (the replay service then
    answers the learner with an empty batch carrying the stats).
    """
    run_dir = out_dir / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        sys.executable, "-m", "launch.cli", "train",
        "wandb.mode=disabled", "run.threads_per_process=1", "run.log_level=WARNING", "run.eval_samples_per_task=0",
        f"run.dir={out_dir}", f"run.name={name}",
        *overrides,
    ]
    log_path, stdout_path = out_dir / f"{name}.stderr.log", out_dir / f"{name}.stdout.log"
    started = time.monotonic()
    with open(log_path, "w") as stderr, open(stdout_path, "w") as stdout:
        process = subprocess.Popen(args, stdout=stdout, stderr=stderr, text=True, env=pinned_env(), cwd=REPO)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGTERM)
            process.wait()
            raise BenchmarkError(f"{name}: no result within {timeout_s:.0f} s (log: {log_path})") from None
    elapsed = time.monotonic() - started
    lines = stdout_path.read_text().strip().splitlines()
    last = lines[-1] if lines else ""
    if process.returncode != 0 or not last.startswith("{"):
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise BenchmarkError(f"{name}: exit code {process.returncode} (log: {log_path})\n{tail}")
    summary = json.loads(last)
    # the launcher's own run dir: it picks a fresh name when `run_dir` reappeared meanwhile (a stray process of an
    # earlier, killed run still writing there), and the metrics are where it wrote them
    run_dir = Path(summary.get("run_dir", run_dir))
    return RunResult(name, run_dir, summary, read_metrics(run_dir), elapsed)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def first_at_target(
    lines: list[dict[str, Any]], target: float, window: int = SUCCESS_WINDOW, key: str = "success_rate"
) -> dict[str, Any] | None:
    """The first metrics line whose success rate `key` (over the last `window` finished trajectories:
    replay.success_window for `success_rate`, replay.long_success_window for `success_rate_long`) is >= target.
    The learner's own `run.target_success` rule: a line before the window filled doesn't count.
    """
    for line in lines:
        if line["trajectories_finished"] >= window and line[key] >= target:
            return line
    return None


def chosen(parser: argparse.ArgumentParser, flag: str, value: str, known: dict[str, Any]) -> list[str]:
    """The comma-separated names of `value`, each one of `known`; otherwise the parser's error names the unknown."""
    names = value.split(",")
    unknown = [name for name in names if name not in known]
    if unknown:
        parser.error(f"{flag}: unknown {unknown}; expected some of {list(known)}")
    return names


def paired_ratio(ours: list[float], baseline: list[float]) -> float:
    """The median over rounds of ours ÷ baseline measured back to back: the load of a shared machine changes
    between rounds, much less within one pair. Of times, pass the baseline's first to get our speed ÷ theirs."""
    return statistics.median(a / b for a, b in zip(ours, baseline, strict=True))


def median_or_none(values: list[float | None]) -> float | None:
    """Median over seeds with a miss (None) counted as infinity: None once half or more of the seeds miss."""
    value = statistics.median([math.inf if v is None else v for v in values])
    return None if math.isinf(value) else value


def steps_to_target(lines: list[dict[str, Any]], target: float, window: int = SUCCESS_WINDOW) -> int | None:
    """Environment steps (stage records) when the target success rate was first reached; None if never."""
    line = first_at_target(lines, target, window)
    return line["env_steps"] if line is not None else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def fmt(value: float | int | None, spec: str = ".3f", missing: str = "not reached") -> str:
    return missing if value is None else format(value, spec)


def machine() -> dict[str, Any]:
    """Where and when the numbers were measured (for the docs)."""
    import torch

    return {
        "date": time.strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
        "gpu": torch.cuda.is_available(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
    }


def print_table(title: str, columns: list[str], rows: list[list[str]], caption: str | None = None) -> None:
    """A rich table on stdout (wide enough never to wrap), above the final JSON line."""
    table = Table(title=title, caption=caption)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    Console(width=160).print(table)


def markdown_table(columns: list[str], rows: list[list[str]], command: str) -> str:
    """The same table as Markdown, headed by the command that measured it (for docs/results.md)."""
    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    body = "".join("| " + " | ".join(row) + " |\n" for row in rows)
    return f"`{command}`\n\n{head}{body}"


def emit(payload: dict[str, Any]) -> None:
    """The last stdout line: the headline figures as one JSON object (other tools read it)."""
    print(json.dumps(payload), flush=True)
