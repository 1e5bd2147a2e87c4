"""The wire protocol: every message the pods exchange, and nothing else.

Read this file to learn the whole system. msgspec Structs form one tagged union (`type` field) encoded as
MessagePack. Token ids and log-probs travel as packed little-endian arrays (bytes), never as lists of
Python ints; typed accessors unpack them. Every message carries `protocol`; `decode` turns anything
malformed or of another protocol version into `ProtocolError` and never raises anything else.

Sockets (endpoints come from the config):
  rollout worker  DEALER -> replay ROUTER   LeaseRequest, StageRecord, Outcome, Heartbeat, EvalReport
                                            (replies: Ack or Acks, LeaseGrant, LeaseDenied)
  learner         DEALER -> replay ROUTER   BatchRequest, BatchAck                         (replies: Batch, Ack)
  learner         PUB    -> rollout SUB     WeightsPublished
Any peer may receive `Error` in reply to a message the replay service could not accept.

Values are checked at the edge: `value_problem` names what is out of range in a message that decoded (a NaN
reward, a positive log-prob, a negative member, ...) without needing any state; the replay service runs it on
every message before anything is stored, and adds the checks that need its state (versions ahead of the learner,
trajectories longer than `model.max_seq_len`). Every rejection is counted by reason in `ReplayStats.rejected`.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec
import numpy as np

from async_rl.errors import ProtocolError

# 2: tasks belong to the rollout side (string ids), outcomes carry success
# 3: ReplayStats.rejected (counts by reason); BatchAck.trained (False: the learner skipped a non-finite step)
# 4: resume after a crash: BatchRequest.session/checkpoint, LeaseRequest/Heartbeat.session, ReplayStats.rollbacks
# 5: TrainItem.first_trained (algo.entropy_per=first-train)
# 6: TrainItem.first_trained removed (with the first-train rule)
# 7: Acks (a round's acks to one peer in one message)
PROTOCOL_VERSION = 7

TOKEN = np.dtype("<i4")  # token ids and policy versions
LOGPROB = np.dtype("<f4")  # behaviour log-probabilities
ADVANTAGE = np.dtype("<f8")  # advantages: the credit ledger is exact in float64
MASK = np.dtype("u1")


def pack(values, dtype: np.dtype) -> bytes:
    """Pack a sequence (list, numpy array or CPU tensor) into little-endian bytes of `dtype`."""
    return np.ascontiguousarray(np.asarray(values), dtype=dtype).tobytes()


def unpack(buffer: bytes, dtype: np.dtype) -> np.ndarray:
    return np.frombuffer(buffer, dtype=dtype)


def _count(buffer: bytes, dtype: np.dtype, name: str) -> int:
    if len(buffer) % dtype.itemsize:
        raise ValueError(f"{name}: {len(buffer)} bytes is not a whole number of {dtype.itemsize}-byte items")
    return len(buffer) // dtype.itemsize


class Message(msgspec.Struct, tag_field="type", kw_only=True, forbid_unknown_fields=True):
    protocol: int = PROTOCOL_VERSION


# --- rollout -> replay ---------------------------------------------------------------------------


class LeaseRequest(Message, tag="lease_request"):
    """A worker asks to start a new group (admission, docs/algorithm.md, "Staleness")."""

    worker_id: str
    msg_id: int
    # The worker process (0: not told). A new session under a known worker id is a restarted worker: the replay
    # abandons what the previous process held at once instead of waiting for replay.lease_timeout_s.
    session: int = 0


class LeaseGrant(Message, tag="lease_grant"):
    """Start `group_size` trajectories of one task (the worker draws it from its environment) as `group_id`."""

    msg_id: int
    group_id: str
    group_size: int
    policy_version: int  # the learner's version when the lease was granted


class LeaseDenied(Message, tag="lease_denied"):
    msg_id: int
    reason: Literal["staleness", "budget", "draining"]
    retry_after_s: float
    policy_version: int


class StageRecord(Message, tag="stage_record"):
    """One stage of one trajectory, sent the moment it completes. Only new tokens travel."""

    msg_id: int
    worker_id: str
    group_id: str
    trajectory_id: str
    member: int  # index of the trajectory in its group, 0..G-1
    task_id: str  # the environment's task id (the same for every member of a group)
    stage_index: int  # k, from 0
    observation_tokens: bytes  # int32: the environment's text before this stage's action (never trained)
    action_tokens: bytes  # int32: what the policy generated
    behaviour_logprobs: bytes  # float32, one per action token: log mu(a)
    policy_versions: bytes  # int32, one per action token: v_b of the weights that produced it
    stage_reward: float | None  # r[i,k]; None = absent
    terminal: bool  # True on the trajectory's last stage

    def __post_init__(self) -> None:
        if self.member < 0 or self.stage_index < 0:
            raise ValueError("member and stage_index must be >= 0")
        n = _count(self.action_tokens, TOKEN, "action_tokens")
        _count(self.observation_tokens, TOKEN, "observation_tokens")
        if n == 0:
            raise ValueError("action_tokens: a stage must have at least one action token")
        if _count(self.behaviour_logprobs, LOGPROB, "behaviour_logprobs") != n:
            raise ValueError("behaviour_logprobs: expected one per action token")
        if _count(self.policy_versions, TOKEN, "policy_versions") != n:
            raise ValueError("policy_versions: expected one per action token")

    def action_ids(self) -> np.ndarray:
        return unpack(self.action_tokens, TOKEN)

    def observation_ids(self) -> np.ndarray:
        return unpack(self.observation_tokens, TOKEN)

    def logprobs(self) -> np.ndarray:
        return unpack(self.behaviour_logprobs, LOGPROB)

    def versions(self) -> np.ndarray:
        return unpack(self.policy_versions, TOKEN)


class Outcome(Message, tag="outcome"):
    """A trajectory's final reward R_i, or its abandonment (worker or server failure)."""

    msg_id: int
    worker_id: str
    group_id: str
    trajectory_id: str
    member: int
    num_stages: int  # how many stage records this trajectory sent
    outcome: float | None  # the judgement's score R_i (None when abandoned)
    success: bool = False  # the judgement says solved (the success windows and the stop rule count these)
    abandoned: bool = False
    reason: str = ""  # why it was abandoned; "env_error: ..." when the environment plugin failed


