"""TrainItems off the wire → tensors aligned for the token loss: right-padded (one item per row) or packed.

The log-prob of token t comes from the logits at t−1, so every per-token array is sliced with [:, 1:] to line up
with `async_rl.loss.token_logprobs` (shape B × (T−1)).

A packed row lays several items end to end with position ids restarting at 0 for each (learner/pack.py plans
which). The model gets those position ids and no attention mask; the kernel learner.attention names keeps
attention within each sequence (learner/attention.py: per-sequence sdpa, flash-attention's varlen kernel,
FlexAttention's document mask, or sdpa with a block-diagonal causal mask). The logit at an
item's last token predicts the next item's first token: the loss mask is 0 there, as it is for an item's first
token in the padded layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from async_rl.protocol import ADVANTAGE, LOGPROB, MASK, TOKEN, TrainItem
from learner.pack import MicroBatch

PAD_ID = 0


@dataclass
class TrainBatch:
    tokens: torch.Tensor  # (B, T) int64, right-padded with PAD_ID
    attention_mask: torch.Tensor  # (B, T) 1 on real tokens
    loss_mask: torch.Tensor  # (B, T−1) float, 1 on trained action tokens
    advantages: torch.Tensor  # (B, T−1) float32: A_imm or C
    behaviour_logp: torch.Tensor  # (B, T−1) float32: log μ
    versions: torch.Tensor  # (B, T−1) int64: v_t of the weights that produced each token
    is_correction: torch.Tensor  # (B,) bool: item kind (padded layout; a packed row is marked by its first item)
    position_ids: torch.Tensor | None = None  # (B, T) int64 when packed: restarting at 0 for every item

    def staleness(self, version: int) -> torch.Tensor:
        """s_t = v − v_t (docs/algorithm.md, "Loss"); meaningful on the loss mask only."""
        return version - self.versions

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def to(self, device: torch.device | str) -> TrainBatch:
        """The same batch on `device` (the engine's: DeepSpeed put the model there)."""
        moved = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return TrainBatch(**{name: t.to(device, non_blocking=True) if t is not None else None
                             for name, t in moved.items()})

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """Keyword arguments of the model's forward: position ids for packed rows, else the padding mask. No KV
        cache: with one, transformers would not look for packed sequences (and training has no use for it)."""
        if self.position_ids is not None:
            return {"input_ids": self.tokens, "position_ids": self.position_ids, "use_cache": False}
        return {"input_ids": self.tokens, "attention_mask": self.attention_mask, "use_cache": False}


def collate(items: list[TrainItem]) -> TrainBatch:
    """Pad the items to the longest one; padding has attention 0 and loss mask 0."""
    return collate_rows(items, [[i] for i in range(len(items))], packed=False)


def collate_micro_batch(items: list[TrainItem], micro: MicroBatch, packed: bool) -> TrainBatch:
    """One planned micro-batch of `items` (a filler's loss mask is 0)."""
    batch = collate_rows(items, [list(row) for row in micro.rows], packed)
    if micro.filler:
        batch.loss_mask.zero_()
    return batch


def collate_rows(items: list[TrainItem], rows: list[list[int]], packed: bool) -> TrainBatch:
    """Rows of item indices → tensors; packed rows lay their items end to end (one item per row otherwise).

    Each per-token field of every item is read once, as one concatenation of the wire bytes, and scattered into
    the (rows × longest row) arrays by a flat index: a handful of numpy calls per micro-batch, not one per item and
    field (the learner collates every step, on the step's critical path)."""
    if not packed and any(len(row) != 1 for row in rows):
        raise ValueError("collate_rows: an unpacked row holds exactly one item")
    order = [items[i] for row in rows for i in row]  # items in layout order: row by row, end to end
    lengths = np.fromiter((item.num_tokens() for item in order), dtype=np.int64, count=len(order))
    row_of = np.repeat(np.arange(len(rows)), [len(row) for row in rows])
    ends = np.cumsum(lengths)
    row_sums = np.bincount(row_of, weights=lengths, minlength=len(rows)).astype(np.int64)
    row_starts = np.concatenate(([0], np.cumsum(row_sums)[:-1]))
    offset = ends - lengths - row_starts[row_of]  # each item's first slot within its row
    count, length = len(rows), int(row_sums.max())
    within = np.arange(int(ends[-1])) - np.repeat(ends - lengths, lengths)  # position within its own item
    first = row_of * length + offset  # each item's first slot in the flattened arrays
    flat = np.repeat(first, lengths) + within  # each token's slot

    def field(name: str, dtype: np.dtype) -> np.ndarray:
        return np.frombuffer(b"".join(getattr(item, name) for item in order), dtype=dtype)

    def scatter(values: np.ndarray, dtype: type, fill: float = 0) -> np.ndarray:
        out = np.full(count * length, fill, dtype=dtype)
        out[flat] = values
        return out.reshape(count, length)

    tokens = scatter(field("tokens", TOKEN), np.int64, PAD_ID)
    attention = scatter(np.ones(len(flat), dtype=np.int64), np.int64)
    mask = scatter(field("loss_mask", MASK), np.float32)
    mask.reshape(-1)[first] = 0.0  # predicted from the previous item's last token (padded: sliced off below)
    advantages = scatter(field("advantages", ADVANTAGE), np.float32)
    behaviour = scatter(field("behaviour_logprobs", LOGPROB), np.float32)
    versions = scatter(field("policy_versions", TOKEN), np.int64)
    # positions restart at 0 for every item; the padding tail of a row is a block of its own (loss mask 0)
    positions = np.zeros((count, length), dtype=np.int64)
    positions.reshape(-1)[flat] = within
    tails = np.arange(length)[None, :] >= row_sums[:, None]
    positions[tails] = (np.arange(length)[None, :] - row_sums[:, None])[tails]
    return TrainBatch(
        tokens=torch.from_numpy(tokens),
        attention_mask=torch.from_numpy(attention),
        loss_mask=torch.from_numpy(mask[:, 1:].copy()),
        advantages=torch.from_numpy(advantages[:, 1:].copy()),
        behaviour_logp=torch.from_numpy(behaviour[:, 1:].copy()),
        versions=torch.from_numpy(versions[:, 1:].copy()),
        is_correction=torch.tensor([items[row[0]].kind == "correction" for row in rows], dtype=torch.bool),
        position_ids=torch.from_numpy(positions) if packed else None,
    )
