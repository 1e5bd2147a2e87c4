"""The per-group credit ledger of docs/algorithm.md, "Final credit and correction" (pure: no I/O, no clock).

For every stage (i, k) it keeps `issued[i,k]`, the immediate advantage already trained for those tokens (a key
exactly while the stage's immediate item stands trained), and `trained[i,k]`, everything trained for them
(immediate + correction). Once the group is final,

    C[i,k] = A_final[i,k] − issued[i,k]

and after the corrections are trained the ledger invariant holds: trained[i,k] == A_final[i,k].

Abandoned members are excluded from the group's statistics and receive no correction (their credit
stays what was issued); a group with fewer than two finished members yields no final credit at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from async_rl.advantages import final_credit, immediate_advantages
from async_rl.config import CreditMode, UpdateMode

ZERO_CORRECTION = 1e-8  # a correction this small is not sent (docs/algorithm.md, "Final credit and correction")

Stage = tuple[int, int]  # (member i, stage k)


class CreditRule(Protocol):
    """The learning rule's knobs the ledger reads: an `AlgoConfig` has them, and so has the replay's
    `GroupSettings` (replay/settings.py), which carries only what a group uses."""

    @property
    def updates(self) -> UpdateMode: ...
    @property
    def credit(self) -> CreditMode: ...
    @property
    def omega(self) -> float: ...
    @property
    def gamma(self) -> float: ...
    @property
    def eps(self) -> float: ...


def immediate_updates_on(updates: UpdateMode) -> bool:
    return updates in ("immediate+correction", "immediate-only")


def corrections_on(updates: UpdateMode) -> bool:
    return updates in ("immediate+correction", "outcome-only")


class GroupLedger:
    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.rewards: dict[int, dict[int, float | None]] = {i: {} for i in range(group_size)}
        self.num_stages: dict[int, int] = {}  # known once the terminal stage or the outcome arrived
        self.outcomes: dict[int, float] = {}
        self.abandoned: set[int] = set()
        self.issued: dict[Stage, float] = {}
        self.trained: dict[Stage, float] = {}
        self.a_final: dict[Stage, float] | None = None
        self.updates: UpdateMode = "immediate+correction"  # the mode the group was finalized under
        self.immediate_done: set[int] = set()  # stage indices whose stage group was handled

    # --- arrivals ---------------------------------------------------------------------------------

    def add_stage(self, i: int, k: int, reward: float | None, terminal: bool) -> bool:
        """Record stage k of member i; False if it was already recorded (a resend)."""
        if k in self.rewards[i]:
            return False
        self.rewards[i][k] = reward
        if terminal:
            self.num_stages[i] = k + 1
        return True

    def add_outcome(self, i: int, outcome: float, num_stages: int) -> None:
        self.outcomes[i] = outcome
        self.num_stages[i] = num_stages

    def abandon(self, i: int) -> None:
        self.abandoned.add(i)
        self.outcomes.pop(i, None)

    # --- immediate update -------------------------------------------------------------------------

    def ended_before(self, i: int, k: int) -> bool:
        return i in self.abandoned or (i in self.num_stages and self.num_stages[i] <= k)

    def stage_group_complete(self, k: int) -> bool:
        """Every member has produced stage k or ended before it."""
        return all(k in self.rewards[i] or self.ended_before(i, k) for i in range(self.group_size))

    def stage_group(self, k: int) -> dict[int, float | None]:
        """The members (not abandoned) that have produced stage k so far, with their rewards."""
        return {
            i: stages[k] for i, stages in self.rewards.items() if k in stages and i not in self.abandoned
        }

    def immediate(self, k: int, algo: CreditRule) -> dict[int, float]:
        """A_imm for stage group k (call once, when it is complete or timed out); {} in `outcome-only` mode."""
        self.immediate_done.add(k)
        if not immediate_updates_on(algo.updates):
            return {}
        return immediate_advantages(self.stage_group(k), algo.omega, algo.eps)

    def record_trained(self, i: int, k: int, advantage: float, immediate: bool) -> None:
        """An item's optimizer step was acknowledged: its credit now counts."""
        if immediate:
            self.issued[(i, k)] = self.issued.get((i, k), 0.0) + advantage
        self.trained[(i, k)] = self.trained.get((i, k), 0.0) + advantage

    def undo_trained(self, i: int, k: int, advantage: float, immediate: bool) -> None:
        """A rollback (the learner resumed from a checkpoint older than the ack) takes the item's credit back."""
        if immediate:  # one immediate item per stage: with its ack undone, none was trained (the key goes)
            del self.issued[(i, k)]
        self.trained[(i, k)] -= advantage

    def unfinalize(self) -> None:
        """A rollback took back an immediate item trained before A_final was fixed: C must be computed again."""
        self.a_final = None

    # --- final credit and correction --------------------------------------------------------------

    def finished_members(self) -> list[int]:
        return [i for i in range(self.group_size) if i in self.outcomes and i not in self.abandoned]

    def outcomes_complete(self) -> bool:
        """Every member has its outcome (with all its stages stored) or was abandoned."""
        for i in range(self.group_size):
            if i in self.abandoned:
                continue
            if i not in self.outcomes or len(self.rewards[i]) < self.num_stages[i]:
                return False
        return True

    def finalize(self, algo: CreditRule) -> dict[Stage, float]:
        """Compute A_final for every stage of every finished member."""
        members = self.finished_members()
        rewards = {i: [self.rewards[i].get(k) for k in range(self.num_stages[i])] for i in members}
        outcomes = {i: self.outcomes[i] for i in members}
        per_member = final_credit(rewards, outcomes, algo.credit, algo.omega, algo.gamma, algo.eps)
        self.a_final = {(i, k): a for i, stages in per_member.items() for k, a in enumerate(stages)}
        self.updates = algo.updates
        return self.a_final

    def corrections(self) -> dict[Stage, float]:
        """C[i,k] = A_final[i,k] − issued[i,k]; corrections within 1e-8 of zero are not sent; {} in `immediate-only`."""
        assert self.a_final is not None, "finalize() first"
        if not corrections_on(self.updates):
            return {}
        c = {stage: a - self.issued.get(stage, 0.0) for stage, a in self.a_final.items()}
        return {stage: value for stage, value in c.items() if abs(value) > ZERO_CORRECTION}

    def residuals(self) -> Iterator[float]:
        """|Σ trained − A_final| for every finalized stage (the ledger invariant says: all ≈ 0)."""
        assert self.a_final is not None, "finalize() first"
        for stage, a in self.a_final.items():
            yield abs(self.trained.get(stage, 0.0) - a)
