"""The replay's parts decide and the service acts (issue 55): no part holds a way back into the service, and a part's
step yields its decisions (replay/decisions.py) for the service to carry out when it makes them."""

from __future__ import annotations

from collections.abc import Generator

from test_replay import (
    LEARNER,
    WORKER,
    Worker,
    lease,
    make_config,
    outcome_messages,
    request_batch,
    send_all,
    stage_records,
)

from async_rl.protocol import Ack, BatchAck, Error, LeaseGrant, LeaseRequest
from replay.decisions import Advance, Decision, GiveUp, Steps
from replay.server import build_service
from replay.service import ReplayService

COMPONENTS = {"edge", "guard", "rounds", "rollback", "leases", "serving", "admission"}


def parts_of(service: ReplayService) -> dict[str, object]:
    """The service's components (objects of a class of replay/), and the replay objects they hold in turn; msgspec
    Structs are data (the state's parts, the settings), not components."""
    found: dict[str, object] = {}
    todo = [(name, value) for name, value in vars(service).items()
            if type(value).__module__.startswith("replay.") and not hasattr(value, "__struct_fields__")]
    while todo:
        name, part = todo.pop(0)  # breadth first: a component is named as the service names it
        if any(part is known for known in found.values()) or part is service.state:
            continue
        found[name] = part
        todo += [(f"{name}.{attr}", value) for attr, value in vars(part).items()
                 if type(value).__module__.startswith("replay.") and not hasattr(value, "__struct_fields__")]
    return found


def held_values(part: object) -> list[tuple[str, object]]:
    """Every attribute of `part`, and the elements of the containers among them."""
    values = []
    for attr, value in vars(part).items():
        values.append((attr, value))
        if isinstance(value, dict):
            values += [(f"{attr}[{key!r}]", element) for key, element in value.items()]
        elif isinstance(value, list | tuple | set):
            values += [(f"{attr}[]", element) for element in value]
    return values


def test_no_replay_component_holds_a_callable_into_the_service():
    config = make_config(learner={"checkpoint_every": 1}, replay={"max_open_groups": 2})
    service, worker = build_service(config), Worker()
    grant = lease(service, worker)  # some traffic first: what the parts hold once they have served
    send_all(service, stage_records(worker, grant) + outcome_messages(worker, grant))
    assert request_batch(service, 0) is not None
    restored = build_service(config)
    restored.restore(service.state)  # the parts a snapshot's state is served with
    for service_now in (service, restored):
        parts = parts_of(service_now)
        assert set(parts) >= COMPONENTS, f"the walk missed a component: {sorted(parts)}"
        held = [(f"{name}.{attr}", value) for name, part in parts.items() for attr, value in held_values(part)]
        assert held, "the components hold something"
        callables = [path for path, value in held if callable(value) and not isinstance(value, type)]
        assert callables == [], f"replay components holding a callable: {callables}"
        back = [path for path, value in held if value is service_now]
        assert back == [], f"replay components holding the service: {back}"


def recorded(step: Steps, seen: list[Decision]) -> Generator:
    """`step` as it is, each decision it yields also noted in `seen` (for `ReplayService.carry_out` to run)."""
    try:
        decision = next(step)
        while True:
            seen.append(decision)
            decision = step.send((yield decision))
    except StopIteration as done:
        return done.value


def test_an_ack_yields_its_group_to_advance_and_the_service_finalizes_it():
    service, worker = build_service(make_config()), Worker()
    grant = lease(service, worker)
    send_all(service, stage_records(worker, grant))
    immediates = request_batch(service, 0)
    assert immediates is not None and immediates.items
    send_all(service, outcome_messages(worker, grant))
    group = service.groups[grant.group_id]
    assert not group.finalized, "an immediate is with the learner: A_final waits for its ack"
    ack = BatchAck(learner_id="learner", msg_id=9, batch_id=immediates.batch_id, policy_version=0)
    step = service.serving.batch_ack(ack)
    decision = next(step)
    assert decision == Advance(group) and not group.finalized, "the part decides; it does not act"
    service.advance(decision.group, 0.0)
    assert group.finalized and service.queue.corrections(), "the service acted: the corrections are queued"
    try:
        step.send(None)
        raise AssertionError("one group touched, one decision")
    except StopIteration as done:
        assert done.value == Ack(msg_id=9)


def test_a_refused_ack_is_a_problem_the_service_counts_and_answers():
    service = build_service(make_config())
    ack = BatchAck(learner_id="learner", msg_id=3, batch_id=12345, policy_version=0)
    seen: list[Decision] = []
    answer = service.carry_out(recorded(service.serving.batch_ack(ack), seen), 0.0)
    assert seen == [] and isinstance(answer, tuple) and answer[0] == "batch_not_in_flight"
    assert service.counters.rejected == {}, "the part only decides: counting and answering are the service's"
    [(peer, error)] = service.handle(LEARNER, ack, 0.0)
    assert peer == LEARNER and isinstance(error, Error) and error.code == "bad_state"
    assert error.detail.startswith("batch_not_in_flight: ") and service.counters.rejected == {"batch_not_in_flight": 1}


def test_a_full_lease_table_yields_the_idle_group_to_give_up_before_the_new_group_starts():
    service = build_service(make_config(replay={"max_open_groups": 2}))
    first = lease(service, Worker("stuck-0"), now=0.0)
    lease(service, Worker("stuck-1"), now=1.0)
    seen: list[Decision] = []
    step = service.leases.lease(LeaseRequest(worker_id="worker-0", msg_id=1), 5.0)
    grant = service.carry_out(recorded(step, seen), 5.0)
    assert seen == [GiveUp(seen[0].group)] and seen[0].group.group_id == first.group_id, "the idlest, once"
    assert isinstance(grant, LeaseGrant) and grant.group_id in service.groups
    assert service.counters.groups_given_up == 1 and first.group_id not in service.groups, "all abandoned: closed"
    assert service.leases.held("stuck-0") == [] and service.leases.held("worker-0") == [grant.group_id]


def test_a_part_s_step_does_nothing_until_the_service_runs_it():
    service = build_service(make_config(replay={"max_open_groups": 1}))
    lease(service, Worker("stuck"), now=0.0)
    service.leases.lease(LeaseRequest(worker_id="worker-0", msg_id=1), 5.0)  # made, never run
    assert service.counters.groups_started == 1 and service.counters.groups_given_up == 0
    assert len(service.handle(WORKER, LeaseRequest(worker_id="worker-0", msg_id=1), 5.0)) == 1
    assert service.counters.groups_started == 2 and service.counters.groups_given_up == 1
