"""What the soak's checker joins from outside the replay (benchmarks/chaos_check.py): the hash both sides take of
a stage's action tokens, and the learner's record of what one trained item trained.

A worker journals each acked stage's `token_hash(action_tokens)` (rollout/ack_journal.py); the learner logs, per
trained item, `trained_item(item)`: [item_id, kind, group_id, trajectory_id, [[start, end, hash], ...]], one
[start, end) run per stretch of the loss mask with the hash of its tokens. A run is one stage's action tokens (a
stage's observation, never trained, separates two), so the checker maps it to (trajectory, stage) by the stage
lengths the journal holds and checks its hash against the one the worker journalled.
"""

from __future__ import annotations

import hashlib

import numpy as np

from async_rl.protocol import MASK, TOKEN, TrainItem


def token_hash(tokens: bytes) -> str:
    """16 hex digits of BLAKE2b over a packed int32 token array (the wire's bytes)."""
    return hashlib.blake2b(tokens, digest_size=8).hexdigest()


def mask_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """The [start, end) stretches where `mask` is nonzero."""
    on = np.concatenate(([0], (np.asarray(mask) != 0).astype(np.int8), [0]))
    edges = np.flatnonzero(np.diff(on))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def trained_item(item: TrainItem) -> list:
    tokens = item.tokens
    runs = [[a, b, token_hash(tokens[a * TOKEN.itemsize: b * TOKEN.itemsize])]
            for a, b in mask_runs(np.frombuffer(item.loss_mask, MASK))]
    return [item.item_id, item.kind, item.group_id, item.trajectory_id, runs]
