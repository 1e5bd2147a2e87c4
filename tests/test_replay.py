"""The replay service (docs/algorithm.md): the core through `handle`/`tick` with an explicit clock, and the
ROUTER loop over real ZeroMQ sockets."""

from __future__ import annotations

import itertools
import math
import os
import random
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from async_rl.advantages import final_credit, immediate_advantages
from async_rl.config import Config
from async_rl.config_load import config_from_dict
from async_rl.protocol import (
    LOGPROB,
    PROTOCOL_VERSION,
    TOKEN,
    Ack,
    Batch,
    BatchAck,
    BatchRequest,
    Error,
    EvalReport,
    Heartbeat,
    LeaseDenied,
    LeaseGrant,
    LeaseRequest,
    Outcome,
    ReplayStats,
    StageRecord,
    TrainItem,
    encode,
    pack,
)
from async_rl.transport import connect_dealer, receive, send
from replay.server import build_service, run
from replay.service import ReplayService

LEARNER = b"learner-0"
WORKER = b"worker-0"


def make_config(**sections: dict) -> Config:
    """A small run's config. `algo.immediate_hold` 0: these tests drive the immediate items' mechanics message by
    message, at once; the hold that makes them wait for their outcome has its own (tests/test_replay_hold.py)."""
    raw: dict = {"rollout": {"group_size": 4}, "run": {"seed": 0}, "algo": {"immediate_hold": 0}}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return config_from_dict(raw)


class Worker:
    """Builds the messages a rollout worker sends; stage k of member i has a fixed, known token layout."""

    def __init__(self, worker_id: str = "worker-0") -> None:
        self.worker_id = worker_id
        self.msg_ids = itertools.count(1)

    @staticmethod
    def lengths(i: int, k: int) -> tuple[int, int]:
        """(observation tokens, action tokens) of stage k of member i: varied on purpose."""
        return 2 + (i + k) % 3, 1 + (2 * i + k) % 4

    def lease(self) -> LeaseRequest:
        return LeaseRequest(worker_id=self.worker_id, msg_id=next(self.msg_ids))

    def stage(
        self, grant: LeaseGrant, i: int, k: int, reward: float | None, terminal: bool = False, version: int = 0
    ) -> StageRecord:
        n_obs, n_act = self.lengths(i, k)
        return StageRecord(
            msg_id=next(self.msg_ids),
            worker_id=self.worker_id,
            group_id=grant.group_id,
            trajectory_id=f"{grant.group_id}/{i}",
            member=i,
            task_id="task-a",
            stage_index=k,
            observation_tokens=pack([1000 + 10 * k + j for j in range(n_obs)], TOKEN),
            action_tokens=pack([2000 + 100 * i + 10 * k + j for j in range(n_act)], TOKEN),
            behaviour_logprobs=pack([-0.5 - 0.1 * j for j in range(n_act)], LOGPROB),
            policy_versions=pack([version] * n_act, TOKEN),
            stage_reward=reward,
            terminal=terminal,
        )

    def outcome(self, grant: LeaseGrant, i: int, num_stages: int, outcome: float | None, **kw) -> Outcome:
        return Outcome(
            msg_id=next(self.msg_ids),
            worker_id=self.worker_id,
            group_id=grant.group_id,
            trajectory_id=f"{grant.group_id}/{i}",
            member=i,
            num_stages=num_stages,
            outcome=outcome,
            **{"success": outcome is not None and outcome >= 1.0, **kw},
        )


def only_reply(replies: list, identity: bytes = WORKER):
    mine = [message for peer, message in replies if peer == identity]
    assert len(mine) == 1, replies
    return mine[0]


def lease(service: ReplayService, worker: Worker, now: float = 0.0) -> LeaseGrant:
    grant = only_reply(service.handle(WORKER, worker.lease(), now))
    assert isinstance(grant, LeaseGrant), grant
    return grant


def send_all(service: ReplayService, messages: list, now: float = 0.0) -> list:
    """Send worker messages; every one must be acknowledged. Returns any batches they unblocked."""
    batches = []
    for message in messages:
        replies = service.handle(WORKER, message, now)
        assert isinstance(only_reply(replies), Ack), replies
        batches += [m for peer, m in replies if peer == LEARNER]
    return batches


def request_batch(
    service: ReplayService,
    version: int,
    now: float = 0.0,
    max_tokens: int = 10**6,
    min_items: int = 1,
    max_wait_s: float = 0.0,
) -> Batch | None:
    request = BatchRequest(
        learner_id="learner",
        msg_id=7,
        policy_version=version,
        max_tokens=max_tokens,
        min_items=min_items,
        max_wait_s=max_wait_s,
    )
    replies = service.handle(LEARNER, request, now)
    assert len(replies) <= 1
    return replies[0][1] if replies else None


def ack_batch(service: ReplayService, batch: Batch, version: int, now: float = 0.0):
    ack = BatchAck(learner_id="learner", msg_id=9, batch_id=batch.batch_id, policy_version=version)
    return only_reply(service.handle(LEARNER, ack, now), LEARNER)


def stage_layout(item: TrainItem) -> Iterator[tuple[int, slice, slice]]:
    """(k, observation, action) token slices of every stage in `item`, by the layout of Worker.lengths."""
    member, n, offset = int(item.trajectory_id.split("/")[1]), item.num_tokens(), 0
    for k in itertools.count():
        if offset >= n:
            assert offset == n
            return
        n_obs, n_act = Worker.lengths(member, k)
        yield k, slice(offset, offset + n_obs), slice(offset + n_obs, offset + n_obs + n_act)
        offset += n_obs + n_act


def stage_credit(item: TrainItem) -> dict[int, float]:
    """The advantage each stage's action tokens carry in `item` (checking the layout of Worker.lengths)."""
    mask, advantages = item.mask(), item.advantage_values()
    credit = {}
    for k, observation, action in stage_layout(item):
        assert not mask[observation].any(), "observation tokens are never trained"
        assert not advantages[observation].any()
        if mask[action].any():
            assert mask[action].all() and np.all(advantages[action] == advantages[action][0])
            credit[k] = float(advantages[action][0])
        else:
            assert not advantages[action].any()
    return credit


# A group of G = 4 with 3, 2, 3 and 1 stages; one absent stage reward.
REWARDS = {0: [1.0, 0.0, 1.0], 1: [0.0, 1.0], 2: [1.0, None, 0.5], 3: [0.5]}
OUTCOMES = {0: 1.0, 1: 0.0, 2: 1.0, 3: 0.0}


def stage_records(worker: Worker, grant: LeaseGrant, version: int = 0) -> list[StageRecord]:
    """Every stage of every member, interleaved stage by stage as workers would send them."""
    return [
        worker.stage(grant, i, k, rewards[k], terminal=k == len(rewards) - 1, version=version)
        for k in range(3)
        for i, rewards in REWARDS.items()
        if k < len(rewards)
    ]


def outcome_messages(worker: Worker, grant: LeaseGrant) -> list[Outcome]:
    return [worker.outcome(grant, i, len(REWARDS[i]), OUTCOMES[i]) for i in REWARDS]


def expected_final_credit(config: Config) -> dict[tuple[int, int], float]:
    algo = config.algo
    per_member = final_credit(REWARDS, OUTCOMES, algo.credit, algo.omega, algo.gamma, algo.eps)
    return {(i, k): a for i, stages in per_member.items() for k, a in enumerate(stages)}


# --- the ledger invariant, end to end -----------------------------------------------------------------------


def test_trained_credit_of_every_stage_sums_to_a_final():
    config = make_config()
    service, worker = build_service(config), Worker()
    grant = lease(service, worker)
    send_all(service, stage_records(worker, grant))
    trained: dict[tuple[int, int], float] = {}

    immediates = request_batch(service, version=0)
    assert immediates is not None and {item.kind for item in immediates.items} == {"immediate"}
    for item in immediates.items:
        for k, a in stage_credit(item).items():
            member = int(item.trajectory_id.split("/")[1])
            trained[(member, k)] = trained.get((member, k), 0.0) + a
    assert isinstance(ack_batch(service, immediates, version=1), Ack)

    send_all(service, outcome_messages(worker, grant))
    corrections = request_batch(service, version=1)
    assert corrections is not None and {item.kind for item in corrections.items} == {"correction"}
    assert {item.trajectory_id for item in corrections.items} <= {f"{grant.group_id}/{i}" for i in REWARDS}
    for item in corrections.items:
        member = int(item.trajectory_id.split("/")[1])
        assert len(item.token_ids()) == sum(sum(Worker.lengths(member, k)) for k in range(len(REWARDS[member])))
        for k, c in stage_credit(item).items():
            trained[(member, k)] = trained.get((member, k), 0.0) + c
    assert isinstance(ack_batch(service, corrections, version=2), Ack)

    for stage, a_final in expected_final_credit(config).items():
        assert math.isclose(trained.get(stage, 0.0), a_final, rel_tol=0, abs_tol=1e-9), stage
    stats = service.stats_snapshot()
    assert stats.groups_closed == 1 and stats.ledger_residual_max < 1e-9
    assert stats.env_steps == 9 and stats.trajectories_finished == 4 and stats.success_rate == 0.5
    assert service.groups == {} and len(service.queue) == 0, "a closed group's tokens and ledger are freed"


