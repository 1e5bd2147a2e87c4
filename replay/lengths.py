"""How long a trajectory still being generated will get: the correction guard's size estimate for pending work when
batches are budgeted by their summed tokens (`learner.batch_budget: packed`, docs/algorithm.md "Staleness").

The longest trajectory seen is a poor estimate when lengths are long-tailed: counting every pending trajectory at
the maximum overstates their sum many times over (a cluster workload's longest reached 5.5x its median), and the
guard then refuses leases and holds the learner for work that will never come. The sum over many trajectories is
what a packed budget sees, so this estimates each one by the mean of the finished lengths at least as long as it
already is (a trajectory 60k tokens in is expected to end longer than one just started), and the guard adds a
margin of `MARGIN_SD` standard deviations of that sum.
"""

from __future__ import annotations

from collections import deque

import numpy as np

SAMPLE = 2048  # the last N finished trajectories' lengths
MARGIN_SD = 2.0  # standard deviations of the pending sum added to it (the sum of n estimates: sd * sqrt(n))


class LengthModel:
    def __init__(self, lengths: list[int] | None = None) -> None:
        self.lengths: deque[int] = deque(lengths or (), maxlen=SAMPLE)
        self._table: tuple[np.ndarray, np.ndarray, float] | None = None

    def __len__(self) -> int:
        return len(self.lengths)

    def add(self, tokens: int) -> None:
        self.lengths.append(int(tokens))
        self._table = None

    def table(self) -> tuple[np.ndarray, np.ndarray, float]:
        """(sorted lengths, the mean of each suffix of them, their standard deviation)."""
        if self._table is None:
            ordered = np.sort(np.fromiter(self.lengths, dtype=np.float64, count=len(self.lengths)))
            suffix_means = np.cumsum(ordered[::-1])[::-1] / np.arange(len(ordered), 0, -1)
            self._table = (ordered, suffix_means, float(ordered.std()))
        return self._table

    def expected(self, so_far: np.ndarray) -> np.ndarray:
        """Each trajectory's expected final length given its tokens so far: the mean of the finished lengths at
        least that long (itself, when it is longer than every finished one). Needs at least one finished length."""
        ordered, suffix_means, _ = self.table()
        at = np.searchsorted(ordered, so_far, side="left")
        beyond = at >= len(ordered)
        estimate = suffix_means[np.minimum(at, len(ordered) - 1)]
        return np.where(beyond, so_far, np.maximum(estimate, so_far))

    @property
    def sd(self) -> float:
        return self.table()[2]
