"""Wire protocol: every message round-trips; malformed bytes only ever raise ProtocolError."""

import random

import msgspec
import numpy as np
import pytest

from async_rl.errors import ProtocolError
from async_rl.protocol import (
    ADVANTAGE,
    LOGPROB,
    MASK,
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
    WeightsPublished,
    decode,
    encode,
    pack,
    value_problem,
)


def stage_record(**changes) -> StageRecord:
    fields = dict(
        msg_id=7, worker_id="rollout-0", group_id="g3", trajectory_id="g3/1", member=1, task_id="5", stage_index=2,
        observation_tokens=pack([4, 9, 11], TOKEN), action_tokens=pack([20, 21], TOKEN),
        behaviour_logprobs=pack([-0.5, -1.25], LOGPROB), policy_versions=pack([3, 4], TOKEN),
        stage_reward=1.0, terminal=False,
    )
    fields.update(changes)
    return StageRecord(**fields)


def train_item(**changes) -> TrainItem:
    fields = dict(
        item_id=1, kind="correction", group_id="g3", trajectory_id="g3/1", tokens=pack([1, 2, 3], TOKEN),
        loss_mask=pack([0, 1, 1], MASK), advantages=pack([0.0, 0.25, -1.5], ADVANTAGE),
        behaviour_logprobs=pack([0.0, -0.1, -0.2], LOGPROB), policy_versions=pack([0, 2, 2], TOKEN),
    )
    fields.update(changes)
    return TrainItem(**fields)


ALL_MESSAGES = [
    LeaseRequest(worker_id="rollout-0", msg_id=1),
    LeaseGrant(msg_id=1, group_id="g0", group_size=8, policy_version=2),
    LeaseDenied(msg_id=1, reason="staleness", retry_after_s=0.05, policy_version=2),
    stage_record(),
    stage_record(stage_reward=None, terminal=True),
    Outcome(msg_id=2, worker_id="rollout-0", group_id="g0", trajectory_id="g0/0", member=0, num_stages=3, outcome=1.0,
            success=True),
    Outcome(msg_id=3, worker_id="rollout-0", group_id="g0", trajectory_id="g0/1", member=1, num_stages=1,
            outcome=None, abandoned=True, reason="server died"),
    Heartbeat(worker_id="rollout-0", group_ids=["g0", "g1"]),
    EvalReport(worker_id="rollout-0", msg_id=6, policy_version=3, metrics={"eval_success_rate": 0.5}),
    Ack(msg_id=9, duplicate=True),
    BatchRequest(learner_id="learner-0", msg_id=4, policy_version=5, max_tokens=4096, min_items=8, max_wait_s=0.5),
    Batch(msg_id=4, batch_id=11, items=[train_item()], stats=ReplayStats(env_steps=100, success_rate=0.5)),
    BatchAck(learner_id="learner-0", msg_id=5, batch_id=11, policy_version=6),
    BatchAck(learner_id="learner-0", msg_id=5, batch_id=11, policy_version=6, trained=False),
    Batch(msg_id=4, batch_id=12, items=[], stats=ReplayStats(rejected={"nonfinite_reward": 3, "too_long": 1})),
    WeightsPublished(version=6, path="/runs/x/weights/v6.safetensors"),
    Error(msg_id=-1, code="malformed", detail="truncated"),
]


@pytest.mark.parametrize("message", ALL_MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    assert decode(encode(message)) == message


def test_packed_arrays_are_little_endian_and_typed():
    record = stage_record()
    assert record.action_tokens == b"\x14\x00\x00\x00\x15\x00\x00\x00"
    np.testing.assert_array_equal(record.action_ids(), [20, 21])
    np.testing.assert_array_equal(record.versions(), [3, 4])
    np.testing.assert_allclose(record.logprobs(), [-0.5, -1.25])
    item = train_item()
    assert item.advantage_values().dtype == np.float64
    np.testing.assert_array_equal(item.mask(), [0, 1, 1])


def test_token_ids_do_not_travel_as_lists():
    raw = msgspec.msgpack.decode(encode(stage_record()))
    assert isinstance(raw["action_tokens"], bytes)
    assert isinstance(raw["behaviour_logprobs"], bytes)


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"behaviour_logprobs": pack([-0.5], LOGPROB)}, "behaviour_logprobs: expected one per action token"),
        ({"policy_versions": pack([1, 2, 3], TOKEN)}, "policy_versions: expected one per action token"),
        ({"action_tokens": b"\x01\x02\x03"}, "not a whole number"),
        ({"action_tokens": b""}, "at least one action token"),
    ],
)
def test_inconsistent_stage_records_are_rejected_on_decode(changes, problem):
    raw = msgspec.msgpack.decode(encode(stage_record()))
    raw.update(changes)
    with pytest.raises(ProtocolError, match=problem):
        decode(msgspec.msgpack.encode(raw))