def test_immediate_items_carry_a_imm_on_the_last_stage_of_their_prefix():
    config = make_config()
    service, worker = build_service(config), Worker()
    grant = lease(service, worker)
    send_all(service, stage_records(worker, grant))
    batch = request_batch(service, version=0)
    expected = {}
    for k in range(3):
        peers = {i: r[k] for i, r in REWARDS.items() if k < len(r)}
        for i, a in immediate_advantages(peers, config.algo.omega, config.algo.eps).items():
            expected[(i, k)] = a
    got = {}
    for item in batch.items:
        member = int(item.trajectory_id.split("/")[1])
        ((k, a),) = stage_credit(item).items()
        assert len(item.token_ids()) == sum(sum(Worker.lengths(member, j)) for j in range(k + 1)), "prefix through k"
        assert np.all(item.versions()[item.mask() == 0] == 0) and np.all(item.logprobs()[item.mask() == 0] == 0)
        assert np.allclose(
            item.logprobs()[item.mask() == 1], [-0.5 - 0.1 * j for j in range(Worker.lengths(member, k)[1])]
        )
        got[(member, k)] = a
    assert got == pytest.approx(expected)


# --- update modes -----------------------------------------------------------------------------------------


def test_immediate_items_are_served_before_any_outcome_arrives():
    service, worker = build_service(make_config()), Worker()
    grant = lease(service, worker)
    send_all(service, [worker.stage(grant, i, 0, float(i)) for i in range(4)])
    batch = request_batch(service, version=0)
    assert batch is not None and len(batch.items) == 4 and all(item.kind == "immediate" for item in batch.items)
    assert batch.stats.immediate_before_outcome == 4


def test_outcome_only_mode_serves_no_immediate_items():
    service, worker = build_service(make_config(algo={"updates": "outcome-only"})), Worker()
    grant = lease(service, worker)
    send_all(service, stage_records(worker, grant))
    assert request_batch(service, version=0) is None and len(service.queue) == 0
    batches = send_all(service, outcome_messages(worker, grant))  # the parked request is answered
    assert len(batches) == 1 and {item.kind for item in batches[0].items} == {"correction"}


def test_immediate_only_mode_closes_groups_without_corrections():
    service, worker = build_service(make_config(algo={"updates": "immediate-only"})), Worker()
    grant = lease(service, worker)
    send_all(service, stage_records(worker, grant))
    send_all(service, outcome_messages(worker, grant))
    assert service.stats_snapshot().groups_closed == 1 and service.groups == {}
    batch = request_batch(service, version=0)
    assert batch is not None and {item.kind for item in batch.items} == {"immediate"}, "queued immediates still train"
    assert isinstance(ack_batch(service, batch, version=1), Ack)
    assert len(service.queue) == 0


def test_queued_immediates_are_superseded_by_the_correction():
    config = make_config()
    service, worker = build_service(config), Worker()
    grant = lease(service, worker)
    send_all(service, stage_records(worker, grant))
    queued = len(service.queue)
    send_all(service, outcome_messages(worker, grant))
    assert service.stats_snapshot().immediate_superseded == queued
    batch = request_batch(service, version=0)
    credit = {}
    for item in batch.items:
        assert item.kind == "correction"
        member = int(item.trajectory_id.split("/")[1])
        credit.update({(member, k): c for k, c in stage_credit(item).items()})
    expected = {stage: a for stage, a in expected_final_credit(config).items() if abs(a) > 1e-8}
    assert credit == pytest.approx(expected, abs=1e-12), "nothing was issued: C = A_final"


def test_finalization_waits_for_immediates_in_flight():
    service, worker = build_service(make_config()), Worker()
    grant = lease(service, worker)
    send_all(service, stage_records(worker, grant))
    immediates = request_batch(service, version=0)
    send_all(service, outcome_messages(worker, grant))
    assert len(service.queue) == 0, "no correction while an immediate item's ack could still change issued"
    ack_batch(service, immediates, version=1)
    assert len(service.queue) > 0 and service.stats_snapshot().immediate_superseded == 0


def member_credit(batch: Batch) -> dict[tuple[int, int], float]:
    """(member, stage) -> the credit `batch` trains on that stage's action tokens."""
    return {(int(item.trajectory_id.split("/")[1]), k): a
            for item in batch.items for k, a in stage_credit(item).items()}


# --- admission and staleness --------------------------------------------------------------------------------


def test_admission_denies_past_the_staleness_bound_and_reopens_when_the_learner_steps():
    config = make_config(algo={"max_staleness": 1, "groups_per_step": 2})
    service, worker = build_service(config), Worker()
    for _ in range((0 + 1 + 1) * 2):
        lease(service, worker)
    denied = only_reply(service.handle(WORKER, worker.lease(), 0.0))
    assert isinstance(denied, LeaseDenied) and denied.reason == "staleness" and denied.retry_after_s > 0
    assert request_batch(service, version=1) is None  # parked: the learner is at version 1 now
    for _ in range(2):
        lease(service, worker)
    assert isinstance(only_reply(service.handle(WORKER, worker.lease(), 0.0)), LeaseDenied)
    stats = service.stats_snapshot()
    assert stats.groups_started == 6 and stats.leases_denied == 2


def test_groups_that_closed_without_items_do_not_hold_admission_back():
    # A random policy's usual group: every reward 0, every outcome 0 -> zero variance -> no item at all. Counted
    # by admission, such groups stalled the first real runs: the learner waited for items forever.
    config = make_config(algo={"max_staleness": 0, "groups_per_step": 1})
    service, worker = build_service(config), Worker()
    grant = lease(service, worker)
    assert isinstance(only_reply(service.handle(WORKER, worker.lease(), 0.0)), LeaseDenied)
    records = [worker.stage(grant, i, 0, 0.0, terminal=True) for i in range(4)]
    send_all(service, records + [worker.outcome(grant, i, 1, 0.0) for i in range(4)])
    stats = service.stats_snapshot()
    assert stats.groups_closed == 1 and stats.groups_empty == 1 and stats.items_queued == 0
    assert isinstance(lease(service, worker), LeaseGrant)  # still version 0, yet admitted again


def test_a_group_whose_items_all_went_stale_does_not_hold_admission_back():
    # immediate-only: no correction will carry the credit of skipped items, so such a group trains nothing. Counted
    # by admission, a run of them deadlocked a real run at version 3 (learner waiting, workers denied).
    config = make_config(algo={"updates": "immediate-only", "max_staleness": 0, "groups_per_step": 1})
    service, worker = build_service(config), Worker()
    grant = lease(service, worker)
    records = [worker.stage(grant, i, 0, 1.0 if i == 0 else 0.0, terminal=True) for i in range(4)]
    send_all(service, records + [worker.outcome(grant, i, 1, 0.0) for i in range(4)])
    assert request_batch(service, version=1) is None  # every immediate item is stale at version 1: skipped
    stats = service.stats_snapshot()
    assert stats.immediate_skipped_stale == 4 and stats.groups_empty == 1
    # At version 1 the bound is (1 + 0 + 1) x 1 = 2 groups that can still train: two new ones fit.
    assert isinstance(lease(service, worker), LeaseGrant)
    assert isinstance(lease(service, worker), LeaseGrant)
    assert isinstance(only_reply(service.handle(WORKER, worker.lease(), 0.0)), LeaseDenied)


def test_the_long_success_window_is_what_the_stop_rule_sees():
    config = make_config(replay={"success_window": 4, "long_success_window": 8})
    service, worker = build_service(config), Worker()
    for outcome in [1.0] * 6 + [0.0] * 4:  # 10 trajectories: the long window keeps the last 8
        grant = lease(service, worker)
        send_all(service, [worker.stage(grant, 0, 0, 1.0, terminal=True), worker.outcome(grant, 0, 1, outcome)])
    stats = service.stats_snapshot()
    assert stats.success_rate == 0.0  # the last 4: all failures
    assert stats.success_rate_long == 4 / 8


def test_admission_denies_once_the_env_step_budget_is_spent():
    service, worker = build_service(make_config(run={"max_env_steps": 2})), Worker()
    grant = lease(service, worker)
    send_all(service, [worker.stage(grant, 0, 0, 1.0), worker.stage(grant, 1, 0, 0.0)])
    denied = only_reply(service.handle(WORKER, worker.lease(), 0.0))
    assert isinstance(denied, LeaseDenied) and denied.reason == "budget"


