"""Leases, admission and worker sessions: who may start a group, which worker holds which groups, and when a
silent or restarted worker's groups are given up (docs/algorithm.md, "Staleness").

A lease that needs room first yields `GiveUp(group)` for each group the service is to give up before the new one
starts (replay/decisions.py)."""

from __future__ import annotations

import logging
from collections import Counter

from async_rl.ledger import GroupLedger
from async_rl.protocol import LeaseDenied, LeaseGrant, LeaseRequest
from async_rl.staleness import admission_allowed
from replay.decisions import GiveUp, Steps
from replay.group import Group
from replay.guard import Guard
from replay.rounds import Rounds
from replay.settings import LeaseSettings
from replay.state import ID_MASK, LeaseState, ReplayState

log = logging.getLogger("async_rl.replay")

STALENESS_RETRY_S = 0.05  # admission reopens as soon as the learner steps; ask again soon
BUDGET_RETRY_S = 1.0  # the env-step budget never reopens; the worker is told to wind down


class AdmissionClock:
    """How long workers wait for a lease: from a worker's first refused request to its next grant (for the metrics
    line, replay/telemetry.py; not state)."""

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


class Leases:
    def __init__(self, settings: LeaseSettings, state: ReplayState, guard: Guard, rounds: Rounds,
                 admission: AdmissionClock) -> None:
        self.settings, self.state, self.guard, self.rounds = settings, state, guard, rounds
        self.own: LeaseState = state.leases
        self.admission = admission

    def renew(self, worker_id: str, now: float) -> None:
        if worker_id in self.own.leases:
            self.own.worker_seen[worker_id] = now

    def lease(self, request: LeaseRequest, now: float) -> Steps[LeaseGrant | LeaseDenied]:
        """Admission, not discard (docs/algorithm.md, "Staleness")."""
        reply = yield from self._lease(request, now)
        if isinstance(reply, LeaseDenied):
            self.admission.denied_at(request.worker_id, reply.reason, now)
        else:
            self.admission.granted_at(request.worker_id, now)
        return reply

    def _lease(self, request: LeaseRequest, now: float) -> Steps[LeaseGrant | LeaseDenied]:
        own, state, counters = self.own, self.state, self.state.counters
        previous = own.last_grant.get(request.worker_id)
        if previous is not None and previous.msg_id == request.msg_id and previous.group_id in state.groups:
            return previous  # a resend (the grant was lost): the group is already started
        v, budget = state.learner.policy_version, self.settings.max_env_steps
        if budget is not None and counters.env_steps >= budget:
            counters.leases_denied += 1
            return LeaseDenied(msg_id=request.msg_id, reason="budget", retry_after_s=BUDGET_RETRY_S, policy_version=v)
        if not self._admitted(request.worker_id, now):
            counters.leases_denied += 1
            return LeaseDenied(
                msg_id=request.msg_id, reason="staleness", retry_after_s=STALENESS_RETRY_S, policy_version=v
            )
        yield from self._make_room()
        group_id = f"e{state.epoch}.g{next(state.group_ids) & ID_MASK}"
        counters.groups_started += 1
        group_size = self.settings.group_size
        state.groups[group_id] = Group(group_id, request.worker_id, GroupLedger(group_size),
                                       leased_version=self.new_group_version(request.worker_id), touched=now)
        if self.settings.mode == "sync":
            self.rounds.add(group_id)
        own.leases.setdefault(request.worker_id, set()).add(group_id)
        own.worker_seen[request.worker_id] = now
        grant = LeaseGrant(msg_id=request.msg_id, group_id=group_id, group_size=group_size, policy_version=v)
        own.last_grant[request.worker_id] = grant
        return grant

    def _admitted(self, worker_id: str, now: float) -> bool:
        """May one more group start? A group that ended with nothing trained never takes learner capacity, so it does
        not count: with it counted, a stretch of zero-variance groups (a random policy's usual output), or of
        immediate-only groups whose items all went stale, stalled admission for good while the learner waited."""
        settings, counters = self.settings, self.state.counters
        if settings.mode == "sync":
            return self.rounds.open()
        admitted = counters.groups_started - counters.groups_empty
        # rolled-back versions count as steps taken (LeaseState.admission_offset)
        if not admission_allowed(admitted + 1, self.state.learner.policy_version + self.own.admission_offset,
                                 settings.max_staleness, settings.groups_per_step):
            return False
        if not self.guard.admits(self.new_group_version(worker_id)):
            counters.guard_leases_denied += 1
            if not self.state.serving.queue and not self.guard.holding() and self.guard.overdue():
                self.guard.hold(now)  # a stall (nothing queued, no group admitted): the abandon clock must run
            return False
        return True

    def _make_room(self) -> Steps[None]:
        """replay.max_open_groups: while that many groups wait for their workers' outcomes, the one idle longest (no
        record or outcome stored since: `Group.touched`; the earliest lease among equals) is given up. A worker that
        heartbeats but never finishes would otherwise hold its groups, and their tokens, for good; groups that make
        progress are touched all the time. `state.groups` is in lease order, also when rebuilt from the log."""
        held = self.own.leases
        while sum(len(groups) for groups in held.values()) >= self.settings.max_open_groups:
            waiting = (group for group in self.state.groups.values() if group.group_id in held.get(group.worker_id, ()))
            yield GiveUp(min(waiting, key=lambda group: group.touched))

    def new_group_version(self, worker_id: str) -> int:
        """The oldest version a new group's tokens can have: the learner's, or the worker's weights if older."""
        policy_version = self.state.learner.policy_version
        return min(policy_version, self.own.worker_versions.get(worker_id, policy_version))

    def generates_with(self, worker_id: str, version: int) -> None:
        """The newest token version of the worker's latest record: the weights it generates with."""
        self.own.worker_versions[worker_id] = version

    def end(self, group: Group) -> None:
        """The group waits for no more outcomes from its worker."""
        own = self.own
        held = own.leases.get(group.worker_id)
        if held is None:
            return
        held.discard(group.group_id)
        if not held:
            del own.leases[group.worker_id]
            own.worker_seen.pop(group.worker_id, None)

    def held(self, worker_id: str) -> list[str]:
        """The worker's groups still waiting for outcomes, sorted, not in set order: a str's hash differs between
        processes, and a replay rebuilt from its log must make the same items in the same order."""
        return sorted(self.own.leases.get(worker_id, ()))

    def expired(self, now: float) -> list[str]:
        """The workers silent for replay.lease_timeout_s: their unfinished trajectories are to be abandoned."""
        timeout_s = self.settings.lease_timeout_s
        silent = [worker_id for worker_id in self.own.leases if now - self.own.worker_seen[worker_id] >= timeout_s]
        for worker_id in silent:
            log.warning("worker %s silent for %.1f s: abandoning its unfinished trajectories", worker_id, timeout_s)
        return silent

    def restarted(self, worker_id: str, session: int) -> bool:
        """A worker id seen under a newer session is a restarted worker: True when the old process's leases are to
        be abandoned now (it will never send their outcomes), not after replay.lease_timeout_s of heartbeats."""
        known = self.own.worker_sessions.get(worker_id)
        if session == 0 or (known is not None and session <= known):
            return False  # not told, the same process, or a late message of an older one
        self.own.worker_sessions[worker_id] = session
        if known is None:
            return False
        self.state.counters.workers_restarted += 1
        log.warning("worker %s restarted: abandoning what its previous process held", worker_id)
        return True
