"""The FIFO of training items waiting for a learner, and the batches a learner holds.

Immediate items and corrections share one queue in arrival order. Items leave it from the front (served) or
from anywhere (an immediate superseded by its group's correction), and a batch whose learner vanished goes
back to the front; an ordered dict gives all three in O(1). The queued corrections are also kept apart, so the
correction guard counts them without walking a queue that may hold thousands of immediate items.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from replay.store import QueuedItem


class ItemQueue:
    def __init__(self) -> None:
        self._items: OrderedDict[int, QueuedItem] = OrderedDict()
        self._corrections: dict[int, QueuedItem] = {}  # the queued corrections, by item id

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[QueuedItem]:
        """The items front to back."""
        return iter(self._items.values())

    def corrections(self) -> list[QueuedItem]:
        """The queued corrections (in no particular order)."""
        return list(self._corrections.values())

    def append(self, queued: QueuedItem) -> None:
        self._items[queued.item_id] = queued
        if queued.kind == "correction":
            self._corrections[queued.item_id] = queued

    def pop_front(self) -> QueuedItem:
        queued = self._items.popitem(last=False)[1]
        self._corrections.pop(queued.item_id, None)
        return queued

    def push_front(self, items: Iterable[QueuedItem]) -> None:
        """Put items back at the front, keeping their order."""
        for queued in reversed(list(items)):
            self._items[queued.item_id] = queued
            self._items.move_to_end(queued.item_id, last=False)
            if queued.kind == "correction":
                self._corrections[queued.item_id] = queued

    def move_to_front(self, items: Iterable[QueuedItem]) -> None:
        """Move queued items to the front, keeping their order (they must be in the queue)."""
        for queued in reversed(list(items)):
            self._items.move_to_end(queued.item_id, last=False)

    def get(self, item_id: int) -> QueuedItem | None:
        return self._items.get(item_id)

    def remove(self, item_id: int) -> None:
        self._items.pop(item_id, None)
        self._corrections.pop(item_id, None)


@dataclass(slots=True)
class InFlightBatch:
    """A batch served to a learner and not yet acknowledged."""

    items: list[QueuedItem]
    sent_at: float


def batch_cost(packed: bool, longest: int, total: int, count: int, n: int) -> int:
    """A batch's tokens as learner.batch_budget counts them (`packed`: summed, else padded), once an item of n tokens
    joins `count` items whose longest has `longest` tokens and whose sum is `total`."""
    return total + n if packed else max(longest, n) * (count + 1)