def test_once_the_budget_is_spent_an_idle_learner_gets_an_empty_batch_with_the_stats():
    # Without it a learner whose last groups yielded nothing (GRPO on a sparse task) waited forever.
    service, worker = build_service(make_config(run={"max_env_steps": 2})), Worker()
    assert request_batch(service, version=0, max_wait_s=1.0) is None  # nothing to train, budget not spent: wait
    grant = lease(service, worker)
    records = [worker.stage(grant, i, 0, 0.0, terminal=True) for i in range(2)]
    send_all(service, records, now=0.5)
    assert service.tick(0.6) == []  # budget spent, but the request has not waited max_wait_s yet
    [(identity, batch)] = service.tick(1.5)
    assert identity == LEARNER and isinstance(batch, Batch)
    assert batch.items == [] and batch.stats.env_steps == 2
    assert isinstance(ack_batch(service, batch, version=0), Ack)


def test_a_resent_lease_request_gets_the_same_group():
    service, worker = build_service(make_config()), Worker()
    request = worker.lease()
    first = only_reply(service.handle(WORKER, request, 0.0))
    again = only_reply(service.handle(WORKER, request, 0.1))
    assert again == first and service.stats_snapshot().groups_started == 1


def test_a_stale_immediate_is_skipped_and_its_credit_arrives_in_the_correction():
    config = make_config(algo={"max_staleness": 2})
    service, worker = build_service(config), Worker()
    grant = lease(service, worker)
    send_all(service, stage_records(worker, grant, version=0))
    assert request_batch(service, version=3) is None, "every immediate is 3 versions stale: none is served"
    stats = service.stats_snapshot()
    assert stats.immediate_skipped_stale > 0 and stats.items_queued == 0
    batches = send_all(service, outcome_messages(worker, grant))
    credit = {}
    for item in batches[0].items:
        member = int(item.trajectory_id.split("/")[1])
        credit.update({(member, k): c for k, c in stage_credit(item).items()})
    expected = {stage: a for stage, a in expected_final_credit(config).items() if abs(a) > 1e-8}
    assert credit == pytest.approx(expected, abs=1e-12)
    ack_batch(service, batches[0], version=4)
    assert service.stats_snapshot().ledger_residual_max < 1e-9


def test_a_stale_correction_is_dropped_and_counted():
    config = make_config(algo={"updates": "outcome-only", "max_correction_staleness": 2})
    service, worker = build_service(config), Worker()
    grant = lease(service, worker)
    send_all(service, stage_records(worker, grant, version=0))
    send_all(service, outcome_messages(worker, grant))
    corrected = sum(abs(a) > 1e-8 for a in expected_final_credit(config).values())
    assert request_batch(service, version=3) is None
    stats = service.stats_snapshot()
    assert stats.credit_dropped == corrected > 0
    assert stats.groups_closed == 1 and stats.ledger_residual_max == 0.0, "dropped stages are not residuals"


# --- arrivals: duplicates, bad records, leases, out-of-order stages -----------------------------------------


def test_a_duplicate_stage_record_is_acked_as_duplicate_and_counted_once():
    service, worker = build_service(make_config()), Worker()
    grant = lease(service, worker)
    record = worker.stage(grant, 0, 0, 1.0)
    first = only_reply(service.handle(WORKER, record, 0.0))
    again = only_reply(service.handle(WORKER, record, 0.1))
    assert first == Ack(msg_id=record.msg_id) and again == Ack(msg_id=record.msg_id, duplicate=True)
    assert service.stats_snapshot().env_steps == 1


def test_records_for_unknown_groups_or_members_are_rejected_without_storing():
    service, worker = build_service(make_config()), Worker()
    grant = lease(service, worker)
    ghost = LeaseGrant(msg_id=0, group_id="g99", group_size=4, policy_version=0)
    error = only_reply(service.handle(WORKER, worker.stage(ghost, 0, 0, 1.0), 0.0))
    assert isinstance(error, Error) and error.code == "unknown_group"
    error = only_reply(service.handle(WORKER, worker.stage(grant, 4, 0, 1.0), 0.0))
    assert isinstance(error, Error) and error.code == "bad_state"
    error = only_reply(service.handle(WORKER, worker.outcome(grant, 0, 1, None), 0.0))
    assert isinstance(error, Error) and error.code == "bad_state"
    assert service.stats_snapshot().env_steps == 0


def test_lease_expiry_abandons_unfinished_members_and_the_group_still_finalizes():
    config = make_config(replay={"lease_timeout_s": 10.0})
    service, worker = build_service(config), Worker()
    grant = lease(service, worker, now=0.0)
    send_all(service, [worker.stage(grant, i, 0, 0.5, terminal=True) for i in range(3)], now=1.0)
    send_all(service, [worker.outcome(grant, 0, 1, 1.0), worker.outcome(grant, 1, 1, 0.0)], now=2.0)
    service.handle(WORKER, Heartbeat(worker_id=worker.worker_id), 9.0)
    service.tick(15.0)
    assert service.stats_snapshot().trajectories_abandoned == 0, "the heartbeat renewed the lease"
    service.tick(19.5)
    stats = service.stats_snapshot()
    assert stats.trajectories_abandoned == 2
    batch = request_batch(service, version=1, now=20.0)
    assert batch is not None and {item.trajectory_id for item in batch.items if item.kind == "correction"} == {
        f"{grant.group_id}/0",
        f"{grant.group_id}/1",
    }
    ack_batch(service, batch, version=2, now=21.0)
    assert service.stats_snapshot().groups_closed == 1 and service.groups == {}


@pytest.mark.parametrize("resent", [True, False])
def test_an_outcome_that_overtook_its_lost_stage_waits_for_the_resend_or_goes_with_its_worker(resent):
    """The chaos soak's stall: member 1's last stage was lost with a killed replay, its outcome arrived first, and
    the worker was killed before its resend. The group must not wait for that stage for good: the resend completes
    it, or the worker's silence abandons the member like one without an outcome."""
    config = make_config(rollout={"group_size": 2}, replay={"lease_timeout_s": 10.0})
    service, worker = build_service(config), Worker()
    grant = lease(service, worker, now=0.0)
    lost = worker.stage(grant, 1, 1, 0.0, terminal=True)  # sent, never stored
    send_all(service, [worker.stage(grant, 0, 0, 0.5), worker.stage(grant, 0, 1, 1.0, terminal=True),
                       worker.stage(grant, 1, 0, 0.2)], now=1.0)
    send_all(service, [worker.outcome(grant, 1, 2, 0.0), worker.outcome(grant, 0, 2, 1.0)], now=2.0)
    group = service.groups[grant.group_id]
    assert not group.finalized and group.unfinished_members() == [1]
    assert service.leases.held(worker.worker_id) == [grant.group_id], "the lease stays: the stage may be resent"
    if resent:
        send_all(service, [lost], now=3.0)
        assert group.finalized and service.leases.held(worker.worker_id) == []
        assert service.stats_snapshot().trajectories_abandoned == 0
    else:
        service.tick(12.5)  # the worker is gone: its lease expires
        assert service.stats_snapshot().trajectories_abandoned == 1
        assert grant.group_id not in service.groups or service.groups[grant.group_id].finalized
    batch = request_batch(service, version=1, now=13.0)
    if resent:  # both members' final credit, carried by corrections
        assert batch is not None and {item.trajectory_id for item in batch.items if item.kind == "correction"} == {
            f"{grant.group_id}/0", f"{grant.group_id}/1"}
        ack_batch(service, batch, version=2, now=14.0)
    stats = service.stats_snapshot()
    assert stats.groups_closed == 1 and stats.credit_dropped == 0 and stats.ledger_residual_max < 1e-9


def test_an_abandoned_outcome_abandons_the_member():
    service, worker = build_service(make_config(rollout={"group_size": 2})), Worker()
    grant = lease(service, worker)
    send_all(service, [worker.stage(grant, 0, 0, 1.0, terminal=True), worker.outcome(grant, 0, 1, 1.0)])
    send_all(service, [worker.outcome(grant, 1, 0, None, abandoned=True, reason="engine died")])
    stats = service.stats_snapshot()
    assert stats.trajectories_abandoned == 1 and stats.groups_closed == 1, "one finished member: no final credit"


def test_an_immediate_waits_for_a_missing_prefix_stage():
    service, worker = build_service(make_config(rollout={"group_size": 2})), Worker()
    grant = lease(service, worker)
    send_all(service, [worker.stage(grant, 0, 0, 1.0), worker.stage(grant, 0, 1, 1.0, terminal=True)])
    send_all(service, [worker.stage(grant, 1, 1, 0.0, terminal=True)])  # stage 0 of member 1 lost, resent later
    assert len(service.queue) == 1, "stage group 1 is complete, but member 1's prefix is not"
    send_all(service, [worker.stage(grant, 1, 0, 0.0)])
    batch = request_batch(service, version=0)
    by_stage = {(item.trajectory_id, k) for item in batch.items for k in stage_credit(item)}
    assert by_stage == {(f"{grant.group_id}/{i}", k) for i in range(2) for k in range(2)}