class EvalReport(Message, tag="eval_report"):
    """An evaluation of the policy during training (`run.eval_every`); the replay passes it to the learner's
    metrics line in `ReplayStats.eval_metrics`."""

    worker_id: str
    msg_id: int
    policy_version: int
    metrics: dict[str, float]


class Heartbeat(Message, tag="heartbeat"):
    """Keeps a worker's leases alive (and tells the replay service it is there)."""

    worker_id: str
    group_ids: list[str] = []
    session: int = 0  # as in LeaseRequest


class Ack(Message, tag="ack"):
    msg_id: int
    duplicate: bool = False  # the record was already stored (a resend): acknowledged, not counted twice


class Acks(Message, tag="acks"):
    """Two or more Acks to one peer from one replay round, in one message: a worker that streams a stage record and
    an outcome per trajectory gets one reply a round instead of one per record (a send, a receive and a decode
    each, on both sides)."""

    msg_ids: list[int]
    duplicates: list[int] = []  # those of msg_ids already stored (resends): acknowledged, not counted twice


# --- learner <-> replay --------------------------------------------------------------------------


class BatchRequest(Message, tag="batch_request"):
    learner_id: str
    msg_id: int
    policy_version: int  # the version the batch will be trained at
    max_tokens: int  # token budget: padded length x items
    min_items: int
    max_wait_s: float
    # The learner process (0: not told). The first request of a new session is a (re)started learner: batches in
    # flight to the previous one are requeued, and if it comes back at a version below what the replay saw acked,
    # the replay rolls back to it (docs/architecture.md, "Resume after a crash").
    session: int = 0
    checkpoint: int = -1  # the version of the learner's latest durable checkpoint (-1: none)


class TrainItem(Message, tag="train_item"):
    """One sequence to train: a trajectory prefix, with advantages on the action tokens of some stages."""

    item_id: int
    kind: Literal["immediate", "correction"]
    group_id: str
    trajectory_id: str
    tokens: bytes  # int32, the whole sequence
    loss_mask: bytes  # uint8, 1 on trained action tokens
    advantages: bytes  # float64 per token (0 off the mask): A_imm or C
    behaviour_logprobs: bytes  # float32 per token (0 off the mask)
    policy_versions: bytes  # int32 per token (0 off the mask)

    def __post_init__(self) -> None:
        n = _count(self.tokens, TOKEN, "tokens")
        if n == 0:
            raise ValueError("tokens: an item must have at least one token")
        for name, dtype in (
            ("loss_mask", MASK),
            ("advantages", ADVANTAGE),
            ("behaviour_logprobs", LOGPROB),
            ("policy_versions", TOKEN),
        ):
            if _count(getattr(self, name), dtype, name) != n:
                raise ValueError(f"{name}: expected one per token ({n})")

    def token_ids(self) -> np.ndarray:
        return unpack(self.tokens, TOKEN)

    def num_tokens(self) -> int:
        """len(token_ids()) without building the array (the learner plans every batch by lengths)."""
        return len(self.tokens) // TOKEN.itemsize

    def mask(self) -> np.ndarray:
        return unpack(self.loss_mask, MASK)

    def advantage_values(self) -> np.ndarray:
        return unpack(self.advantages, ADVANTAGE)

    def logprobs(self) -> np.ndarray:
        return unpack(self.behaviour_logprobs, LOGPROB)

    def versions(self) -> np.ndarray:
        return unpack(self.policy_versions, TOKEN)


