"""The replay core against roles that freeze or never finish (issue 39, Build 2), through `handle`/`tick` with an
explicit clock: a worker frozen past its lease, a learner frozen past replay.batch_ack_timeout_s, a worker that
heartbeats but never sends an outcome (replay.max_open_groups, the correction guard's abandon clock).
tests/test_frozen_roles.py does the same with real processes."""

from __future__ import annotations

from test_replay import (
    LEARNER,
    WORKER,
    Worker,
    ack_batch,
    lease,
    make_config,
    only_reply,
    request_batch,
    send_all,
    session_request,
)

from async_rl.protocol import Ack, Batch, Error, Heartbeat, LeaseGrant, LeaseRequest
from replay.server import build_service
from replay.service import ReplayService

WIDE = {"batch_tokens": 10**6}  # one batch holds every pending correction: the guard's sizes play no part here


def test_a_frozen_worker_s_late_records_for_an_expired_lease_are_acked_and_store_nothing():
    service, worker = build_service(make_config(replay={"lease_timeout_s": 10.0})), Worker()
    grant = lease(service, worker, now=0.0)
    send_all(service, [worker.stage(grant, i, 0, 0.5, terminal=i < 2) for i in range(4)], now=1.0)
    send_all(service, [worker.outcome(grant, 0, 1, 1.0), worker.outcome(grant, 1, 1, 0.0)], now=1.0)
    service.tick(12.0)  # frozen (SIGSTOP) since t=1: members 2 and 3 are abandoned
    group, steps = service.groups[grant.group_id], service.counters.env_steps
    assert group.ledger.abandoned == {2, 3}
    # Thawed: the records it had under way arrive late. Acked (so it stops resending), nothing stored.
    late = only_reply(service.handle(WORKER, worker.stage(grant, 2, 1, 0.0, terminal=True), 13.0))
    assert isinstance(late, Ack) and late.duplicate
    assert list(group.trajectories[2].stages) == [0] and 1 not in group.ledger.rewards[2]
    late = only_reply(service.handle(WORKER, worker.outcome(grant, 3, 1, 1.0), 13.0))
    assert isinstance(late, Ack) and late.duplicate and 3 not in group.ledger.outcomes
    assert service.counters.late_records == 2 and service.counters.env_steps == steps
    # It recovers: its next lease request is granted, and the old group still closes exactly.
    assert isinstance(lease(service, worker, now=14.0), LeaseGrant)
    batch = request_batch(service, version=0, now=15.0)
    assert {item.trajectory_id for item in batch.items if item.kind == "correction"} == {
        f"{grant.group_id}/0", f"{grant.group_id}/1"}
    ack_batch(service, batch, version=1, now=16.0)
    stats = service.stats_snapshot()
    assert grant.group_id not in service.groups and stats.groups_closed == 1 and stats.ledger_residual_max < 1e-9


def test_a_frozen_learner_s_late_ack_takes_its_requeued_items_so_none_is_trained_twice():
    service, worker = build_service(make_config(replay={"batch_ack_timeout_s": 5.0})), Worker()
    grant = lease(service, worker)
    send_all(service, [worker.stage(grant, i, 0, float(i)) for i in range(4)])  # four immediate items
    first = request_batch(service, version=0, now=0.0)
    assert len(first.items) == 4
    service.tick(5.0)  # the learner is frozen: the batch goes back to the queue
    assert len(service.queue) == 4
    late = ack_batch(service, first, version=1, now=7.0)  # thawed: it trained the batch, and says so
    assert isinstance(late, Ack), late
    assert len(service.queue) == 0 and service.counters.late_batch_acks == 1
    send_all(service, [worker.stage(grant, i, 1, 1.0, terminal=True) for i in range(4)], now=8.0)
    send_all(service, [worker.outcome(grant, i, 2, float(i % 2)) for i in range(4)], now=8.0)
    served = [item.item_id for item in first.items]
    while (batch := request_batch(service, version=1, now=9.0)) is not None:
        served += [item.item_id for item in batch.items]
        assert isinstance(ack_batch(service, batch, version=2, now=9.0), Ack)
    assert len(served) == len(set(served)), "an item was served again after its late ack"
    stats = service.stats_snapshot()
    assert stats.groups_closed == 1 and stats.ledger_residual_max < 1e-9


def test_a_late_ack_is_refused_once_its_items_were_served_again_or_a_new_learner_started():
    service, worker = build_service(make_config(replay={"batch_ack_timeout_s": 5.0})), Worker()
    grant = lease(service, worker)
    send_all(service, [worker.stage(grant, i, 0, float(i)) for i in range(4)])
    first = session_request(service, version=0, session=1, checkpoint=0)
    service.tick(5.0)
    assert session_request(service, version=0, session=2, checkpoint=0) is not None  # a new learner process
    late = ack_batch(service, first, version=1, now=7.0)  # the old one, thawed: not this lineage's
    assert isinstance(late, Error) and "batch_not_in_flight" in late.detail
    assert service.counters.late_batch_acks == 0


def lease_for(service: ReplayService, worker: Worker, now: float) -> LeaseGrant:
    grant = only_reply(service.handle(WORKER, worker.lease(), now))
    assert isinstance(grant, LeaseGrant), grant
    return grant