def test_a_stage_group_times_out_with_min_stage_peers():
    config = make_config(replay={"stage_group_timeout_s": 5.0, "min_stage_peers": 2})
    service, worker = build_service(config), Worker()
    grant = lease(service, worker)
    send_all(service, [worker.stage(grant, 0, 0, 1.0)], now=0.0)
    service.tick(6.0)
    assert len(service.queue) == 0, "one peer is below min_stage_peers"
    send_all(service, [worker.stage(grant, 1, 0, 0.0)], now=7.0)
    assert len(service.queue) == 2, "past the timeout with two peers: handed out at once"
    send_all(service, [worker.stage(grant, 2, 0, 0.5)], now=8.0)
    assert len(service.queue) == 2, "a stage group is handed out once"

    grant = lease(service, worker)
    send_all(service, [worker.stage(grant, 0, 0, 1.0), worker.stage(grant, 1, 0, 0.0)], now=10.0)
    service.tick(14.9)
    assert len(service.queue) == 2
    service.tick(15.0)
    assert len(service.queue) == 4


# --- batches -------------------------------------------------------------------------------------------------


def test_an_unacked_batch_is_requeued_and_its_late_ack_refused():
    service, worker = build_service(make_config(replay={"batch_ack_timeout_s": 5.0})), Worker()
    grant = lease(service, worker)
    send_all(service, [worker.stage(grant, i, 0, float(i)) for i in range(4)])
    first = request_batch(service, version=0, now=0.0)
    service.tick(4.0)
    assert len(service.queue) == 0
    service.tick(5.0)
    assert len(service.queue) == 4
    second = request_batch(service, version=0, now=6.0)
    assert [item.item_id for item in second.items] == [item.item_id for item in first.items], "back at the front"
    late = ack_batch(service, first, version=1, now=7.0)
    assert isinstance(late, Error) and late.code == "bad_state"
    assert isinstance(ack_batch(service, second, version=1, now=7.0), Ack)


def trained_credit(batches: list[Batch]) -> dict[tuple[int, int], float]:
    """Per (member, stage): the credit the learner's optimizer saw, over the batches it trained."""
    credit: dict[tuple[int, int], float] = {}
    for batch in batches:
        for item in batch.items:
            member = int(item.trajectory_id.split("/")[1])
            for k, a in stage_credit(item).items():
                credit[(member, k)] = credit.get((member, k), 0.0) + a
    return credit


def train_the_rest(service: ReplayService, version: int, now: float) -> tuple[list[Batch], int]:
    """Serve and ack every batch until the queue is empty: (the batches, the version reached)."""
    batches = []
    while len(service.queue):
        batch = request_batch(service, version=version, now=now)
        assert isinstance(batch, Batch), batch
        version += 1
        assert isinstance(ack_batch(service, batch, version=version, now=now), Ack)
        batches.append(batch)
    return batches, version


@pytest.mark.parametrize("window", ["late_ack", "untrained_ack", "new_session", "evicted"])
def test_a_superseded_immediate_acked_late_gets_its_credit_once(window: str):
    """A learner frozen past replay.batch_ack_timeout_s holds a batch of immediates; they are requeued, and meanwhile
    their group's outcomes all arrive. Superseded by the correction then, their late ack (the learner did train them)
    gave their credit twice: once in the immediates, once in the correction. The group now waits for that ack
    before it finalizes, the immediates out of the queue (nobody trains them again): the late ack makes them issued
    and C = A_final - issued carries the rest; an ack that says untrained, a new learner process or the batch's late
    ack no longer taken (REQUEUED_KEPT newer requeued batches) lets the correction carry them instead. Either way
    the optimizer sees A_final per stage, exactly."""
    config = make_config(replay={"batch_ack_timeout_s": 5.0}, learner={"checkpoint_every": 0})  # groups close at once
    service, worker = build_service(config), Worker()
    grant = lease(service, worker)
    send_all(service, stage_records(worker, grant))
    first = request_batch(service, version=0, now=0.0)
    assert isinstance(first, Batch) and {item.kind for item in first.items} == {"immediate"}
    service.tick(5.0)  # the learner is frozen: its batch goes back to the front of the queue
    assert len(service.queue) == len(first.items)
    send_all(service, outcome_messages(worker, grant), now=5.5)
    waiting = len(service.queue)  # the held immediates are served to nobody, and no correction is made yet
    trained = []
    if window == "late_ack":
        late = ack_batch(service, first, version=1, now=6.0)
        trained.append(first)  # the learner trained it, whatever the replay answers
    elif window == "untrained_ack":
        ack = BatchAck(learner_id="learner", msg_id=9, batch_id=first.batch_id, policy_version=0, trained=False)
        assert isinstance(only_reply(service.handle(LEARNER, ack, 6.0), LEARNER), Ack)
    elif window == "new_session":  # a new learner process: the old one's late ack is not taken
        batch = session_request(service, 0, 5, -1)
        assert isinstance(batch, Batch) and isinstance(ack_batch(service, batch, version=1, now=6.0), Ack)
        trained.append(batch)
    else:  # sixteen newer batches requeued after a timeout: the first's late ack is no longer taken
        other = lease(service, worker, now=6.0)
        send_all(service, stage_records(worker, other), now=6.0)
        for n in range(16):
            assert isinstance(request_batch(service, version=0, now=10.0 * n + 10, max_tokens=1), Batch)
            service.tick(10.0 * n + 15)
        assert first.batch_id not in service.state.serving.requeued
    batches, _ = train_the_rest(service, len(trained), now=500.0)
    trained += batches
    if window == "evicted":  # the other group's items: only this group's credit is checked
        trained = [Batch(msg_id=b.msg_id, batch_id=b.batch_id, stats=b.stats,
                         items=[item for item in b.items if item.group_id == grant.group_id]) for b in trained]
    seen = trained_credit(trained)
    expected = expected_final_credit(config)
    assert {stage: round(a, 9) for stage, a in seen.items() if abs(a) > 1e-12} == {
        stage: round(a, 9) for stage, a in expected.items() if abs(a) > 1e-12}, "each stage's credit once"
    stats = service.stats_snapshot()
    assert stats.ledger_residual_max < 1e-9 and grant.group_id not in service.groups
    assert stats.immediate_superseded == (0 if window == "late_ack" else len(first.items))
    assert waiting == 0 and (window != "late_ack" or isinstance(late, Ack))


def test_a_batch_respects_the_token_budget_and_min_items():
    service, worker = build_service(make_config()), Worker()
    grant = lease(service, worker)
    send_all(service, [worker.stage(grant, i, 0, float(i)) for i in range(4)])
    longest = max(sum(Worker.lengths(i, 0)) for i in range(4))
    batch = request_batch(service, version=0, max_tokens=2 * longest)
    assert 1 <= len(batch.items) <= 2
    assert max(len(item.token_ids()) for item in batch.items) * len(batch.items) <= 2 * longest
    assert request_batch(service, version=0, max_tokens=1) is not None, "always at least one item"
    assert request_batch(service, version=0, min_items=10, max_wait_s=2.0, now=1.0) is None, "not enough items yet"
    assert service.tick(2.9) == []
    ((learner, batch),) = service.tick(3.0)
    assert learner == LEARNER and len(batch.items) >= 1, "max_wait_s passed with items queued"


def test_an_empty_queue_parks_the_request_until_items_arrive():
    service, worker = build_service(make_config()), Worker()
    grant = lease(service, worker)
    assert request_batch(service, version=0) is None
    batches = send_all(service, [worker.stage(grant, i, 0, float(i)) for i in range(4)])
    assert len(batches) == 1 and batches[0].msg_id == 7 and len(batches[0].items) == 4


# --- the socket loop -----------------------------------------------------------------------------------------


@pytest.fixture
def served(tmp_path: Path):
    """`run` in a background thread on an ipc:// endpoint; yields (config, context)."""
    config = make_config(replay={"endpoint": f"ipc://{tmp_path}/replay.ipc"}, rollout={"group_size": 2},
                         run={"dir": str(tmp_path)}, wandb={"mode": "disabled"})
    stop = threading.Event()
    thread = threading.Thread(target=run, args=(config, stop), daemon=True)
    thread.start()
    context = zmq.Context()
    yield config, context
    context.destroy(linger=0)
    stop.set()
    thread.join(timeout=5)
    assert not thread.is_alive()


def exchange(socket: zmq.Socket, message) -> object:
    send(socket, message)
    assert socket.poll(5000), f"no reply to {type(message).__name__}"
    return receive(socket)[1]


