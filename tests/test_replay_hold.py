"""The immediate hold (`algo.immediate_hold`, replay/hold.py): an immediate item waits for its group's outcome for
a step's worth of generation at the measured pace; an outcome within it leaves the credit to the correction, in
one update, and a later one finds the item trained; the ledger is exact either way and the log rebuilds it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_replay import (
    LEARNER,
    REWARDS,
    WORKER,
    Worker,
    ack_batch,
    expected_final_credit,
    lease,
    make_config,
    outcome_messages,
    request_batch,
    send_all,
    stage_credit,
    stage_records,
)
from test_replay_wal import Logged, only, rebuilt

from async_rl.protocol import Ack, LeaseGrant
from replay.server import build_service
from replay.settings import ReplaySettings
from replay.wal import comparable

# One outcome-only step is groups_per_step × group_size = 4 trajectories: the hold is 4 trajectories' finishing time.
HOLD = {"immediate_hold": 1.0, "groups_per_step": 1}


def timed_records(service, worker: Worker, grant: LeaseGrant) -> None:
    """Every stage record of the REWARDS group, the n-th at t = n: generation began at 0 and trajectories ended at
    t = 3, 5, 7 and 8, so at the last one a trajectory finishes every 2 s and the hold is 4 × 2 s."""
    for t, record in enumerate(stage_records(worker, grant)):
        send_all(service, [record], now=float(t))


def trained_credit(batches) -> dict[tuple[int, int], float]:
    trained: dict[tuple[int, int], float] = {}
    for batch in batches:
        for item in batch.items:
            member = int(item.trajectory_id.split("/")[1])
            for k, credit in stage_credit(item).items():
                trained[(member, k)] = trained.get((member, k), 0.0) + credit
    return trained


def assert_exact(trained: dict[tuple[int, int], float], config) -> None:
    for stage, a_final in expected_final_credit(config).items():
        assert math.isclose(trained.get(stage, 0.0), a_final, rel_tol=0, abs_tol=1e-9), stage


def test_an_outcome_within_the_hold_leaves_the_whole_credit_to_one_correction():
    config = make_config(algo=HOLD)
    service, worker = build_service(config), Worker()
    grant = lease(service, worker)
    timed_records(service, worker, grant)
    stats = service.stats_snapshot()
    assert stats.immediate_hold_s == pytest.approx(8.0)
    assert request_batch(service, version=0, now=8.5) is None and len(service.queue) == 0, "every item on hold"

    batches = send_all(service, outcome_messages(worker, grant), now=9.0)  # before stage group 0's hold ends (3 + 8)
    assert len(batches) == 1 and {item.kind for item in batches[0].items} == {"correction"}
    assert isinstance(ack_batch(service, batches[0], version=1, now=9.5), Ack)
    assert_exact(trained_credit(batches), config)  # C = A_final: nothing was issued
    stats = service.stats_snapshot()
    # stage 0: four rewards with spread; stages 1 and 2: two rewarded members each (an absent reward has no item)
    assert stats.immediate_held_over == 8 and stats.immediate_superseded == 0
    assert stats.groups_closed == 1 and stats.ledger_residual_max < 1e-9


def test_a_late_outcome_finds_the_items_trained_and_the_correction_makes_up_the_rest():
    config = make_config(algo=HOLD)
    service, worker = build_service(config), Worker()
    grant = lease(service, worker)
    timed_records(service, worker, grant)
    assert service.tick(10.9) == [] and len(service.queue) == 0, "stage group 0 is held until 3 + 8 s"
    service.tick(11.0)
    assert {int(q.item.trajectory_id.split("/")[1]) for q in service.queue} == set(REWARDS), "stage 0's items"
    service.tick(16.0)  # every stage group's hold is over (the last began at 8)
    immediates = request_batch(service, version=0, now=16.0)
    assert immediates is not None and len(immediates.items) == 8
    assert {item.kind for item in immediates.items} == {"immediate"}
    assert isinstance(ack_batch(service, immediates, version=1, now=16.5), Ack)

    corrections = send_all(service, outcome_messages(worker, grant), now=30.0)
    if not corrections:
        corrections = [request_batch(service, version=1, now=30.0)]
    assert {item.kind for item in corrections[0].items} == {"correction"}
    assert isinstance(ack_batch(service, corrections[0], version=2, now=30.5), Ack)
    assert_exact(trained_credit([immediates, *corrections]), config)
    stats = service.stats_snapshot()
    assert stats.immediate_held_over == 0 and stats.groups_closed == 1 and stats.ledger_residual_max < 1e-9


def test_until_a_trajectory_finishes_the_pace_is_unknown_and_items_wait_for_it():
    service, worker = build_service(make_config(algo=HOLD)), Worker()
    grant = lease(service, worker)
    send_all(service, [worker.stage(grant, i, 0, float(i)) for i in range(4)], now=0.0)  # no trajectory ended
    service.tick(60.0)
    assert service.stats_snapshot().immediate_hold_s == -1.0 and len(service.queue) == 0
    send_all(service, [worker.stage(grant, 0, 1, 0.0, terminal=True)], now=61.0)
    send_all(service, [worker.stage(grant, 1, 1, 1.0, terminal=True)], now=62.0)
    # The pace since generation began (t = 0), not the 1 s between two trajectories of one burst: 31 s each.
    assert service.stats_snapshot().immediate_hold_s == pytest.approx(4 * 31.0)
    service.tick(123.0)
    assert len(service.queue) == 0
    service.tick(124.0)
    assert len(service.queue) == 4, "stage 0, handled at t = 0, is released once its hold is over"


@pytest.mark.parametrize("algo", [{"updates": "outcome-only"}, {"updates": "immediate-only"}, {"mode": "sync"},
                                  {"immediate_hold": 0}])
def test_the_hold_is_off_where_no_correction_follows_in_lock_step_and_at_zero(algo: dict):
    settings = ReplaySettings.from_config(make_config(algo={**HOLD, **algo}))
    assert settings.hold.immediate_hold == 0.0
    assert ReplaySettings.from_config(make_config(algo=HOLD)).hold.immediate_hold == 1.0


def test_the_shipped_default_holds_for_one_step():
    from async_rl.config import Config

    assert Config().algo.immediate_hold == 1.0


def test_a_hold_rebuilds_from_the_log(tmp_path: Path):
    config = make_config(algo=HOLD)
    logged, worker = Logged(config, tmp_path / "replay"), Worker()
    grant = only(logged.handle(WORKER, worker.lease(), 0.0), WORKER)
    for t, record in enumerate(stage_records(worker, grant)):
        assert isinstance(only(logged.handle(WORKER, record, float(t)), WORKER), Ack)
    logged.tick(12.0)  # stage group 0 released (3 + 8 s), 1 (6 + 8) and 2 (8 + 8) still on hold
    original = logged.service
    assert len(original.queue) == 4 and original.state.hold.waiting == {grant.group_id}
    logged.wal.close()

    service, wal = rebuilt(config, tmp_path / "replay")
    assert comparable(service) == comparable(original)
    for s in (original, service):  # both release stage group 2 at the same tick
        s.tick(16.0)
        assert len(s.queue) == 8 and not s.state.hold.waiting
    assert comparable(service) == comparable(original)
    assert only(original.handle(LEARNER, _request(), 16.0), LEARNER) == only(service.handle(LEARNER, _request(), 16.0),
                                                                             LEARNER)
    wal.close()


def _request():
    from async_rl.protocol import BatchRequest

    return BatchRequest(learner_id="learner", msg_id=3, policy_version=0, max_tokens=10**6, min_items=1,
                        max_wait_s=0.0)