def test_a_worker_that_never_finishes_holds_at_most_max_open_groups():
    """It heartbeats (its leases never expire) and asks for groups whose outcomes never come; past the cap the group
    leased longest ago is given up, so the groups waiting for outcomes (and their tokens) stay bounded."""
    config = make_config(replay={"max_open_groups": 3}, learner=WIDE)
    service, stuck, good = build_service(config), Worker("stuck"), Worker("good")
    held: list[str] = []
    for n in range(10):
        grant = lease_for(service, stuck, now=float(n))
        send_all(service, [stuck.stage(grant, 0, 0, 0.5)], now=float(n))
        service.handle(WORKER, Heartbeat(worker_id="stuck"), float(n))
        held.append(grant.group_id)
        waiting = sum(len(groups) for groups in service.state.leases.leases.values())
        assert waiting <= 3
    assert service.counters.groups_given_up == 7 and service.counters.trajectories_abandoned == 7 * 4
    assert [g for g in held if g in service.groups] == held[-3:], "the oldest leases were given up first"
    # Another worker's group is leased, finishes and trains meanwhile.
    grant = lease_for(service, good, now=11.0)
    send_all(service, [good.stage(grant, i, 0, float(i), terminal=True) for i in range(4)], now=11.0)
    send_all(service, [good.outcome(grant, i, 1, float(i % 2)) for i in range(4)], now=11.0)
    assert service.stats_snapshot().groups_given_up == 8, "at the cap the stuck worker's oldest group made room"
    batch = request_batch(service, version=0, now=12.0)
    assert {item.trajectory_id.rsplit("/")[0] for item in batch.items} == {grant.group_id}
    ack_batch(service, batch, version=1, now=12.0)
    assert grant.group_id not in service.groups and service.stats_snapshot().ledger_residual_max < 1e-9
    late = only_reply(service.handle(WORKER, stuck.stage(service_grant(held[0]), 1, 0, 0.5), 13.0))
    assert isinstance(late, Ack) and late.duplicate, "a record for a group given up (and closed) stores nothing"


def service_grant(group_id: str) -> LeaseGrant:
    return LeaseGrant(msg_id=0, group_id=group_id, group_size=4, policy_version=0)


def test_the_guard_gives_up_a_blocking_group_that_never_sent_a_record():
    """A group leased and never written to counts from its lease version (as its pending corrections do): when it
    holds the learner past replay.guard_abandon_s it is the one abandoned, not a younger group with records."""
    config = make_config(algo={"max_correction_staleness": 2}, replay={"guard_abandon_s": 60.0}, learner=WIDE)
    service, silent, busy = build_service(config), Worker("silent"), Worker("busy")
    quiet = lease_for(service, silent, now=0.0)  # v0; heartbeats, never sends anything
    assert request_batch(service, version=1, now=0.0) is None  # the learner is at v1 (a first word is trusted)
    grant = lease_for(service, busy, now=0.0)
    # The parked request gets the immediates: the learner goes to v2; the silent group is due at v2 (0 + 2).
    [batch] = send_all(service, [busy.stage(grant, i, 0, float(i), version=1) for i in range(4)], now=1.0)
    ack_batch(service, batch, version=2, now=1.0)
    send_all(service, [busy.stage(grant, i, 1, float(i), version=2) for i in range(4)], now=2.0)
    assert request_batch(service, version=2, now=2.0) is None, "v3 would pass the silent group's deadline: held"
    for t in (30.0, 62.5):
        service.handle(WORKER, Heartbeat(worker_id="silent"), t)
        service.handle(WORKER, Heartbeat(worker_id="busy"), t)
        replies = service.tick(t)
    assert quiet.group_id not in service.groups, "the silent group was abandoned (and closed: nothing finished)"
    assert not service.groups[grant.group_id].ledger.abandoned, "the busy group was not abandoned in its place"
    assert any(peer == LEARNER and isinstance(message, Batch) for peer, message in replies)


def test_with_nothing_queued_a_group_past_its_deadline_starts_the_abandon_clock():
    """The learner reached a pending group's deadline with the queue empty: admission refuses every group, so
    nothing would ever be queued to hold for. The refusal holds, and the abandon clock gives the group up."""
    config = make_config(algo={"max_correction_staleness": 2}, replay={"guard_abandon_s": 60.0}, learner=WIDE)
    service, stuck, other = build_service(config), Worker("stuck"), Worker("other")
    grant = lease_for(service, stuck, now=0.0)
    send_all(service, [stuck.stage(grant, i, 0, float(i)) for i in range(4)], now=0.0)
    batch = request_batch(service, version=0, now=0.0)
    ack_batch(service, batch, version=2, now=1.0)  # the learner is at v2: the stuck group's deadline (0 + 2)
    denied = only_reply(service.handle(WORKER, other.lease(), 2.0))
    assert not isinstance(denied, LeaseGrant), "the stuck group's corrections cannot fit: admission refuses"
    assert service.state.guard.since == 2.0, "and the refusal holds: the abandon clock runs"
    for t in (30.0, 62.5):
        service.handle(WORKER, Heartbeat(worker_id="stuck"), t)
        service.tick(t)
    assert service.counters.guard_abandoned == 4
    assert isinstance(only_reply(service.handle(WORKER, other.lease(), 63.0)), LeaseGrant), "admission reopened"


def test_a_resent_lease_request_never_gives_up_a_group():
    service = build_service(make_config(replay={"max_open_groups": 1}))
    request = LeaseRequest(worker_id="stuck", msg_id=5)
    first = only_reply(service.handle(WORKER, request, 0.0))
    again = only_reply(service.handle(WORKER, request, 1.0))
    assert again == first and service.counters.groups_given_up == 0