def test_a_group_round_trips_over_real_sockets(served):
    config, context = served
    worker_socket = connect_dealer(context, config.replay.endpoint, "worker-0")
    learner_socket = connect_dealer(context, config.replay.endpoint, "learner-0")
    worker = Worker()
    grant = exchange(worker_socket, worker.lease())
    assert isinstance(grant, LeaseGrant) and grant.group_size == 2
    for i, reward in enumerate([1.0, 0.0]):
        assert isinstance(exchange(worker_socket, worker.stage(grant, i, 0, reward, terminal=True)), Ack)
    request = BatchRequest(learner_id="l", msg_id=1, policy_version=0, max_tokens=4096, min_items=2, max_wait_s=1.0)
    immediates = exchange(learner_socket, request)
    assert isinstance(immediates, Batch) and len(immediates.items) == 2
    ack = BatchAck(learner_id="l", msg_id=2, batch_id=immediates.batch_id, policy_version=1)
    assert exchange(learner_socket, ack) == Ack(msg_id=2)
    for i, outcome in enumerate([1.0, 0.0]):
        assert isinstance(exchange(worker_socket, worker.outcome(grant, i, 1, outcome)), Ack)
    request = BatchRequest(learner_id="l", msg_id=3, policy_version=1, max_tokens=4096, min_items=1, max_wait_s=1.0)
    corrections = exchange(learner_socket, request)
    assert isinstance(corrections, Batch) and {item.kind for item in corrections.items} == {"correction"}
    ack = BatchAck(learner_id="l", msg_id=4, batch_id=corrections.batch_id, policy_version=2)
    assert exchange(learner_socket, ack) == Ack(msg_id=4)
    request = BatchRequest(learner_id="l", msg_id=5, policy_version=2, max_tokens=4096, min_items=1, max_wait_s=0.0)
    send(learner_socket, request)
    assert not learner_socket.poll(200), "an empty queue is never answered with an empty batch"
    send(worker_socket, worker.lease())
    assert worker_socket.poll(5000) and isinstance(receive(worker_socket)[1], LeaseGrant), "still serving workers"


def test_bad_frames_get_errors_and_the_service_keeps_serving(served):
    config, context = served
    socket = connect_dealer(context, config.replay.endpoint, "fuzzer")
    rng = random.Random(0)
    for _ in range(20):
        socket.send(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))))
        assert socket.poll(5000)
        error = receive(socket)[1]
        assert isinstance(error, Error) and error.code == "malformed" and error.msg_id == -1
    socket.send(encode(LeaseRequest(worker_id="w", msg_id=1, protocol=PROTOCOL_VERSION + 1)))
    assert socket.poll(5000)
    error = receive(socket)[1]
    assert isinstance(error, Error) and error.code == "malformed" and "protocol version" in error.detail
    socket.send_multipart([b"two", b"frames"])
    assert socket.poll(5000) and receive(socket)[1].code == "malformed"
    stray = Batch(msg_id=5, batch_id=0, items=[], stats=ReplayStats())
    error = exchange(socket, stray)
    assert isinstance(error, Error) and error.code == "bad_state" and error.msg_id == 5
    assert isinstance(exchange(socket, Worker("w").lease()), LeaseGrant), "still serving after the abuse"


