"""Key/value caches kept between a trajectory's turns: found by the longest common token prefix, evicted oldest-used
first under a memory budget and a count.

A multi-turn episode sends the engine its whole context at every turn (prompt, earlier actions, observations). The
keys and values of a position depend only on the tokens up to it, so the cache of an earlier call is exact for any
prefix it shares with the new prompt, and only the rest needs a forward pass. An entry holds one sequence's tokens
and, per layer, its keys and values (heads, tokens, head_dim); a lookup truncates the best entry to the prefix it
shares. The built-in engine clears the whole cache when it loads new weights, so every cached position was computed
by the weights that sample the next token (rollout/engines/torch_engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values, each (heads, tokens, head_dim)


@dataclass(eq=False)  # entries are removed by identity
class Entry:
    tokens: np.ndarray  # int64, the tokens whose keys and values `kv` holds
    kv: KV
    nbytes: int
    last_used: int = 0


@dataclass
class CacheStats:
    reused_tokens: int = 0  # prompt tokens whose keys and values came from the cache
    prefilled_tokens: int = 0  # prompt tokens that went through a forward pass
    evicted: int = 0  # entries dropped for the budget
    cleared: int = 0  # entries dropped by a weight update
    held_bytes: int = 0

    def reuse_frac(self) -> float:
        total = self.reused_tokens + self.prefilled_tokens
        return self.reused_tokens / total if total else 0.0


class PrefixCache:
    """Entries and, for the lookup, their tokens as rows of one matrix (padded with -1, which no token equals), so a
    lookup is one vectorised comparison however many entries are held."""

    def __init__(self, budget_bytes: int, max_entries: int = 1024) -> None:
        self.budget_bytes = budget_bytes  # 0: nothing is kept
        self.max_entries = max_entries  # a lookup's cost grows with the entries held (a finished trajectory's stay)
        self.stats = CacheStats()
        self.slots: list[Entry | None] = []
        self.rows = np.full((0, 0), -1, dtype=np.int64)
        self._clock = 0

    @property
    def entries(self) -> list[Entry]:
        return [entry for entry in self.slots if entry is not None]

    def match(self, prompt: list[int]) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with `prompt` and that prefix's length, at most len(prompt) - 1 (the
        last prompt token always goes through the model: its logits sample the first new token)."""
        width = min(self.rows.shape[1], len(prompt) - 1)
        if width <= 0 or not any(entry is not None for entry in self.slots):
            return None, 0
        same = self.rows[:, :width] == np.asarray(prompt[:width], dtype=np.int64)
        shared = np.where(same.all(axis=1), width, same.argmin(axis=1))
        slot = int(shared.argmax())
        if not shared[slot]:
            return None, 0
        entry = self.slots[slot]
        assert entry is not None  # a free slot's row is all -1: it shares nothing
        self._clock += 1
        entry.last_used = self._clock
        return entry, int(shared[slot])

    def put(self, tokens: list[int], kv: KV) -> None:
        """Keep `kv` for `tokens`, then drop the least recently used entries while over the budget."""
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if nbytes > self.budget_bytes:
            return
        self._clock += 1
        entry = Entry(np.asarray(tokens, dtype=np.int64), kv, nbytes, self._clock)
        slot = self._free_slot(len(tokens))
        self.slots[slot] = entry
        self.rows[slot, : len(tokens)] = entry.tokens
        self.stats.held_bytes += nbytes
        while self.stats.held_bytes > self.budget_bytes or len(self.entries) > self.max_entries:
            self.remove(min(self.entries, key=lambda e: e.last_used))
            self.stats.evicted += 1

    def remove(self, entry: Entry) -> None:
        slot = next(i for i, held in enumerate(self.slots) if held is entry)
        self.slots[slot] = None
        self.rows[slot] = -1
        self.stats.held_bytes -= entry.nbytes

    def clear(self) -> None:
        self.stats.cleared += len(self.entries)
        self.slots = [None] * len(self.slots)
        self.rows[:] = -1
        self.stats.held_bytes = 0

    def _free_slot(self, length: int) -> int:
        """A free row at least `length` wide, growing the matrix (doubling) when needed."""
        height, width = self.rows.shape
        if length > width:
            self.rows = np.pad(self.rows, ((0, 0), (0, max(length, 2 * width) - width)), constant_values=-1)
        free = next((i for i, held in enumerate(self.slots) if held is None), None)
        if free is None:
            free = height
            self.slots.extend([None] * max(height, 8))
            self.rows = np.pad(self.rows, ((0, len(self.slots) - height), (0, 0)), constant_values=-1)
        return free
