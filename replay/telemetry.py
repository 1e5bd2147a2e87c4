"""The replay's metrics line (`<run_dir>/metrics/replay.jsonl` and the replay's W&B run, async_rl/telemetry.py),
written by `replay.service.run` every `run.metrics_every_s`: queue depths, leases, admission waits, the staleness
of what waits in the queue, rejections by reason, and the service's cumulative counters."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from async_rl.telemetry import stats_line

if TYPE_CHECKING:
    from replay.service import ReplayService


class AdmissionClock:
    """How long workers wait for a lease: from a worker's first refused request to its next grant."""

    def __init__(self) -> None:
        self.waiting_since: dict[str, float] = {}
        self.denied: Counter[str] = Counter()  # refusals by reason (staleness, budget), cumulative
        self.waits: list[float] = []  # completed waits since the last metrics line

    def denied_at(self, worker_id: str, reason: str, now: float) -> None:
        self.denied[reason] += 1
        self.waiting_since.setdefault(worker_id, now)

    def granted_at(self, worker_id: str, now: float) -> None:
        since = self.waiting_since.pop(worker_id, None)
        if since is not None:
            self.waits.append(now - since)

    def take(self, now: float) -> dict[str, float]:
        waits, self.waits = self.waits, []
        ongoing = [now - since for since in self.waiting_since.values()]
        return {
            "admission_waits": len(waits),
            "admission_wait_s_mean": sum(waits) / len(waits) if waits else 0.0,
            "admission_wait_s_max": max(waits + ongoing, default=0.0),
            "workers_waiting": len(ongoing),
            **{f"leases_denied_{reason}": count for reason, count in sorted(self.denied.items())},
        }


def metrics_line(service: ReplayService, now: float) -> dict[str, Any]:
    stats = service.stats_snapshot()
    queued = list(service.queue)
    kinds = Counter(q.kind for q in queued)
    staleness = [max(service.policy_version - q.oldest_version, 0) for q in queued]
    counts = Counter(staleness)
    line = stats_line(stats)
    line.update(
        policy_version=service.policy_version,
        queue_immediate=kinds["immediate"],
        queue_correction=kinds["correction"],
        queue_tokens=sum(q.num_tokens for q in queued),
        batches_in_flight=len(service.in_flight),
        groups_open=len(service.groups),
        leases_held=sum(len(groups) for groups in service.leases.values()),
        workers_holding_leases=len(service.leases),
        queue_staleness_mean=sum(staleness) / len(staleness) if staleness else 0.0,
        queue_staleness_max=max(staleness, default=0),
        queue_staleness_hist=[counts[s] for s in range(max(staleness, default=-1) + 1)],
        **service.admission.take(now),
    )
    return line
