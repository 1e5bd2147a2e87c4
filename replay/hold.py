"""The immediate hold (`algo.immediate_hold`): how long a stage group's immediate items wait for their group's outcome
before a learner may train them, from the pace at which the replay sees trajectories finish (docs/algorithm.md,
"Immediate hold").

An immediate update pays when the outcome is late: its stage credit trains while the judge works. When the outcome
lands soon after, it buys nothing and costs an optimizer step: the same tokens are trained twice (A_imm, then
C = A_final − A_imm) where `outcome-only` trains them once with A_final. So an immediate item waits `hold_s`: if
every outcome of its group lands first, the group finalizes with the item never issued and its correction carries
the whole credit (`Group.finalize`, as for a queued immediate it supersedes); if not, the item is queued as before.
The hold is `algo.immediate_hold` outcome-only learner steps' worth of generation, `groups_per_step × group_size`
finished trajectories timed at the pace measured over the last `PACE_STEPS` such batches, so the rule decides from
what it measures: an instant judge (outcomes within a step's worth of generation) trains as `outcome-only`, a judge
D steps late trains each stage's credit D − hold steps before its outcome. The window is long (a group's members
finish together, and a worker's in-flight groups in bursts: the gaps within a burst are no pace) and starts at the
first stage record, so until it is full the pace is the run's since generation began, start-up and admission waits
included. Until one trajectory has finished the pace is unknown and items wait for it (the first outcomes cannot be
sooner than the trajectories they judge).

The pace is a function of the messages' arrival times, so a replay rebuilt from its write-ahead log holds exactly
what the live one held (replay/wal.py).
"""

from __future__ import annotations

import math
from collections import deque

import msgspec

PACE_STEPS = 4  # the pace is measured over the last PACE_STEPS × batch_trajectories finished trajectories


class HoldSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The hold's inputs (built by `ReplaySettings.from_config`)."""

    immediate_hold: float  # algo.immediate_hold; 0 where it does not apply (not immediate+correction, or sync mode)
    batch_trajectories: int  # algo.groups_per_step × rollout.group_size: one outcome-only step's trajectories


class HoldState(msgspec.Struct):
    """The finishing times of the latest trajectories, and the groups with immediate items on hold."""

    window: int = PACE_STEPS * 128  # PACE_STEPS × batch_trajectories
    # arrival times of the latest terminal stage records, after the first stage record's until the window is full
    finished: deque = msgspec.field(default_factory=deque)
    waiting: set[str] = set()  # groups with a stage group on hold (`Group.held_since`)

    def __post_init__(self) -> None:
        self.finished = deque(self.finished, maxlen=self.window + 1)


class Hold:
    def __init__(self, settings: HoldSettings, state: HoldState) -> None:
        self.settings = settings
        self.state = state

    def stored(self, now: float, terminal: bool) -> None:
        """A stage record arrived: the first one starts the window, a terminal one is a finished trajectory."""
        if terminal or not self.state.finished:
            self.state.finished.append(now)

    def seconds(self) -> float:
        """The hold in use: `immediate_hold` steps' worth of generation at the measured pace (inf until it is
        known; 0 when the hold is off)."""
        hold = self.settings.immediate_hold
        if hold <= 0:
            return 0.0
        finished = self.state.finished
        span = finished[-1] - finished[0] if len(finished) >= 2 else 0.0
        if span <= 0:
            return math.inf
        per_trajectory = span / (len(finished) - 1)
        return hold * self.settings.batch_trajectories * per_trajectory

    def waits(self, group_id: str, waiting: bool) -> None:
        """Whether the group now has a stage group on hold."""
        if waiting:
            self.state.waiting.add(group_id)
        else:
            self.state.waiting.discard(group_id)