def test_sigterm_stops_a_replay_process(tmp_path: Path):
    endpoint = f"ipc://{tmp_path}/replay.ipc"
    code = (
        "import logging; logging.basicConfig(level='INFO');"
        "from async_rl.config_load import config_from_dict; from replay.server import run;"
        f"run(config_from_dict({{'replay': {{'endpoint': '{endpoint}'}}, 'run': {{'dir': '{tmp_path}'}},"
        " 'wandb': {'mode': 'disabled'}}))"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    process = subprocess.Popen(
        [sys.executable, "-c", code], cwd=Path(__file__).parent.parent, env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        context = zmq.Context()
        socket = connect_dealer(context, endpoint, "probe")
        assert isinstance(exchange(socket, Worker().lease()), LeaseGrant)
        context.destroy(linger=0)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
        assert "replay service stopped" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()


# --- validation at the edge ------------------------------------------------------------------------------------


def assert_ledgers_finite(service: ReplayService) -> None:
    """Nothing non-finite reached a ledger (so `ledger_residual_max` cannot be blinded by a NaN)."""
    for group in service.groups.values():
        ledger = group.ledger
        assert all(r is None or math.isfinite(r) for stages in ledger.rewards.values() for r in stages.values())
        assert all(math.isfinite(o) for o in ledger.outcomes.values())
    assert math.isfinite(service.counters.ledger_residual_max)


def learner_speaks(service: ReplayService, version: int = 0) -> None:
    """A learner's first BatchRequest: the replay now knows the version it is at (nothing to serve yet)."""
    assert request_batch(service, version, max_wait_s=60.0) is None


def replaced(record: StageRecord, **changes) -> StageRecord:
    return msgspec.structs.replace(record, **changes)


NAN, INF = float("nan"), float("inf")
HOSTILE_RECORDS = {  # name -> (how to spoil member 0's first stage record, the reason it is refused)
    "nan_reward": (lambda r: replaced(r, stage_reward=NAN), "nonfinite_reward"),
    "inf_reward": (lambda r: replaced(r, stage_reward=INF), "nonfinite_reward"),
    "positive_logprob": (lambda r: replaced(r, behaviour_logprobs=pack([0.7] * len(r.logprobs()), LOGPROB)),
                         "bad_logprob"),
    "nan_logprob": (lambda r: replaced(r, behaviour_logprobs=pack([NAN] * len(r.logprobs()), LOGPROB)),
                    "bad_logprob"),
    "negative_version": (lambda r: replaced(r, policy_versions=pack([-1] * len(r.versions()), TOKEN)), "bad_version"),
    "huge_version": (lambda r: replaced(r, policy_versions=pack([2**30] * len(r.versions()), TOKEN)),
                     "version_ahead"),
    "negative_token": (lambda r: replaced(r, action_tokens=pack([-7] * len(r.action_ids()), TOKEN)), "bad_token"),
    "over_long": (lambda r: replaced(r, observation_tokens=pack([5] * 8000, TOKEN)), "too_long"),
}


@pytest.mark.parametrize("name", HOSTILE_RECORDS)
def test_a_hostile_stage_record_is_refused_counted_and_stores_nothing(name):
    spoil, reason = HOSTILE_RECORDS[name]
    service, worker = build_service(make_config()), Worker()
    learner_speaks(service)
    grant = lease(service, worker)
    error = only_reply(service.handle(WORKER, spoil(worker.stage(grant, 0, 0, 1.0)), 0.0))
    assert isinstance(error, Error) and error.detail.startswith(f"{reason}: "), error
    assert service.stats_snapshot().rejected == {reason: 1}
    group = service.groups[grant.group_id]
    assert 0 not in group.trajectories and group.ledger.rewards[0] == {} and service.counters.env_steps == 0
    assert group.ledger.abandoned == {0}, "its trajectory is abandoned, so the group can still close"
    send_all(service, [worker.stage(grant, 1, 0, 1.0)])  # still serving, the other members unaffected
    assert_ledgers_finite(service)


def test_a_group_with_a_refused_member_still_closes_with_a_finite_residual():
    service, worker = build_service(make_config()), Worker()
    learner_speaks(service)
    grant = lease(service, worker)
    bad = replaced(worker.stage(grant, 0, 0, 1.0, terminal=True), stage_reward=NAN)
    assert isinstance(only_reply(service.handle(WORKER, bad, 0.0)), Error)
    records = [worker.stage(grant, i, 0, float(i % 2), terminal=True) for i in (1, 2, 3)]
    version = 0
    for batch in send_all(service, records + [worker.outcome(grant, i, 1, float(i % 2)) for i in (1, 2, 3)]):
        version += 1  # the learner's first request was parked until these items came
        assert isinstance(ack_batch(service, batch, version), Ack)
    while (batch := request_batch(service, version)) is not None:
        version += 1
        assert isinstance(ack_batch(service, batch, version), Ack)
    stats = service.stats_snapshot()
    assert stats.groups_closed == 1 and stats.trajectories_abandoned == 1 and stats.ledger_residual_max < 1e-9
    late = worker.outcome(grant, 0, 1, 1.0)
    assert only_reply(service.handle(WORKER, late, 0.0)) == Ack(msg_id=late.msg_id, duplicate=True)
    after = service.stats_snapshot()
    assert grant.group_id not in service.groups, "the group is gone; nothing revives it"
    assert (after.groups_closed, after.trajectories_finished, after.closed_group_resends) == (
        1, stats.trajectories_finished, 1)


def test_a_resend_for_a_closed_group_is_acked_as_a_duplicate_and_an_unissued_group_is_refused():
    """A worker whose ack was late resends a record after its group closed (issue 41): a duplicate, not an error;
    an id this replay never issued (a later n, a later epoch, another form) is still `unknown_group`."""
    service, worker = build_service(make_config()), Worker()
    learner_speaks(service)
    grant = lease(service, worker)
    records = [worker.stage(grant, i, 0, float(i % 2), terminal=True) for i in range(4)]
    outcomes = [worker.outcome(grant, i, 1, float(i % 2)) for i in range(4)]
    version = 0
    for batch in send_all(service, records + outcomes):
        version += 1
        assert isinstance(ack_batch(service, batch, version), Ack)
    while (batch := request_batch(service, version)) is not None:
        version += 1
        assert isinstance(ack_batch(service, batch, version), Ack)
    assert grant.group_id not in service.groups
    before = service.stats_snapshot()
    for message in (records[2], outcomes[3]):
        assert only_reply(service.handle(WORKER, message, 1.0)) == Ack(msg_id=message.msg_id, duplicate=True)
    after = service.stats_snapshot()
    assert after.closed_group_resends == 2 and after.env_steps == before.env_steps
    assert after.trajectories_finished == before.trajectories_finished and after.rejected == before.rejected
    epoch, n = grant.group_id[1:].split(".g")
    for never in (f"e{epoch}.g{int(n) + 5}", f"e{int(epoch) + 1}.g0", "g0", "e0.g"):
        ghost = LeaseGrant(msg_id=0, group_id=never, group_size=4, policy_version=0)
        error = only_reply(service.handle(WORKER, worker.stage(ghost, 0, 0, 1.0), 1.0))
        assert isinstance(error, Error) and error.code == "unknown_group", never


HOSTILE_OUTCOMES = {
    "nan_outcome": (dict(outcome=NAN), "nonfinite_outcome"),
    "inf_outcome": (dict(outcome=-INF), "nonfinite_outcome"),
    "negative_member": (dict(member=-1), "bad_member"),
    "zero_stages": (dict(num_stages=0), "bad_num_stages"),
}


@pytest.mark.parametrize("name", HOSTILE_OUTCOMES)
def test_a_hostile_outcome_is_refused_counted_and_stores_nothing(name):
    changes, reason = HOSTILE_OUTCOMES[name]
    service, worker = build_service(make_config()), Worker()
    grant = lease(service, worker)
    send_all(service, [worker.stage(grant, 0, 0, 1.0, terminal=True)])
    message = msgspec.structs.replace(worker.outcome(grant, 0, 1, 1.0), **changes)
    error = only_reply(service.handle(WORKER, message, 0.0))  # before: a KeyError inside for member=-1
    assert isinstance(error, Error) and error.detail.startswith(f"{reason}: "), error
    assert service.stats_snapshot().rejected == {reason: 1}
    ledger = service.groups[grant.group_id].ledger
    assert ledger.outcomes == {} and service.counters.trajectories_finished == 0
    assert_ledgers_finite(service)
    assert isinstance(only_reply(service.handle(WORKER, worker.lease(), 0.0)), LeaseGrant), "still serving"


def test_an_absurd_batch_request_version_is_refused_and_does_not_move_the_version():
    service, worker = build_service(make_config()), Worker()
    learner_speaks(service, version=3)
    for version in (2**40, 3 + 1 + 2 + 1):  # out of int32; above 3 + algo.ppo_epochs + replay.max_version_lead
        request = BatchRequest(learner_id="x", msg_id=70, policy_version=version, max_tokens=4096, min_items=1,
                               max_wait_s=0.0)
        error = only_reply(service.handle(b"forger", request, 0.0), b"forger")
        assert isinstance(error, Error) and error.msg_id == 70, error
    assert service.policy_version == 3 and b"forger" not in service.parked
    assert service.stats_snapshot().rejected == {"bad_version": 1, "version_ahead": 1}
    learner_speaks(service, version=3 + 1 + 2)  # within the lead: an honest learner is never refused
    assert service.policy_version == 6
    ack = BatchAck(learner_id="x", msg_id=71, batch_id=0, policy_version=2**30)
    assert isinstance(only_reply(service.handle(LEARNER, ack, 0.0), LEARNER), Error)
    grant = lease(service, worker)
    send_all(service, [worker.stage(grant, i, 0, float(i % 2), terminal=True, version=6) for i in range(4)])


def test_an_honest_learner_stays_within_the_version_bound_even_when_its_acks_are_lost():
    config = make_config(algo={"ppo_epochs": 2})
    service, worker = build_service(config), Worker()
    version = 0
    for _ in range(6):  # each batch served, trained (+2) and never acked: the next request is 2 further on
        grant = lease(service, worker)
        send_all(service, [worker.stage(grant, i, 0, float(i % 2), terminal=True, version=version) for i in range(4)])
        batch = request_batch(service, version)
        assert isinstance(batch, Batch), batch
        version += 2
    assert service.policy_version == version - 2 and not service.counters.rejected


def test_bad_batch_requests_are_refused_by_reason():
    service = build_service(make_config())
    for changes in (dict(max_tokens=0), dict(min_items=-1), dict(max_wait_s=NAN), dict(max_wait_s=-1.0)):
        fields = dict(learner_id="l", msg_id=3, policy_version=0, max_tokens=4096, min_items=1, max_wait_s=0.0)
        error = only_reply(service.handle(LEARNER, BatchRequest(**{**fields, **changes}), 0.0), LEARNER)
        assert isinstance(error, Error) and error.detail.startswith("bad_request: ")
    assert service.stats_snapshot().rejected == {"bad_request": 4} and not service.parked


def test_rejections_are_logged_at_most_once_per_reason_per_interval(caplog):
    service, worker = build_service(make_config()), Worker()
    grant = lease(service, worker)
    with caplog.at_level("WARNING", logger="async_rl.replay"):
        for _ in range(200):
            service.handle(WORKER, replaced(worker.stage(grant, 1, 0, 1.0), stage_reward=NAN), 0.0)
            service.handle(WORKER, worker.stage(LeaseGrant(msg_id=0, group_id="nope", group_size=4,
                                                           policy_version=0), 0, 0, 1.0), 0.0)
    assert service.stats_snapshot().rejected == {"nonfinite_reward": 200, "unknown_group": 200}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines  # one per reason


def test_an_untrained_batch_ack_counts_no_credit_and_the_correction_carries_it():
    config = make_config()
    service, worker = build_service(config), Worker()
    grant = lease(service, worker)
    send_all(service, stage_records(worker, grant))
    immediates = request_batch(service, 0)
    assert immediates is not None and {item.kind for item in immediates.items} == {"immediate"}
    ack = BatchAck(learner_id="l", msg_id=9, batch_id=immediates.batch_id, policy_version=0, trained=False)
    assert only_reply(service.handle(LEARNER, ack, 0.0), LEARNER) == Ack(msg_id=9)
    assert all(not service.groups[grant.group_id].ledger.issued.get(stage) for stage in expected_final_credit(config))
    send_all(service, outcome_messages(worker, grant))
    corrections = request_batch(service, 0)
    credit = {(int(item.trajectory_id.split("/")[1]), k): c for item in corrections.items
              for k, c in stage_credit(item).items()}
    expected = expected_final_credit(config)
    assert credit.keys() == {s for s, a in expected.items() if abs(a) > 1e-8}
    assert all(credit[s] == pytest.approx(expected[s]) for s in credit), "C = A_final: nothing was issued"
    ack = BatchAck(learner_id="l", msg_id=10, batch_id=corrections.batch_id, policy_version=0, trained=False)
    service.handle(LEARNER, ack, 0.0)
    stats = service.stats_snapshot()
    assert stats.groups_closed == 1 and stats.credit_dropped == len(credit) and stats.ledger_residual_max == 0.0


# --- a wire fuzz against the live socket loop --------------------------------------------------------------------

KNOWN_REASONS = {
    "nonfinite_reward", "nonfinite_outcome", "nonfinite_metric", "bad_logprob", "bad_version", "bad_token",
    "bad_member", "bad_num_stages", "bad_request", "version_ahead", "too_long", "unknown_group", "bad_stage",
    "bad_outcome", "batch_not_in_flight", "unexpected_type", "unexpected_error", "undecodable",
}


def hostile_messages(rng: random.Random, grants: list[LeaseGrant], count: int):
    """A seeded mix of well-formed messages with hostile values (and some garbage and ordinary ones)."""
    floats = [0.0, 1.0, -0.5, NAN, INF, -INF, 1e300, -1e300]
    ints = [0, 1, 3, -1, -(2**31), 2**31 - 1, 2**40, 2**62]
    worker = Worker("fuzz")
    for n in range(count):
        kind = rng.randrange(10)
        grant = rng.choice(grants) if grants and rng.random() < 0.8 else LeaseGrant(
            msg_id=0, group_id=f"g{rng.randrange(10**6)}", group_size=2, policy_version=0)
        member = rng.choice([0, 1, 1, -1, 2, 7, -(2**40)])
        if kind == 0:
            yield worker.lease()
        elif kind in (1, 2, 3):
            record = worker.stage(grant, max(member, 0), rng.randrange(3), rng.choice(floats + [None]),
                                  terminal=rng.random() < 0.5, version=rng.choice([0, 0, 1, 5, -1, 2**30]))
            n_act = len(record.action_ids())
            changes = rng.choice([
                {}, {"behaviour_logprobs": pack([rng.choice([-0.5, 0.5, NAN, INF, -INF])] * n_act, LOGPROB)},
                {"action_tokens": pack([rng.choice([-5, 3, 2**31 - 1])] * n_act, TOKEN)},
                {"observation_tokens": pack([7] * rng.choice([0, 100, 400, 9000]), TOKEN)},
                {"trajectory_id": "someone-else"}, {"task_id": "other-task"},
            ])
            yield msgspec.structs.replace(record, **changes)
        elif kind in (4, 5):
            yield msgspec.structs.replace(
                worker.outcome(grant, 0, 1, 1.0), member=member, num_stages=rng.choice([0, 1, 2, 3, -1, 2**40]),
                outcome=rng.choice(floats + [None]), abandoned=rng.random() < 0.2, success=rng.random() < 0.5,
            )
        elif kind == 6:
            yield BatchRequest(learner_id="spoof", msg_id=n, policy_version=rng.choice(ints),
                               max_tokens=rng.choice([4096, 0, -1, 2**40]), min_items=rng.choice([1, 0, -1, 10**9]),
                               max_wait_s=rng.choice(floats))
        elif kind == 7:
            yield BatchAck(learner_id="spoof", msg_id=n, batch_id=rng.choice([0, 1, 2, -1, 2**40]),
                           policy_version=rng.choice(ints), trained=rng.random() < 0.5)
        elif kind == 8:
            yield rng.choice([
                Heartbeat(worker_id="fuzz", group_ids=[grant.group_id]),
                EvalReport(worker_id="fuzz", msg_id=n, policy_version=rng.choice(ints),
                           metrics={"eval_success_rate": rng.choice(floats)}),
                Error(msg_id=n, code="bad_state", detail="forged"),
                Batch(msg_id=n, batch_id=0, items=[], stats=ReplayStats()),
            ])
        else:
            yield bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))


