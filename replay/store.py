"""Trajectory token storage and training-item assembly.

The replay service keeps, per trajectory, the tokens each stage record brought (observation, action, behaviour
log-probs, per-token policy versions). A training item is a trajectory prefix with advantages on the action
tokens of some of its stages: one stage for an immediate item, the corrected stages for a correction.
Items are assembled once, when they are queued, so a queued item does not depend on its group staying in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from async_rl.protocol import ADVANTAGE, LOGPROB, MASK, TOKEN, StageRecord, TrainItem, unpack


@dataclass(slots=True)
class StageTokens:
    """One stage's arrays as they came off the wire, packed. Kept as bytes, not numpy views: a view's header
    (~100 bytes each, four per stage) outweighs a short stage's tokens (benchmarks/systems.py, replay memory)."""

    observation: bytes  # int32, never trained
    action: bytes  # int32
    logprobs: bytes  # float32, log mu(a) per action token
    versions: bytes  # int32, v_b per action token
    oldest_version: int  # min(versions): what staleness is measured against

    @classmethod
    def from_record(cls, record: StageRecord) -> StageTokens:
        return cls(
            record.observation_tokens, record.action_tokens, record.behaviour_logprobs, record.policy_versions,
            int(record.versions().min()),
        )


@dataclass(slots=True)
class Trajectory:
    trajectory_id: str
    member: int
    stages: dict[int, StageTokens] = field(default_factory=dict)
    prefix_length: int = 0  # stages 0..prefix_length-1 are all stored (resends may arrive out of order)
    num_tokens: int = 0  # observation + action tokens of the stored stages (bounded by model.max_seq_len)

    def add(self, k: int, stage: StageTokens) -> None:
        self.stages[k] = stage
        self.num_tokens += (len(stage.observation) + len(stage.action)) // TOKEN.itemsize
        while self.prefix_length in self.stages:
            self.prefix_length += 1

    def has_prefix_through(self, k: int) -> bool:
        return self.prefix_length > k


@dataclass(slots=True)
class QueuedItem:
    """A training item plus what the ledger needs when it is trained, skipped or dropped."""

    item: TrainItem
    member: int
    credit: dict[int, float]  # stage k -> the advantage its action tokens carry (A_imm or C)
    oldest_version: int  # the oldest policy version among the trained tokens
    num_tokens: int

    @property
    def item_id(self) -> int:
        return self.item.item_id

    @property
    def group_id(self) -> str:
        return self.item.group_id

    @property
    def kind(self) -> Literal["immediate", "correction"]:
        return self.item.kind


def assemble_item(
    item_id: int,
    kind: Literal["immediate", "correction"],
    group_id: str,
    trajectory: Trajectory,
    through_stage: int,
    credit: dict[int, float],
) -> QueuedItem:
    """Stages 0..through_stage concatenated (obs_0, act_0, ..., obs_k, act_k); the loss mask, advantages,
    behaviour log-probs and versions are set on the action tokens of the stages in `credit`, 0 elsewhere."""
    stages = [trajectory.stages[k] for k in range(through_stage + 1)]
    tokens = b"".join(part for stage in stages for part in (stage.observation, stage.action))
    n = len(tokens) // TOKEN.itemsize
    mask = np.zeros(n, MASK)
    advantages = np.zeros(n, ADVANTAGE)
    logprobs = np.zeros(n, LOGPROB)
    versions = np.zeros(n, TOKEN)
    oldest_version = None
    offset = 0
    for k, stage in enumerate(stages):
        start = offset + len(stage.observation) // TOKEN.itemsize
        offset = start + len(stage.action) // TOKEN.itemsize
        if k not in credit:
            continue
        mask[start:offset] = 1
        advantages[start:offset] = credit[k]
        logprobs[start:offset] = unpack(stage.logprobs, LOGPROB)
        versions[start:offset] = unpack(stage.versions, TOKEN)
        oldest_version = stage.oldest_version if oldest_version is None else min(oldest_version, stage.oldest_version)
    assert oldest_version is not None, "an item must train at least one stage"
    item = TrainItem(
        item_id=item_id,
        kind=kind,
        group_id=group_id,
        trajectory_id=trajectory.trajectory_id,
        tokens=tokens,
        loss_mask=mask.tobytes(),
        advantages=advantages.tobytes(),
        behaviour_logprobs=logprobs.tobytes(),
        policy_versions=versions.tobytes(),
    )
    return QueuedItem(item, trajectory.member, dict(credit), oldest_version, n)