def test_other_protocol_versions_are_rejected():
    raw = msgspec.msgpack.decode(encode(Ack(msg_id=1)))
    raw["protocol"] = PROTOCOL_VERSION + 1
    with pytest.raises(ProtocolError, match="protocol version"):
        decode(msgspec.msgpack.encode(raw))


def test_unknown_message_type_is_rejected():
    with pytest.raises(ProtocolError, match="malformed"):
        decode(msgspec.msgpack.encode({"type": "launch_missiles", "protocol": PROTOCOL_VERSION}))


def _mutate(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        op = rng.random()
        if op < 0.4 and buf:
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        elif op < 0.6 and buf:
            del buf[rng.randrange(len(buf)):][: rng.randint(1, 16)]
        elif op < 0.8:
            pos = rng.randrange(len(buf) + 1)
            buf[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        else:
            buf = buf[: rng.randrange(len(buf) + 1)]
    return bytes(buf)


def test_ten_thousand_fuzzed_messages_raise_only_protocol_errors():
    rng = random.Random(1234)
    seeds = [encode(m) for m in ALL_MESSAGES]
    decoded = rejected = 0
    for n in range(10_000):
        if n % 10 == 0:
            data = bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
        else:
            data = _mutate(rng.choice(seeds), rng)
        try:
            decode(data)
            decoded += 1
        except ProtocolError:
            rejected += 1
    assert decoded + rejected == 10_000
    assert rejected > 5_000  # most mutations must be caught, and caught as ProtocolError


# --- values at the edge (protocol.value_problem) -----------------------------------------------------------


def outcome(**changes) -> Outcome:
    fields = dict(msg_id=2, worker_id="rollout-0", group_id="g0", trajectory_id="g0/0", member=0, num_stages=3,
                  outcome=1.0)
    fields.update(changes)
    return Outcome(**fields)


def batch_request(**changes) -> BatchRequest:
    fields = dict(learner_id="learner-0", msg_id=4, policy_version=5, max_tokens=4096, min_items=8, max_wait_s=0.5)
    fields.update(changes)
    return BatchRequest(**fields)


NAN, INF = float("nan"), float("inf")
HOSTILE = [
    (stage_record(stage_reward=NAN), "nonfinite_reward"),
    (stage_record(stage_reward=-INF), "nonfinite_reward"),
    (stage_record(behaviour_logprobs=pack([-0.5, NAN], LOGPROB)), "bad_logprob"),
    (stage_record(behaviour_logprobs=pack([-0.5, 0.5], LOGPROB)), "bad_logprob"),
    (stage_record(behaviour_logprobs=pack([-0.5, -INF], LOGPROB)), "bad_logprob"),
    (stage_record(policy_versions=pack([-1, 4], TOKEN)), "bad_version"),
    (stage_record(action_tokens=pack([20, -3], TOKEN)), "bad_token"),
    (stage_record(observation_tokens=pack([-1], TOKEN)), "bad_token"),
    (outcome(outcome=NAN), "nonfinite_outcome"),
    (outcome(outcome=INF), "nonfinite_outcome"),
    (outcome(member=-1), "bad_member"),
    (outcome(num_stages=0), "bad_num_stages"),
    (outcome(num_stages=-2, outcome=None, abandoned=True), "bad_num_stages"),
    (batch_request(policy_version=2**40), "bad_version"),
    (batch_request(policy_version=-1), "bad_version"),
    (batch_request(max_tokens=0), "bad_request"),
    (batch_request(min_items=-1), "bad_request"),
    (batch_request(max_wait_s=NAN), "bad_request"),
    (batch_request(max_wait_s=1e9), "bad_request"),
    (BatchAck(learner_id="learner-0", msg_id=5, batch_id=1, policy_version=2**40), "bad_version"),
    (EvalReport(worker_id="w", msg_id=6, policy_version=3, metrics={"eval_success_rate": NAN}), "nonfinite_metric"),
]


@pytest.mark.parametrize(("message", "reason"), HOSTILE, ids=[reason for _, reason in HOSTILE])
def test_hostile_values_are_named_by_value_problem(message, reason):
    assert decode(encode(message)) is not None  # well-formed on the wire: the values are what is wrong
    problem = value_problem(message)
    assert problem is not None and problem[0] == reason, problem


def test_ordinary_values_pass_value_problem():
    for message in ALL_MESSAGES:
        assert value_problem(message) is None, message
    assert value_problem(stage_record(behaviour_logprobs=pack([-0.5, 5e-5], LOGPROB))) is None, "float error"
    assert value_problem(outcome(num_stages=0, outcome=None, abandoned=True)) is None, "abandoned before a stage"


def test_a_weights_format_name_is_free_text_but_bounded():
    """A format no receiver knows still decodes (the worker refuses it by name, tests/test_weights.py); a name
    over 64 characters, which the worker would write into its log, is malformed."""
    from async_rl.protocol import WeightsPublished

    assert decode(encode(WeightsPublished(3, "w", "lora-adapter"))).format == "lora-adapter"
    with pytest.raises(ProtocolError, match="length <= 64"):
        decode(encode(WeightsPublished(3, "w", "x" * 65)))