def test_a_wire_fuzz_of_hostile_values_is_refused_by_reason_and_the_service_keeps_serving(tmp_path):
    config = make_config(replay={"endpoint": f"ipc://{tmp_path}/replay.ipc"}, rollout={"group_size": 2},
                         run={"dir": str(tmp_path)}, wandb={"mode": "disabled"})
    service, stop = build_service(config), threading.Event()
    thread = threading.Thread(target=run, args=(config, stop, service), daemon=True)
    thread.start()
    context = zmq.Context()
    try:
        fuzzer = connect_dealer(context, config.replay.endpoint, "fuzz")
        learner = connect_dealer(context, config.replay.endpoint, "learner-0")
        first = BatchRequest(learner_id="l", msg_id=1, policy_version=0, max_tokens=4096, min_items=1, max_wait_s=0.5)
        send(learner, first)  # the learner speaks first: the replay knows its version before the forgeries
        rng, grants, errors, sent_errors = random.Random(11), [], 0, 0
        messages = list(hostile_messages(rng, grants, 10_000))

        def drain(wait_s: float) -> None:
            nonlocal errors
            while fuzzer.poll(int(wait_s * 1000)):
                reply = receive(fuzzer)[1]
                errors += isinstance(reply, Error)
                if isinstance(reply, LeaseGrant):
                    grants.append(reply)

        for start in range(0, len(messages), 250):
            for message in messages[start:start + 250]:
                if isinstance(message, bytes):
                    fuzzer.send(message)
                else:
                    sent_errors += isinstance(message, Error)
                    send(fuzzer, message)
            drain(0.05)
        probe = exchange(fuzzer, Worker("probe").lease())  # replies come in order: every earlier one is in
        while not isinstance(probe, LeaseGrant | LeaseDenied):
            errors += isinstance(probe, Error)
            assert fuzzer.poll(5000)
            probe = receive(fuzzer)[1]
        drain(0.05)
    finally:
        context.destroy(linger=0)
        stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive()
    rejected = service.counters.rejected
    assert set(rejected) <= KNOWN_REASONS, rejected  # no internal_error: nothing crashed
    assert len(rejected) >= 12, rejected
    assert sum(rejected.values()) == errors + sent_errors, "every refusal counted once, by reason"
    assert errors > 5_000
    assert_ledgers_finite(service)


# --- resume after a learner crash (docs/architecture.md, "Resume after a crash") ---------------------------------


def session_request(service: ReplayService, version: int, session: int, checkpoint: int, max_tokens: int = 10**6):
    request = BatchRequest(learner_id="learner", msg_id=7, policy_version=version, max_tokens=max_tokens, min_items=1,
                           max_wait_s=0.0, session=session, checkpoint=checkpoint)
    replies = service.handle(LEARNER, request, 0.0)
    assert len(replies) <= 1
    return replies[0][1] if replies else None


def surviving_credit(lineage: list[tuple[int, list[TrainItem]]]) -> dict[tuple[str, int, int], float]:
    credit: dict[tuple[str, int, int], float] = {}
    for _, items in lineage:
        for item in items:
            member = int(item.trajectory_id.split("/")[1])
            for k, a in stage_credit(item).items():
                credit[(item.group_id, member, k)] = credit.get((item.group_id, member, k), 0.0) + a
    return credit


@pytest.mark.parametrize("seed", range(12))
def test_a_learner_that_resumes_from_its_checkpoint_is_rolled_back_exactly(seed):
    """Random interleavings of records, outcomes and learner steps; the learner checkpoints every 2, 3 or 5
    versions (after the ack) and is killed once at a random point, then resumes from its last checkpoint. In the
    surviving lineage (what the checkpoint trained, then what the resumed learner trained) every item is trained at
    most once and every stage's credit sums to A_final; every group closes."""
    rng = random.Random(seed)
    config = make_config(algo={"max_staleness": 100, "max_correction_staleness": 100},
                         learner={"checkpoint_every": 2})
    service, worker = build_service(config), Worker()
    grants = [lease(service, worker) for _ in range(3)]
    pending = [m for grant in grants for m in stage_records(worker, grant)]
    outcomes = [m for grant in grants for m in outcome_messages(worker, grant)]
    lineage: list[tuple[int, list[TrainItem]]] = []  # (version after the step, items) of the surviving lineage
    version, checkpoint, session, killed = 0, -1, 1, False
    kill_at, every = rng.randrange(1, 12), rng.choice([2, 3, 5])
    for _ in range(400):
        batches = []  # a parked request is answered when a worker's message brings items
        if pending and rng.random() < 0.6:
            batches += send_all(service, [pending.pop(rng.randrange(min(3, len(pending))))])
        elif not pending and outcomes and rng.random() < 0.5:
            batches += send_all(service, [outcomes.pop(rng.randrange(len(outcomes)))])
        if not batches:
            batches = [session_request(service, version, session, checkpoint, max_tokens=rng.choice([20, 40, 80]))]
        if batches == [None]:
            if not pending and not outcomes and len(service.queue) == 0:
                if killed:
                    break
                kill_at = version  # nothing left: the crash comes now, after the last ack
            else:
                continue
        else:
            (batch,) = batches
            assert isinstance(batch, Batch), batch
            version += 1
            lineage.append((version, batch.items))
            assert isinstance(ack_batch(service, batch, version), Ack)
        died_before_save = not killed and version == kill_at and rng.random() < 0.5
        if version % every == 0 and not died_before_save:
            checkpoint = version
        if not killed and version == kill_at:  # SIGKILL: what was trained after the checkpoint dies with it
            killed, session = True, 2
            lineage = [(v, items) for v, items in lineage if v <= max(checkpoint, 0)]
            version = max(checkpoint, 0)
    else:
        pytest.fail("the run did not finish")
    session_request(service, version, session, version)  # the final checkpoint, reported
    stats = service.stats_snapshot()
    assert killed, (version, kill_at)
    assert stats.groups_closed == 3 and not service.groups and len(service.queue) == 0, (stats, service.groups)
    ids = [item.item_id for _, items in lineage for item in items]
    assert len(ids) == len(set(ids)), "an item trained twice in the surviving lineage"
    expected = expected_final_credit(config)
    trained = surviving_credit(lineage)
    for grant in grants:
        for (i, k), a_final in expected.items():
            assert math.isclose(trained.get((grant.group_id, i, k), 0.0), a_final, abs_tol=1e-9), (grant, i, k)
    assert service.counters.ledger_residual_max < 1e-9


