"""Every role's metrics: a JSON-lines file per role in the run directory, mirrored to one W&B run per role.

All roles of one training run are one W&B *group* (the run directory's `wandb_group` file, written once by the
first role to start, so pods that share the volume and a resumed run agree on it); each role is a W&B run in it
with a stable id (`<group>-<role>`, resumed with `resume="allow"`), named and typed by its role: `learner`,
`replay`, `rollout-0`, ... Only when asked (`wandb.mode` offline or online; the default is disabled); `wandb sync
<run_dir>/wandb/offline-run-*` uploads an offline run.

Files: `<run_dir>/metrics/<role>.jsonl`; the learner keeps `<run_dir>/metrics.jsonl` (one line per step), which
`async-rl train`'s display and the benchmarks follow.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
from pathlib import Path
from typing import Any

import msgspec

from async_rl.config import WandbConfig
from async_rl.protocol import ReplayStats
from async_rl.ratelimit import RateLimitedLog

log = logging.getLogger("async_rl.telemetry")
DROPPED_LOG_EVERY_S = 60.0

GROUP_FILE = "wandb_group"


class MetricsSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What a role's metrics read of the run's config, built at the role's entry (a role's settings carry it)."""

    run_dir: Path  # run.dir / run.name
    name: str  # run.name (the W&B group's name starts with it)
    wandb: WandbConfig  # wandb (the section as a whole: each of its keys is an argument of W&B's init)
    run_config: dict[str, Any]  # the whole config as a dict (async_rl/config_load.py `config_to_dict`): W&B's config


def run_group(run_dir: Path, name: str) -> str:
    """The W&B group of the training run in `run_dir` named `name` (run.name): created once, atomically, by whichever
    role gets there first."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / GROUP_FILE
    candidate = f"{name}-{secrets.token_hex(4)}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return path.read_text().strip() or candidate
    with os.fdopen(fd, "w") as f:
        f.write(candidate)
    return candidate


def scalars(line: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics line (W&B charts numbers; a bool is not a metric)."""
    return {k: v for k, v in line.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


def stats_line(stats: ReplayStats) -> dict[str, Any]:
    """The replay's counters as flat metrics, for the learner's line and the replay's own: every field, the latest
    evaluation's metrics (eval_success_rate, ...), and the refused messages by reason (rejected_<reason>) with their
    total (rejected)."""
    line: dict[str, Any] = {
        name: getattr(stats, name) for name in stats.__struct_fields__
        if name not in ("protocol", "eval_metrics", "rejected")
    }
    line.update(stats.eval_metrics)
    line.update({f"rejected_{reason}": count for reason, count in sorted(stats.rejected.items())})
    line["rejected"] = sum(stats.rejected.values())
    return line


def _drop_partial_line(path: Path) -> None:
    """A role killed mid-line left half a JSON object at the end of its file: cut it, so the restarted role appends
    whole lines only."""
    if not path.exists():
        return
    with path.open("rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


class RoleMetrics:
    """`<run_dir>/metrics/<role>.jsonl` (flushed per line) and, unless `wandb.mode` is disabled, this role's W&B
    run in the training run's group. `histograms`: keys whose values are per-bucket counts (bucket i = value i),
    logged to W&B as histograms."""

    def __init__(self, settings: MetricsSettings, role: str, path: Path | None = None,
                 histograms: tuple[str, ...] = ()) -> None:
        self.role = role
        self.histograms = histograms
        path = path if path is not None else settings.run_dir / "metrics" / f"{role}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        _drop_partial_line(path)  # a restarted (or resumed) role appends to its file
        self.path = path
        self._file = open(path, "ab", buffering=0)  # noqa: SIM115 - closed in close(); one write per line
        self.dropped = 0  # lines the disk refused
        self._dropped_log = RateLimitedLog(log, DROPPED_LOG_EVERY_S)
        self._wandb = None
        wandb_config = settings.wandb
        if wandb_config.mode != "disabled":
            import wandb  # slow to import; only when used

            group = run_group(settings.run_dir, settings.name)
            # This role owns its wandb-core service. A process that started one (a notebook, a test runner, a
            # launcher that logged to W&B) leaves WANDB_SERVICE in its environment, and a child would share that
            # service: a role SIGKILLed there leaves its run stream open in it, and the restarted role's init
            # fails with "run ID ... is in use" (seen: a restarted replay died at start).
            os.environ.pop("WANDB_SERVICE", None)
            wandb.init(
                mode=wandb_config.mode,
                project=wandb_config.project,
                entity=wandb_config.entity,
                group=group,
                job_type=role.split("-")[0],
                name=role,
                id=f"{group}-{role}",
                resume="allow",
                dir=str(settings.run_dir),
                config=settings.run_config,
                tags=wandb_config.tags,
                settings=wandb.Settings(silent=True, console="off"),
            )
            self._wandb = wandb

    def write(self, line: dict[str, Any], step: int | None = None) -> None:
        """Append `line`. One the disk refuses (full) is dropped whole and logged, naming the file (at most once a
        minute): a metrics line is not worth a role."""
        data, size = (json.dumps(line) + "\n").encode(), os.fstat(self._file.fileno()).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[self._file.write(view):]
        except OSError as exc:
            self.dropped += 1
            self._file.truncate(size)  # no half line left behind (a shrink needs no space)
            self._dropped_log("dropped", logging.ERROR, "%s: a metrics line was dropped: %s (%d so far)", self.path,
                              exc, self.dropped)
        if self._wandb is None:
            return
        values: dict[str, Any] = scalars(line)
        for key in self.histograms:
            counts = line.get(key)
            if counts:
                edges = [s - 0.5 for s in range(len(counts) + 1)]
                values[key] = self._wandb.Histogram(np_histogram=(counts, edges))
        self._wandb.log(values, step=step)

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