class ReplayStats(Message, tag="replay_stats"):
    """What the replay service knows that the learner's metrics line needs (cumulative unless noted)."""

    env_steps: int = 0
    trajectories_finished: int = 0
    success_rate: float = 0.0  # over the last replay.success_window finished trajectories
    success_rate_long: float = 0.0  # over the last replay.long_success_window (the stop rule uses this one)
    stage_reward_mean: float = 0.0  # over the same window, per stage
    groups_started: int = 0
    groups_closed: int = 0
    groups_empty: int = 0  # ended with nothing trained (no item, or all went stale); not counted by admission
    immediate_skipped_stale: int = 0
    credit_dropped: int = 0  # stage credits lost to the correction bound
    correction_bound: int = 0  # the correction-staleness bound in use (algo.max_correction_staleness; auto: measured)
    ledger_residual_max: float = 0.0  # over groups closed since the previous batch
    items_queued: int = 0
    leases_denied: int = 0
    bad_messages: int = 0
    trajectories_abandoned: int = 0
    # stage records (and finished outcomes) for a member already abandoned: its lease expired or was given up while
    # its worker was frozen or cut off; acked as duplicates, nothing of them stored
    late_records: int = 0
    late_batch_acks: int = 0  # acks of batches requeued after replay.batch_ack_timeout_s, taken for their queued items
    groups_given_up: int = 0  # groups whose unfinished trajectories were abandoned at replay.max_open_groups
    env_errors: int = 0  # trajectories abandoned because the environment plugin raised or broke its contract
    immediate_superseded: int = 0  # queued immediate items replaced by their group's correction
    # immediate items whose group's outcomes all landed while they were on hold (algo.immediate_hold): never made,
    # their correction carries the credit in one update
    immediate_held_over: int = 0
    immediate_hold_s: float = 0.0  # the hold in use, seconds (-1: the finishing pace not known yet, items wait; 0: off)
    immediate_before_outcome: int = 0  # in this batch: immediate items served before their trajectory's outcome
    guard_holds: int = 0  # times the correction-staleness guard held the learner back (algo.correction_guard)
    guard_held_s: float = 0.0  # seconds a ready batch request was held by the guard, in all (a running hold too)
    guard_hold_running_s: float = 0.0  # of guard_held_s: the hold still running when these stats were taken
    guard_leases_denied: int = 0  # leases the guard refused: their corrections could not have been trained in time
    guard_abandoned: int = 0  # trajectories abandoned because their group held the learner replay.guard_abandon_s
    sync_rounds: int = 0  # lock-step rounds trained (algo.mode=sync)
    eval_metrics: dict[str, float] = {}  # the latest EvalReport's metrics (eval_version among them); {} if none
    rejected: dict[str, int] = {}  # messages refused, by reason (the metrics line has them as rejected_<reason>)
    rollbacks: int = 0  # learner restarts below the acked version, rolled back to its checkpoint
    items_rolled_back: int = 0  # trained items whose acks a rollback undid (requeued, trained again once)
    workers_restarted: int = 0  # rollout worker ids seen under a new session (their old leases were abandoned)
    closed_group_resends: int = 0  # records and outcomes for a group that had closed (resends): acked, not stored


class Batch(Message, tag="batch"):
    msg_id: int
    batch_id: int
    items: list[TrainItem]
    stats: ReplayStats


class BatchAck(Message, tag="batch_ack"):
    """Sent after the optimizer step: the batch's credit is now trained (ledger `issued`).

    `trained=False`: the learner refused the step (non-finite loss or gradient; the weights did not change), so
    none of the batch's credit was trained: the replay handles its items as if never served and then skipped
    (an immediate's credit goes to its correction; a correction's is dropped and counted, docs/algorithm.md)."""

    learner_id: str
    msg_id: int
    batch_id: int
    policy_version: int  # the version after the step
    trained: bool = True


# --- learner -> rollout --------------------------------------------------------------------------


class WeightsPublished(Message, tag="weights_published"):
    version: int
    path: str  # a file or directory on storage the workers can read; "" for the distributed path
    # How the weights travel (async_rl/weights/base.py FORMATS: "safetensors", "hf-dir", "distributed"); a string, so
    # that a receiver refuses one it cannot load by name (`loader_for`) rather than as a malformed message; a name
    # longer than 64 characters is malformed (it is written into the worker's log).
    format: Annotated[str, msgspec.Meta(max_length=64)] = "safetensors"


