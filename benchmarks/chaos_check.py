"""The checker of benchmarks/chaos.py: reads a soaked run's records and verifies its history.

What it reads: the learner's metrics.jsonl (with `learner.log_item_ids`: the item ids each version trained) and
summary.json, and the replay's whole write-ahead log as the harness archived it (every snapshot and segment file
copied each time the replay was down, and at the end: `replay.compact_every` is set high enough that only a
start compacts, and a start deletes only files the archive already holds). The archive is replayed from its first
snapshot through every segment into a fresh ReplayService (replay/wal.py's own recovery), with every closed
group's ledger residual recorded on the way; its final state must equal what the run's own log rebuilds.

What it verifies (`check`, which returns the numbers and the list of violations):
- the run reached its target: the surviving lineage (tests/test_faults.py `surviving_lineage`) is versions
  1..target without a gap, and summary.json says max_versions at the target;
- no item was trained twice in the surviving lineage, and none of them is still queued at the end (every
  acknowledged record's items are trained exactly once, or still pending);
- no acknowledged record was lost: the replay's cumulative counters of acknowledged input (env_steps,
  trajectories_finished, groups_started) never go back across the metrics lines, and the rebuilt final state holds
  at least what the last line reported;
- every group closed in the whole history has a ledger residual < 1e-6 (and every metrics line's too);
- no process of the run is left (tests/test_faults.py `processes_of`).
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from test_faults import metrics, processes_of, surviving_lineage  # noqa: E402

from async_rl.config import Config  # noqa: E402
from async_rl.config_load import load_run_config  # noqa: E402
from replay import group as replay_group  # noqa: E402
from replay.log_format import SEGMENT, SNAPSHOT  # noqa: E402
from replay.server import apply_entry  # noqa: E402
from replay.service import ReplayService  # noqa: E402
from replay.wal import ReplayLog, comparable  # noqa: E402

ACKED = ("env_steps", "trajectories_finished", "groups_started")
RESIDUAL_BOUND = 1e-6


def archive_log(replay_dir: Path, archive: Path) -> int:
    """Copy the replay's snapshot and segment files into `archive` (a newer copy of a file replaces the older one:
    called while the replay is down, each is then whole); returns how many files were copied."""
    archive.mkdir(parents=True, exist_ok=True)
    copied = 0
    for path in sorted(replay_dir.iterdir()) if replay_dir.is_dir() else []:
        if SEGMENT.fullmatch(path.name) or SNAPSHOT.fullmatch(path.name):
            shutil.copyfile(path, archive / path.name)
            copied += 1
    return copied


def rebuild(directory: Path, config: Config) -> ReplayService:
    """The replay a log directory rebuilds (replay/wal.py's recovery, on a copy: recovery cuts a torn tail off)."""
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "log"
        shutil.copytree(directory, copy, ignore=shutil.ignore_patterns("lock"))
        service = ReplayService(config)
        log = ReplayLog(copy, fsync=False)
        try:
            log.recover(service, apply_entry)
        finally:
            log.close()
    return service


def replay_history(run_dir: Path, archive: Path, final: Path) -> tuple[ReplayService, list[float], bool]:
    """The archive replayed from its first snapshot: (the service at the end, every closed group's residual, whether
    its final state equals the one the run's own log, `final`, rebuilds)."""
    config = load_run_config(run_dir)
    snapshots = sorted(p for p in archive.iterdir() if SNAPSHOT.fullmatch(p.name))
    if not snapshots:
        raise AssertionError(f"{archive}: no snapshot archived")
    residuals: list[float] = []
    original = replay_group.Group.residual

    def recorded(self: replay_group.Group) -> float:
        value = original(self)
        residuals.append(value)
        return value

    with tempfile.TemporaryDirectory() as scratch:
        history = Path(scratch)  # the first snapshot and every segment
        for path in [snapshots[0], *(p for p in archive.iterdir() if SEGMENT.fullmatch(p.name))]:
            shutil.copyfile(path, history / path.name)
        replay_group.Group.residual = recorded
        logging.disable(logging.CRITICAL)  # the rebuilds repeat the run's log lines
        try:
            service = rebuild(history, config)
            replay_group.Group.residual = original
            same = comparable(service) == comparable(rebuild(final, config))
        finally:
            replay_group.Group.residual = original
            logging.disable(logging.NOTSET)
    return service, residuals, same


def check(run_dir: Path, archive: Path, final: Path, target: int) -> tuple[dict, list[str]]:
    """The invariants of the module's docstring for the run in `run_dir` (its replay's log archived in `archive`,
its last state in `final`) and its budget `target`: (the numbers, the violations found; none when it passed)."""
    problems: list[str] = []
    lines = metrics(run_dir)
    surviving, died = surviving_lineage(lines)
    versions = [line["version"] for line in surviving]
    if versions != list(range(1, target + 1)):
        gaps = sorted(set(range(1, target + 1)) - set(versions))
        problems.append(f"the surviving lineage is not versions 1..{target}: missing {gaps[:20]}, last {versions[-1:]}")
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    if summary.get("stop_reason") != "max_versions" or summary.get("versions") != target:
        problems.append(f"summary.json: {summary.get('stop_reason')} at {summary.get('versions')}, not the target")
    trained = [item for line in surviving for item in line["item_ids"]]
    twice = len(trained) - len(set(trained))
    if twice:
        problems.append(f"{twice} item(s) trained twice in the surviving lineage")
    lost = 0
    for key in ACKED:
        counts = [line[key] for line in lines]
        lost += sum(max(0, a - b) for a, b in zip(counts, counts[1:], strict=False))
    service, residuals, same = replay_history(run_dir, archive, final)
    stats = service.stats_snapshot()
    for key in ACKED:
        lost += max(0, max((line[key] for line in lines), default=0) - getattr(stats, key))
    if lost:
        problems.append(f"{lost} acknowledged record(s) lost (an acked counter went back)")
    if not same:
        problems.append("the archived log's final state differs from the run's own log: the archive is incomplete")
    pending = {queued.item_id for queued in service.queue}
    pending |= {queued.item_id for batch in service.in_flight.values() for queued in batch.items}
    both = pending & set(trained)
    if both:
        problems.append(f"{len(both)} item(s) both trained and still pending")
    worst = max([*residuals, *(line["ledger_residual_max"] for line in lines)], default=0.0)
    if not worst < RESIDUAL_BOUND:  # NaN-aware
        problems.append(f"ledger residual {worst} >= {RESIDUAL_BOUND}")
    stray = processes_of(run_dir)
    if stray:
        problems.append(f"processes of the run still running: {[p.pid for p in stray]}")
    numbers = {
        "versions": versions[-1] if versions else 0, "target": target, "versions_died": len(died),
        "records_acked": stats.env_steps, "trajectories_finished": stats.trajectories_finished,
        "groups_started": stats.groups_started, "groups_closed_checked": len(residuals),
        "items_trained": len(trained), "items_pending": len(pending), "items_trained_twice": twice,
        "records_lost": lost, "worst_residual": worst, "rollbacks": stats.rollbacks,
        "items_rolled_back": stats.items_rolled_back, "trajectories_abandoned": stats.trajectories_abandoned,
        "late_records": stats.late_records, "late_batch_acks": stats.late_batch_acks,
        "groups_given_up": stats.groups_given_up, "workers_restarted": stats.workers_restarted,
        "credit_dropped": stats.credit_dropped, "immediate_skipped_stale": stats.immediate_skipped_stale,
    }
    return numbers, problems

