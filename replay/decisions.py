"""What the replay's parts decide and the service carries out: a group to advance, a group to give up.

A part's step that changes what a group's transitions depend on (an ack, a requeue, a rollback, a full lease table)
is a generator (`Steps`): it yields each decision when it makes it and returns its answer. The service carries out
each decision there and then (`ReplayService.carry_out`), so the step goes on from the state that left, exactly
as if it had called the service itself, and no part holds a way into the service. `Group.advance` is the same idea
for one group: it returns what its transitions produced, and the service applies it.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import TypeVar

from replay.group import Group

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Advance:
    """Apply the group's transitions now (`ReplayService.advance`): the step changed what they depend on."""

    group: Group


@dataclass(frozen=True, slots=True)
class GiveUp:
    """replay.max_open_groups: abandon the group's unfinished trajectories and end its lease, as for an expired
    lease (`ReplayService._give_up`)."""

    group: Group


Decision = Advance | GiveUp
Steps = Generator[Decision, None, T]  # a part's step: its decisions as it makes them, then its answer
