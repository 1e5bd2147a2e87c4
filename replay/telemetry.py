"""The replay's metrics line (`<run_dir>/metrics/replay.jsonl` and the replay's W&B run, async_rl/telemetry.py),
written by replay/server.py every `run.metrics_every_s`: queue depths, leases, admission waits, the staleness
of what waits in the queue, rejections by reason, and the service's cumulative counters."""

from __future__ import annotations

from collections import Counter
from typing import Any

from async_rl.telemetry import stats_line
from replay.service import ReplayService


def metrics_line(service: ReplayService, now: float) -> dict[str, Any]:
    stats = service.stats_snapshot(now)  # a hold still running counts (guard_held_s, guard_hold_running_s)
    queued = list(service.queue)
    kinds = Counter(q.kind for q in queued)
    staleness = [max(service.policy_version - q.oldest_version, 0) for q in queued]
    counts = Counter(staleness)
    line = stats_line(stats)
    leases = service.state.leases.leases
    line.update(
        policy_version=service.policy_version,
        queue_immediate=kinds["immediate"],
        queue_correction=kinds["correction"],
        queue_tokens=sum(q.num_tokens for q in queued),
        batches_in_flight=len(service.in_flight),
        groups_open=len(service.groups),
        leases_held=sum(len(groups) for groups in leases.values()),
        workers_holding_leases=len(leases),
        queue_staleness_mean=sum(staleness) / len(staleness) if staleness else 0.0,
        queue_staleness_max=max(staleness, default=0),
        queue_staleness_hist=[counts[s] for s in range(max(staleness, default=-1) + 1)],
        **service.admission.take(now),
    )
    return line