ErrorCode = Literal["malformed", "protocol_version", "unknown_group", "bad_state", "unauthorized"]


class Error(Message, tag="error"):
    """Reply to a message the replay service rejected (it is counted and logged, never fatal)."""

    msg_id: int
    code: ErrorCode
    detail: str


AnyMessage = (
    LeaseRequest
    | LeaseGrant
    | LeaseDenied
    | StageRecord
    | Outcome
    | Heartbeat
    | EvalReport
    | Ack
    | Acks
    | BatchRequest
    | Batch
    | BatchAck
    | WeightsPublished
    | Error
)

# --- values at the edge ---------------------------------------------------------------------------

MAX_VERSION = 2**31 - 1  # versions travel as int32 (TOKEN)
LOGPROB_SLACK = 1e-4  # a log-probability is <= 0; float error may leave it a hair above
MAX_WAIT_S = 3600.0  # a BatchRequest's max_wait_s above this is not a wait, it is a stall
MAX_MIN_ITEMS = 1_000_000


def _finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)


Problem = tuple[str, str] | None  # (reason, detail) of a value out of its range, or None


def _stage_record_problem(message: StageRecord) -> Problem:
    if not _finite(message.stage_reward):
        return "nonfinite_reward", f"stage_reward {message.stage_reward} is not finite"
    logprobs = message.logprobs()
    if not np.isfinite(logprobs).all():
        return "bad_logprob", "behaviour_logprobs: not finite"
    if logprobs.max() > LOGPROB_SLACK:
        return "bad_logprob", f"behaviour_logprobs: {float(logprobs.max())} > 0 is not a log-probability"
    versions = message.versions()
    if versions.min() < 0:
        return "bad_version", f"policy_versions: {int(versions.min())} < 0"
    for name, ids in (("action_tokens", message.action_ids()), ("observation_tokens", message.observation_ids())):
        if len(ids) and ids.min() < 0:
            return "bad_token", f"{name}: token id {int(ids.min())} < 0"
    return None


def _outcome_problem(message: Outcome) -> Problem:
    if message.member < 0:
        return "bad_member", f"member {message.member} < 0"
    if not _finite(message.outcome):
        return "nonfinite_outcome", f"outcome {message.outcome} is not finite"
    if message.num_stages < 0 or (not message.abandoned and message.num_stages == 0):
        return "bad_num_stages", f"num_stages {message.num_stages}: a finished trajectory has >= 1 stage"
    return None


def _version_problem(version: int) -> Problem:
    if not 0 <= version <= MAX_VERSION:
        return "bad_version", f"policy_version {version} out of [0, {MAX_VERSION}]"
    return None


def _eval_report_problem(message: EvalReport) -> Problem:
    problem = _version_problem(message.policy_version)
    if problem is None and not all(math.isfinite(value) for value in message.metrics.values()):
        problem = "nonfinite_metric", "metrics: a value is not finite"
    return problem


def _batch_request_problem(message: BatchRequest) -> Problem:
    problem = _version_problem(message.policy_version)
    if problem is None and message.max_tokens < 1:
        problem = "bad_request", f"max_tokens {message.max_tokens} < 1"
    if problem is None and not 0 <= message.min_items <= MAX_MIN_ITEMS:
        problem = "bad_request", f"min_items {message.min_items} out of [0, {MAX_MIN_ITEMS}]"
    if problem is None and not 0.0 <= message.max_wait_s <= MAX_WAIT_S:  # NaN fails too
        problem = "bad_request", f"max_wait_s {message.max_wait_s} out of [0, {MAX_WAIT_S}]"
    if problem is None and not -1 <= message.checkpoint <= message.policy_version:
        problem = "bad_version", f"checkpoint {message.checkpoint} out of [-1, policy_version]"
    return problem


def value_problem(message: Message) -> Problem:
    """(reason, detail) for a value out of its range in a message that decoded, or None.

    Only what needs no state: the replay service adds the checks that need its state (replay/edge.py).
    Reasons are short snake_case names; they key `ReplayStats.rejected`.
    """
    match message:
        case StageRecord():
            return _stage_record_problem(message)
        case Outcome():
            return _outcome_problem(message)
        case EvalReport():
            return _eval_report_problem(message)
        case BatchRequest():
            return _batch_request_problem(message)
        case BatchAck():
            return _version_problem(message.policy_version)
    return None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMessage)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(buffer: bytes) -> AnyMessage:
    """Decode one message; anything malformed raises `ProtocolError` (and nothing else)."""
    try:
        message = _decoder.decode(buffer)
    except (msgspec.MsgspecError, ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise ProtocolError(f"malformed message: {exc}") from None
    if message.protocol != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {message.protocol} is not supported (this build speaks {PROTOCOL_VERSION})"
        )
    return message