def test_a_resume_below_or_above_the_reported_checkpoint_is_refused():
    config = make_config(learner={"checkpoint_every": 2})
    service, worker = build_service(config), Worker()
    first = lease(service, worker)
    send_all(service, stage_records(worker, first))
    ack_batch(service, session_request(service, 0, 1, -1), 1)  # first's immediates
    send_all(service, outcome_messages(worker, first))
    ack_batch(service, session_request(service, 1, 1, -1), 2)  # its corrections; then checkpoint v2
    second = lease(service, worker)
    send_all(service, stage_records(worker, second))
    ack_batch(service, session_request(service, 2, 1, 2), 3)  # reports v2 durable; second's immediates at v3
    assert service.checkpointed == 2 and service.policy_version == 3
    assert service.stats_snapshot().groups_closed == 1  # first: all its acks are at or below the checkpoint
    for wrong in (0, 1):  # below the reported checkpoint: the acks at 1 and 2 are final
        error = session_request(service, wrong, 2, wrong)
        assert isinstance(error, Error) and "bad_resume" in error.detail, error
    assert service.policy_version == 3 and service.counters.rollbacks == 0
    batch = session_request(service, 2, 2, 2)  # the resume at the checkpoint: second's immediates come back
    assert isinstance(batch, Batch) and {item.group_id for item in batch.items} == {second.group_id}
    assert service.counters.rollbacks == 1 and service.counters.items_rolled_back == len(batch.items)
    assert service.policy_version == 2
    error = session_request(service, 2, 1, 2)  # the dead process's session: older than the resumed one
    assert isinstance(error, Error) and "old_session" in error.detail


def test_a_resume_above_the_reported_checkpoint_rolls_back_only_the_acks_above_it():
    """A learner reports the oldest checkpoint it keeps (its rollback point: a damaged newer one falls back to it);
    restarted at a newer checkpoint it still has, the replay takes back only the acks above that one's version,
    exactly: the ones between stay trained once."""
    config = make_config(learner={"checkpoint_every": 2})
    service, worker = build_service(config), Worker()
    first = lease(service, worker)
    send_all(service, stage_records(worker, first))
    ack_batch(service, session_request(service, 0, 1, -1), 1)  # first's immediates at v1
    second = lease(service, worker)
    send_all(service, stage_records(worker, second))
    ack_batch(service, session_request(service, 1, 1, -1), 2)  # second's immediates at v2; checkpoint v2
    send_all(service, outcome_messages(worker, first))
    ack_batch(service, session_request(service, 2, 1, 2), 3)  # first's corrections at v3
    third = lease(service, worker)
    send_all(service, stage_records(worker, third))
    ack_batch(service, session_request(service, 3, 1, 2), 4)  # third's immediates at v4; checkpoint v4, v2 kept
    send_all(service, outcome_messages(worker, third))
    ack_batch(service, session_request(service, 4, 1, 2), 5)  # third's corrections at v5
    assert service.checkpointed == 2 and service.policy_version == 5
    batch = session_request(service, 4, 2, 4)  # restarted at v4: only third's corrections (acked at v5) come back
    assert isinstance(batch, Batch) and {(item.group_id, item.kind) for item in batch.items} == {
        (third.group_id, "correction")}, batch
    assert service.counters.rollbacks == 1 and service.counters.items_rolled_back == len(batch.items)
    assert service.policy_version == 4 and service.checkpointed == 4
    error = session_request(service, 2, 3, 2)  # below the checkpoint it reported since: refused
    assert isinstance(error, Error) and "bad_resume" in error.detail, error


def test_without_learner_checkpoints_a_restart_below_the_acked_version_is_refused():
    service, worker = build_service(make_config(learner={"checkpoint_every": 0})), Worker()
    grant = lease(service, worker)
    send_all(service, stage_records(worker, grant))
    batch = session_request(service, 0, 1, -1)
    ack_batch(service, batch, 1)
    error = session_request(service, 0, 2, -1)
    assert isinstance(error, Error) and "checkpoint_every 0" in error.detail


def test_a_restarted_worker_s_old_leases_are_abandoned_at_once():
    service = build_service(make_config())
    grant = only_reply(service.handle(WORKER, LeaseRequest(worker_id="worker-0", msg_id=1, session=10), 0.0))
    assert isinstance(grant, LeaseGrant)
    service.handle(WORKER, Heartbeat(worker_id="worker-0", session=10), 1.0)
    assert not service.groups[grant.group_id].ledger.abandoned
    service.handle(WORKER, Heartbeat(worker_id="worker-0", session=5), 2.0)  # a late message of an older process
    assert not service.groups[grant.group_id].ledger.abandoned
    service.handle(WORKER, Heartbeat(worker_id="worker-0", session=20), 3.0)  # the restarted process
    assert service.counters.workers_restarted == 1
    assert grant.group_id not in service.groups  # every member abandoned: the group closed with nothing trained
    assert service.counters.trajectories_abandoned == 4


def test_a_rollback_past_a_group_s_immediates_finalizes_it_again():
    """Immediates acked at v1, the group finalized, its corrections acked at v2, no checkpoint yet: the learner
    restarts at version 0. Both acks are undone, the corrections are withdrawn and the group is finalized again:
    its new corrections carry all of A_final (issued is back to 0), trained once."""
    config = make_config(learner={"checkpoint_every": 2})
    service, worker = build_service(config), Worker()
    grant = lease(service, worker)
    send_all(service, stage_records(worker, grant))
    immediates = session_request(service, 0, 1, -1)
    assert {item.kind for item in immediates.items} == {"immediate"}
    ack_batch(service, immediates, 1)
    send_all(service, outcome_messages(worker, grant))
    old_corrections = session_request(service, 1, 1, -1)
    ack_batch(service, old_corrections, 2)
    assert service.groups, "acked above the checkpoint: the group stays open"
    batch = session_request(service, 0, 2, -1)  # the learner restarted with no checkpoint: version 0
    assert service.counters.rollbacks == 1 and service.counters.items_rolled_back == len(immediates.items) + len(
        old_corrections.items)
    assert {item.kind for item in batch.items} == {"correction"}
    assert not {item.item_id for item in batch.items} & {item.item_id for item in old_corrections.items}
    trained = surviving_credit([(1, batch.items)])
    for (i, k), a_final in expected_final_credit(config).items():
        assert math.isclose(trained.get((grant.group_id, i, k), 0.0), a_final, abs_tol=1e-9), (i, k)
    ack_batch(service, batch, 1)
    assert service.groups  # not yet: the ack at v1 is above the checkpoint
    session_request(service, 1, 2, 1)  # checkpoint v1 reported
    assert not service.groups and service.stats_snapshot().groups_closed == 1
    assert service.counters.ledger_residual_max < 1e-9


def test_admission_after_a_rollback_counts_the_versions_it_took_back_as_steps():
    """The groups admitted for versions the dead learner reached are in the system already; the resumed learner
    may retrain their items in fewer steps, so admission must not wait for it to reach that version again (a
    real run stalled so: tests/test_faults.py)."""
    config = make_config(learner={"checkpoint_every": 2}, algo={"groups_per_step": 1, "max_staleness": 0})
    service, worker = build_service(config), Worker()
    grant = lease(service, worker)
    send_all(service, stage_records(worker, grant))
    ack_batch(service, session_request(service, 0, 1, -1), 1)
    assert isinstance(session_request(service, 0, 2, -1), Batch)  # restarted at 0: rolled back, items re-served
    assert service.policy_version == 0
    assert isinstance(lease(service, worker), LeaseGrant)  # 2 groups <= (1 + 0 + 1) x 1, as before the crash
    denied = only_reply(service.handle(WORKER, worker.lease(), 0.0))
    assert isinstance(denied, LeaseDenied) and denied.reason == "staleness"


def test_a_rounds_acks_to_one_peer_go_as_one_acks_message_in_place_of_the_first():
    """Protocol 7: a worker with a stage record and an outcome acked in one round gets one Acks (duplicates named);
    a peer with one Ack (the learner's BatchAck) gets it as it is; every other reply keeps its place."""
    from async_rl.protocol import Acks, decode
    from replay.server import coalesce_acks

    grant = LeaseGrant(msg_id=9, group_id="g1", group_size=2, policy_version=0)
    replies = [(b"w0", Ack(msg_id=1)), (b"learner", Ack(msg_id=5)), (b"w0", grant),
               (b"w0", Ack(msg_id=2, duplicate=True)), (b"w1", Ack(msg_id=7))]
    assert coalesce_acks(replies) == [(b"w0", Acks(msg_ids=[1, 2], duplicates=[2])), (b"learner", Ack(msg_id=5)),
                                      (b"w0", grant), (b"w1", Ack(msg_id=7))]
    single = [(b"w0", Ack(msg_id=1)), (b"w0", grant)]
    assert coalesce_acks(single) == single
    message = Acks(msg_ids=[1, 2], duplicates=[2])
    assert decode(encode(message)) == message
