"""TrainItems off the wire → right-padded tensors aligned for the token loss.

The log-prob of token t comes from the logits at t−1, so every per-token array is sliced with [:, 1:] to line up
with `async_rl.loss.token_logprobs` (shape B × (T−1)).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from async_rl.protocol import TrainItem

PAD_ID = 0


@dataclass
class TrainBatch:
    tokens: torch.Tensor  # (B, T) int64, right-padded with PAD_ID
    attention_mask: torch.Tensor  # (B, T) 1 on real tokens
    loss_mask: torch.Tensor  # (B, T−1) float, 1 on trained action tokens
    advantages: torch.Tensor  # (B, T−1) float32: A_imm or C
    behaviour_logp: torch.Tensor  # (B, T−1) float32: log μ
    versions: torch.Tensor  # (B, T−1) int64: v_t of the weights that produced each token
    is_correction: torch.Tensor  # (B,) bool: item kind

    def staleness(self, version: int) -> torch.Tensor:
        """s_t = v − v_t (docs/algorithm.md, "Loss"); meaningful on the loss mask only."""
        return version - self.versions

    def __len__(self) -> int:
        return self.tokens.shape[0]


def collate(items: list[TrainItem]) -> TrainBatch:
    """Pad the items to the longest one; padding has attention 0 and loss mask 0."""
    length = max(len(item.token_ids()) for item in items)
    rows = len(items)
    tokens = np.full((rows, length), PAD_ID, dtype=np.int64)
    attention = np.zeros((rows, length), dtype=np.int64)
    mask = np.zeros((rows, length), dtype=np.float32)
    advantages = np.zeros((rows, length), dtype=np.float32)
    behaviour = np.zeros((rows, length), dtype=np.float32)
    versions = np.zeros((rows, length), dtype=np.int64)
    for row, item in enumerate(items):
        n = len(item.token_ids())
        tokens[row, :n] = item.token_ids()
        attention[row, :n] = 1
        mask[row, :n] = item.mask()
        advantages[row, :n] = item.advantage_values()
        behaviour[row, :n] = item.logprobs()
        versions[row, :n] = item.versions()
    return TrainBatch(
        tokens=torch.from_numpy(tokens),
        attention_mask=torch.from_numpy(attention),
        loss_mask=torch.from_numpy(mask[:, 1:].copy()),
        advantages=torch.from_numpy(advantages[:, 1:].copy()),
        behaviour_logp=torch.from_numpy(behaviour[:, 1:].copy()),
        versions=torch.from_numpy(versions[:, 1:].copy()),
        is_correction=torch.tensor([item.kind == "correction" for item in items], dtype=torch.bool),
    )
