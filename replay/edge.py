"""Validation at the edge against the replay's state: the learner's version ceiling, what a stage record may
carry (docs/architecture.md, "Validation at the edge"), and what a sender's CURVE key may send (`key_problem`,
docs/architecture.md, "Security").

`protocol.value_problem` checks a message's values alone; this checks them against what the replay knows: versions
ahead of what the learner can have, token ids past `replay.vocab_size`, trajectories longer than
`model.max_seq_len`, and whether an unknown group id is one this replay issued and closed. A problem is returned as
(reason, detail); the service counts and answers it.
"""

from __future__ import annotations

import re

from async_rl.protocol import TOKEN, AnyMessage, BatchAck, BatchRequest, StageRecord
from async_rl.security import owns, role_of, routing_name
from replay.group import Group
from replay.settings import EdgeSettings
from replay.state import LearnerState, ReplayState

GROUP_ID = re.compile(r"e(\d{1,10})\.g(\d{1,10})")  # the group ids replay/leases.py makes

Problem = tuple[str, str]  # (reason, detail)


def key_problem(identity: bytes, message: AnyMessage, peer: str) -> Problem | None:
    """(reason, detail) when the sender's key (`peer`, the identity CURVE authenticated) may not send `message` as it
    does, before any value is looked at: a role's messages from another role's key, a connection's routing identity
    or a worker id that belongs to another key."""
    name = type(message).__name__
    role = "learner" if isinstance(message, BatchRequest | BatchAck) else "rollout"
    if role_of(peer) != role:
        return f"not_{role}", f"{name} is only accepted from the {role}'s key, not from the key of {peer!r}"
    if not owns(peer, routing_name(identity)):
        return "identity_not_key", f"the key of {peer!r} speaks under the identity {identity!r}"
    worker_id = getattr(message, "worker_id", None)
    if worker_id is not None and not owns(peer, worker_id):
        return "worker_not_key", f"{name} of worker {worker_id!r} sent with the key of {peer!r}"
    return None


class Edge:
    """The learner's version as the replay saw it happen, and the checks that depend on the replay's state.

    A forged BatchRequest cannot move the learner's version (and so the staleness of every item) to 2**40, nor
    ratchet it: the ceiling is the first version a learner told (a fresh or restarted replay trusts it), then +
    ppo_epochs per batch served or acked; versions above it + ppo_epochs + replay.max_version_lead are refused."""

    def __init__(self, settings: EdgeSettings, state: ReplayState) -> None:
        self.settings, self.state = settings, state
        self.learner: LearnerState = state.learner

    def version_limit(self) -> int | None:
        """The highest version a message may carry (None: no learner has spoken since this replay started)."""
        if self.learner.version_ceiling is None:
            return None
        return self.learner.version_ceiling + self.settings.ppo_epochs + self.settings.max_version_lead

    def take_version(self, version: int, acked: bool = False) -> Problem | None:
        """Refuse a learner's version above what it can honestly have; else take it as the latest."""
        learner, ppo_epochs = self.learner, self.settings.ppo_epochs
        limit = self.version_limit()
        if limit is not None and version > limit:
            return "version_ahead", (f"policy_version {version} is above {limit}, the most the learner can have "
                                     f"({learner.version_ceiling} + algo.ppo_epochs + replay.max_version_lead)")
        learner.policy_version = max(learner.policy_version, version)
        if learner.version_ceiling is None:
            learner.version_ceiling = version  # a learner's first word: trusted (the replay may have restarted)
        elif acked:  # one batch trained: at most ppo_epochs further
            learner.version_ceiling = max(learner.version_ceiling, min(version, learner.version_ceiling + ppo_epochs))
        return None

    def served(self, requested_version: int) -> None:
        """A batch went out: the learner may train it (ppo_epochs steps) even if its ack never arrives."""
        learner = self.learner
        if learner.version_ceiling is not None:
            learner.version_ceiling = max(learner.version_ceiling, min(requested_version, learner.version_ceiling)
                                          + self.settings.ppo_epochs)

    def record_problem(self, group: Group, record: StageRecord) -> Problem | None:
        """(reason, detail) for a new stage record whose values the replay's state refuses, or None."""
        limit = self.version_limit()
        newest = int(record.versions().max())
        if limit is not None and newest > limit:
            return "version_ahead", f"policy version {newest} is above {limit}, the most the learner can have"
        vocab_size = self.settings.vocab_size
        if vocab_size is not None:
            for name, ids in (("action", record.action_ids()), ("observation", record.observation_ids())):
                if len(ids) and ids.max() >= vocab_size:
                    return "bad_token", f"{name} token id {int(ids.max())} >= replay.vocab_size {vocab_size}"
        trajectory = group.trajectories.get(record.member)
        stored = trajectory.num_tokens if trajectory is not None else 0
        length = stored + (len(record.observation_tokens) + len(record.action_tokens)) // TOKEN.itemsize
        if length > self.settings.max_seq_len:
            return "too_long", f"trajectory {record.trajectory_id} would be {length} tokens > model.max_seq_len"
        return None

    def closed(self, group_id: str) -> bool:
        """Whether this replay issued `group_id` (`e<epoch>.g<n>`: an earlier epoch, or below the next n) and it is
        gone: a record for it is a worker's resend after the group closed (its ack was lost or late), so it is
        acknowledged as a duplicate (nothing of a closed group can change) instead of refused."""
        match = GROUP_ID.fullmatch(group_id)
        state = self.state
        if match is None or group_id in state.groups:
            return False
        epoch, n = int(match[1]), int(match[2])
        return epoch < state.epoch or (epoch == state.epoch and n < state.group_ids.next_n)
