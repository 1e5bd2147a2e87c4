"""One open group and its state machine: its credit ledger, its tokens, where its training items are, and its
transitions from open to finalized to closed (docs/algorithm.md).

A group lives from its lease until it closes:
  open       stage records and outcomes arrive; complete (or timed-out) stage groups yield immediate items
  finalized  every outcome is in (or abandoned) and no immediate item is with a learner: A_final is fixed and
             one correction item per member carries C = A_final − issued
  closed     every correction was trained or dropped: the service reports the residual and forgets the group
`advance` makes the transitions its state allows and returns what they produced; the service's dispatch
(`ReplayService.advance`) is its only caller, and it owns the queue and the clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from async_rl.ledger import GroupLedger, Stage, corrections_on, immediate_updates_on
from async_rl.protocol import Outcome, StageRecord
from replay.settings import GroupSettings
from replay.store import QueuedItem, StageTokens, Trajectory, assemble_item


@dataclass(slots=True)
class Advanced:
    """What one `Group.advance` produced, for the service to apply in this order."""

    immediates: list[QueuedItem]  # new immediate items, to queue
    finalized: bool  # A_final was fixed now: the lease is over
    superseded: list[int]  # queued immediate items the corrections now carry: they leave the queue untrained
    held_over: int  # immediate items still on hold (algo.immediate_hold) when it finalized: never made, C carries them
    corrections: list[QueuedItem]  # one per member with a nonzero C, to queue
    closed: bool  # every correction trained or dropped and nothing left to roll back: the group is over


@dataclass(slots=True)
class Group:
    group_id: str
    worker_id: str  # the lease holder: its silence abandons the group's unfinished members
    ledger: GroupLedger
    trajectories: dict[int, Trajectory] = field(default_factory=dict)  # member -> tokens
    stage_group_started: dict[int, float] = field(default_factory=dict)  # unhandled stage group k -> first arrival
    deferred: dict[Stage, float] = field(default_factory=dict)  # (member, k) -> A_imm waiting (prefix or hold)
    held_since: dict[int, float] = field(default_factory=dict)  # stage group k on hold -> when it was handled
    queued_immediates: set[int] = field(default_factory=set)  # item ids waiting in the queue
    in_flight_immediates: set[int] = field(default_factory=set)  # item ids served, not yet acked
    open_corrections: set[int] = field(default_factory=set)  # correction item ids neither acked nor dropped
    dropped_stages: set[Stage] = field(default_factory=set)  # credit lost to max_correction_staleness
    finalized: bool = False
    task_id: str | None = None  # the worker's task, fixed by the group's first stage record
    oldest_version: int | None = None  # the oldest policy version among the group's stored action tokens
    leased_version: int = 0  # the learner's version when leased (or its worker's, if older): before any record
    touched: float = 0.0  # when it was leased or last stored a record or an outcome (replay.max_open_groups)

    @property
    def group_size(self) -> int:
        return self.ledger.group_size

    # --- arrivals -----------------------------------------------------------------------------------

    def is_duplicate(self, member: int, k: int) -> bool:
        return k in self.ledger.rewards[member]

    def member_problem(self, member: int, trajectory_id: str) -> str | None:
        """Why a message about `member` cannot belong to this group, or None."""
        if not 0 <= member < self.group_size:
            return f"member {member} out of [0, group_size {self.group_size})"
        trajectory = self.trajectories.get(member)
        if trajectory is not None and trajectory.trajectory_id != trajectory_id:
            return (
                f"member {member} of {self.group_id} is trajectory {trajectory.trajectory_id!r}, not {trajectory_id!r}"
            )
        return None

    def stage_problem(self, record: StageRecord) -> str | None:
        """Why a new (not duplicate) stage record cannot be stored, or None."""
        i, k, ledger = record.member, record.stage_index, self.ledger
        if self.task_id is not None and record.task_id != self.task_id:
            return f"task {record.task_id!r}, but group {self.group_id} runs task {self.task_id!r}"
        if i in ledger.num_stages and k >= ledger.num_stages[i]:
            return f"stage {k} of member {i}, which has {ledger.num_stages[i]} stages"
        if record.terminal and max(ledger.rewards[i], default=-1) > k:
            return f"terminal stage {k} of member {i} after a later stage"
        return None

    def add_stage(self, record: StageRecord, now: float, track_stage_group: bool) -> bool:
        """Store the record; True if it is the first of a stage group to hand out later."""
        i, k = record.member, record.stage_index
        self.task_id = record.task_id
        trajectory = self.trajectories.get(i)
        if trajectory is None:
            trajectory = self.trajectories[i] = Trajectory(record.trajectory_id, i)
        trajectory.add(k, StageTokens.from_record(record))
        versions = record.versions()
        if len(versions):
            oldest = int(versions.min())
            self.oldest_version = oldest if self.oldest_version is None else min(self.oldest_version, oldest)
        self.ledger.add_stage(i, k, record.stage_reward, record.terminal)
        if not track_stage_group or k in self.ledger.immediate_done or k in self.stage_group_started:
            return False
        self.stage_group_started[k] = now
        return True

    def outcome_problem(self, message: Outcome) -> str | None:
        """Why a (not abandoned) outcome cannot be accepted, or None."""
        if message.outcome is None:
            return "outcome is None but abandoned is False"
        i = message.member
        stored = max(self.ledger.rewards[i], default=-1) + 1
        known = self.ledger.num_stages.get(i, message.num_stages)
        if message.num_stages < stored or message.num_stages != known:
            return f"num_stages {message.num_stages}, but member {i} sent {max(stored, known)} stages"
        return None

    def unfinished_members(self) -> list[int]:
        """Members not abandoned whose outcome, or one of whose stages before it, has not arrived. A stage record
        lost with a killed replay can be overtaken by its outcome (the worker resends the stage after its ack
        timeout); a worker killed in between never sends it, and the member must be abandoned with the others, or
        its group waits for that stage for good (found by the chaos soak: the guard then held the learner)."""
        ledger = self.ledger
        return [i for i in range(self.group_size) if i not in ledger.abandoned
                and (i not in ledger.outcomes or len(ledger.rewards[i]) < ledger.num_stages[i])]

    # --- the state machine ----------------------------------------------------------------------------

    def advance(self, now: float, settings: GroupSettings, item_ids: Iterator[int],
                may_close: Callable[[Group], bool], hold_s: float = 0.0) -> Advanced:
        """Move as far as the state allows: immediate items, finalization, closing (`may_close`: the rollback's
        say, replay/rollback.py). `hold_s`: how long a stage group's immediate items wait for the outcome
        (replay/hold.py)."""
        with_corrections = corrections_on(settings.updates)
        # Once every outcome is in, the correction carries the credit of a stage group not yet handed out.
        carried_by_correction = with_corrections and self.ledger.outcomes_complete()
        immediates: list[QueuedItem] = []
        if immediate_updates_on(settings.updates) and not self.finalized and not carried_by_correction:
            immediates = self.immediate_items(now, settings, item_ids, hold_s)
        finalized, superseded, held_over, corrections = self.ready_to_finalize(), [], 0, []
        if finalized:
            if with_corrections:
                superseded = list(self.queued_immediates)  # never trained: issued stays 0, C carries their credit
                held_over = sum(k in self.held_since for _, k in self.deferred)
            corrections = self.finalize(settings, item_ids, with_corrections)
        return Advanced(immediates, finalized, superseded, held_over, corrections,
                        self.closable() and may_close(self))

    # --- immediate update ---------------------------------------------------------------------------

    def immediate_items(self, now: float, settings: GroupSettings, item_ids: Iterator[int],
                        hold_s: float = 0.0) -> list[QueuedItem]:
        """Items of the stage groups complete now, or timed out with at least min_stage_peers members (§2), once
        their hold is over (`hold_s` after the stage group was handled; 0: at once)."""
        for k, started in list(self.stage_group_started.items()):
            timed_out = now >= started + settings.stage_group_timeout_s
            if self.ledger.stage_group_complete(k) or (
                timed_out and len(self.ledger.stage_group(k)) >= settings.min_stage_peers
            ):
                del self.stage_group_started[k]
                for i, advantage in self.ledger.immediate(k, settings).items():
                    self.deferred[(i, k)] = advantage
                    if hold_s > 0:
                        self.held_since[k] = now
        for k in self._holds_over(now, hold_s):
            del self.held_since[k]
        items = []
        # An item needs its hold over and its whole prefix (a stage still missing, a resend on its way, defers it).
        for (i, k), advantage in list(self.deferred.items()):
            if k not in self.held_since and self.trajectories[i].has_prefix_through(k):
                del self.deferred[(i, k)]
                item = assemble_item(
                    next(item_ids), "immediate", self.group_id, self.trajectories[i], k, {k: advantage}
                )
                self.queued_immediates.add(item.item_id)
                items.append(item)
        return items

    def hold_over(self, now: float, hold_s: float) -> bool:
        """Whether a stage group's hold ended by `now`, its items to be made at the next `advance` (once every
        outcome is in, none is: the finalization carries them)."""
        return bool(self._holds_over(now, hold_s)) and not self.ledger.outcomes_complete()

    def _holds_over(self, now: float, hold_s: float) -> list[int]:
        """The stage groups on hold whose hold ended by `now`."""
        return [k for k, since in self.held_since.items() if now >= since + hold_s]

    # --- final credit and correction ----------------------------------------------------------------

    def ready_to_finalize(self) -> bool:
        """Outcomes complete, and no immediate item is with a learner (its ack would change `issued`)."""
        return not self.finalized and not self.in_flight_immediates and self.ledger.outcomes_complete()

    def finalize(self, settings: GroupSettings, item_ids: Iterator[int], with_corrections: bool) -> list[QueuedItem]:
        """Fix A_final and return one correction item per member with a nonzero C (none in immediate-only)."""
        self.finalized = True
        self.stage_group_started.clear()
        self.deferred.clear()
        self.held_since.clear()
        if not with_corrections:
            return []
        self.queued_immediates.clear()  # the caller removed them from the queue: C carries their credit
        ledger = self.ledger
        ledger.finalize(settings)
        per_member: dict[int, dict[int, float]] = {}
        for (i, k), c in ledger.corrections().items():
            per_member.setdefault(i, {})[k] = c
        items = []
        for i, credit in sorted(per_member.items()):
            last_stage = ledger.num_stages[i] - 1
            items.append(assemble_item(next(item_ids), "correction", self.group_id, self.trajectories[i], last_stage,
                                       credit))
        self.open_corrections.update(item.item_id for item in items)
        return items

    def record_trained(self, queued: QueuedItem) -> None:
        """The learner acked the item: its credit now counts in the ledger."""
        immediate = queued.kind == "immediate"
        for k, advantage in queued.credit.items():
            self.ledger.record_trained(queued.member, k, advantage, immediate=immediate)
        if immediate:
            self.in_flight_immediates.discard(queued.item_id)
        else:
            self.open_corrections.discard(queued.item_id)

    def drop_correction(self, queued: QueuedItem) -> None:
        self.dropped_stages.update((queued.member, k) for k in queued.credit)
        self.open_corrections.discard(queued.item_id)

    def closable(self) -> bool:
        return self.finalized and not self.open_corrections

    def residual(self) -> float:
        """max |Σ trained − A_final| over the stages whose credit was not dropped (the ledger invariant: ≈ 0)."""
        ledger = self.ledger
        if ledger.a_final is None:
            return 0.0
        residuals = zip(ledger.a_final, ledger.residuals(), strict=True)
        kept = [r for stage, r in residuals if stage not in self.dropped_stages]
        return float(np.max(kept)) if kept else 0.0  # np.max, not max: a NaN residual propagates
