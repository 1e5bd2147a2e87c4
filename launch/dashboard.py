"""The live display of `async-rl train`: the learner's metrics.jsonl followed as it grows, shown as progress toward
the nearest budget, throughput, success, staleness and each process's state; where stderr is no terminal, also a
plain log line every 15 s."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from rich.columns import Columns
from rich.console import Console
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table

from async_rl.config import Config
from launch.supervise import Child

log = logging.getLogger("launch.dashboard")

PLAIN_EVERY_S = 15.0


class MetricsTail:
    """Follows <run_dir>/metrics.jsonl, the learner's one-line-per-step record, while the learner appends to it.

    Only whole lines are read: the bytes after the last newline are a line being written and wait for the next
    poll. (Iterating the file as text read such a tail as one line and, once the writer had added the rest, the
    rest as another: `json.loads` of half a line killed `async-rl train` mid-run, seen on 2026-11-26.) A line that
    is still not JSON is skipped: the display never stops a run."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.last = path, 0, {}

    def poll(self) -> dict:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self.last
        whole = data[: data.rfind(b"\n") + 1]
        self.offset += len(whole)
        for line in whole.splitlines():
            try:
                parsed = json.loads(line)
            except ValueError:
                log.warning("metrics.jsonl: skipped a line that is not JSON: %r", line[:80])
                continue
            if isinstance(parsed, dict):
                self.last = parsed
        return self.last


def _budget_progress(config: Config, metrics: dict, elapsed: float) -> tuple[float, str]:
    """How far the run is to its nearest budget (the largest fraction of any set budget) and which one."""
    run = config.run
    fractions = []
    if run.max_versions:
        fractions.append((metrics.get("version", 0) / run.max_versions, f"{run.max_versions} versions"))
    if run.max_env_steps:
        fractions.append((metrics.get("env_steps", 0) / run.max_env_steps, f"{run.max_env_steps} env steps"))
    if run.max_wall_s:
        fractions.append((elapsed / run.max_wall_s, f"{run.max_wall_s:.0f} s"))
    if not fractions:
        return 0.0, "no budget"
    fraction, name = max(fractions)
    return min(fraction, 1.0), name


def _progress(config: Config, metrics: dict, elapsed: float) -> tuple[float, str]:
    """The progress bar's fraction and text: toward what will stop the run. With run.target_success, the long-window
    success rate against the target (the stop rule; no ETA, learning is not linear), then the nearest cap;
    without, the nearest cap with the ETA its pace gives."""
    fraction, budget = _budget_progress(config, metrics, elapsed)
    learning_s = metrics.get("wall_s", 0.0)  # since the launcher started, at the learner's last step
    eta = f"{learning_s * (1 - fraction) / fraction:.0f} s" if 0 < fraction < 1 else "-"
    cap = f"{100 * fraction:.0f}% of {budget}, ETA {eta}"
    target = config.run.target_success
    if target is None:
        return fraction, cap
    success = metrics.get("success_rate_long", 0.0)
    return min(success / target, 1.0) if target > 0 else 1.0, f"success {success:.3f} of target {target}; cap: {cap}"


def _state(child: Child) -> str:
    code = child.process.poll()
    if code is None:
        return f"[green]{child.name}[/]"
    return f"[dim]{child.name} done[/]" if code == 0 else f"[red]{child.name} exited {code}[/]"


def _table(metrics: dict, elapsed: float, children: list[Child], config: Config) -> Table:
    table = Table(title="async-rl train", show_header=False, expand=False)
    table.add_column(style="bold cyan")
    table.add_column()
    fraction, progress = _progress(config, metrics, elapsed)
    learning_s = metrics.get("wall_s", 0.0)  # since the launcher started, at the learner's last step
    target = config.run.target_success
    rows = [
        ("progress", Columns([ProgressBar(total=1.0, completed=fraction, width=30), progress])),
        ("elapsed", f"{elapsed:.0f} s"),
        ("policy version", metrics.get("version", 0)),
        ("env steps", metrics.get("env_steps", 0)),
        ("throughput", "{:.1f} env steps/s, {:.2f} versions/s, {:.0f} tokens/s trained".format(
            metrics.get("env_steps", 0) / learning_s if learning_s else 0.0,
            metrics.get("version", 0) / learning_s if learning_s else 0.0, metrics.get("tokens_per_s", 0.0))),
        ("success rate (long window)", "{:.3f} ({:.3f}){}".format(
            metrics.get("success_rate", 0.0), metrics.get("success_rate_long", 0.0),
            f", target {target}" if target is not None else "")),
        ("stage reward", f"{metrics.get('stage_reward_mean', 0.0):.3f}"),
        ("staleness mean / max imm / max corr", "{:.2f} / {} / {}".format(
            metrics.get("staleness_mean", 0.0), metrics.get("staleness_max_immediate", 0),
            metrics.get("staleness_max_correction", 0))),
        ("items immediate / correction", f"{metrics.get('items_immediate', 0)} / {metrics.get('items_correction', 0)}"),
        ("ledger residual", f"{metrics.get('ledger_residual_max', 0.0):.1e}"),
        ("processes", " ".join(_state(c) for c in children)),
    ]
    for key, value in rows:
        table.add_row(key, value if isinstance(value, Columns) else str(value))
    return table


class Dashboard:
    """`with Dashboard(config, console) as dashboard:` shows the table live; `update(children)` redraws it."""

    def __init__(self, config: Config, console: Console) -> None:
        self.config, self.console = config, console
        self.metrics = MetricsTail(config.run_dir / "metrics.jsonl")
        self.started, self.last_plain = time.monotonic(), 0.0
        self.live = Live(console=console, refresh_per_second=2, transient=False)

    def __enter__(self) -> Dashboard:
        self.live.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.live.__exit__(*exc_info)

    def update(self, children: list[Child]) -> None:
        elapsed = time.monotonic() - self.started
        self.live.update(_table(self.metrics.poll(), elapsed, children, self.config))
        if not self.console.is_terminal and elapsed - self.last_plain >= PLAIN_EVERY_S:
            self.last_plain = elapsed
            m = self.metrics.last
            log.info("t=%.0fs version=%s env_steps=%s success=%.3f", elapsed, m.get("version", 0),
                     m.get("env_steps", 0), m.get("success_rate", 0.0))
