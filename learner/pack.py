"""Which tokens go where: length-balanced rank shards, sequences packed into rows, rows into micro-batches.

    a batch's items ─balance_shards─▶ one share per rank ─pack_rows─▶ rows ─group_rows─▶ micro-batches

Every rank plans every rank's share from the same items (rank 0 broadcast them), so all ranks agree, with no
collective, on how many micro-batches there are: a rank with fewer runs masked-out filler micro-batches, because
every forward and backward is collective at ZeRO-3 (docs/architecture.md, "Learner at scale"). Only lengths are
planned here; learner/batch.py turns a plan into tensors.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MicroBatch:
    """Rows of item indices (a packed row lays its items end to end; unpacked, a row holds one item)."""

    rows: tuple[tuple[int, ...], ...]
    filler: bool = False  # a masked-out stand-in, trained with loss mask 0 so that ranks run as many micro-batches

    def shape(self, lengths: list[int]) -> tuple[int, int]:
        """(rows, padded row length)."""
        return len(self.rows), max(sum(lengths[i] for i in row) for row in self.rows)


def balance_shards(lengths: list[int], world_size: int) -> list[list[int]]:
    """Item indices per rank, greedy by token count: longest item first, each to the rank with the fewest tokens so
    far (lowest rank on a tie). Within a share, items keep their batch order."""
    shares: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = min(range(world_size), key=lambda r: (load[r], r))
        shares[target].append(index)
        load[target] += lengths[index]
    return [sorted(share) for share in shares]


def pack_rows(indices: list[int], lengths: list[int], row_tokens: int) -> list[list[int]]:
    """First-fit decreasing: each item, longest first, into the first row it fits in (rows hold at most row_tokens;
    an item longer than that has a row of its own)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for index in sorted(indices, key=lambda i: (-lengths[i], i)):
        n = lengths[index]
        for row, free in enumerate(room):
            if n <= free:
                rows[row].append(index)
                room[row] -= n
                break
        else:
            rows.append([index])
            room.append(max(row_tokens - n, 0))
    return rows


def group_rows(rows: list[list[int]], lengths: list[int], micro_batch_tokens: int) -> list[MicroBatch]:
    """Rows, longest first, into micro-batches of at most micro_batch_tokens (rows x longest row: padding counts);
    a row longer than the budget is a micro-batch of its own."""
    row_length = [sum(lengths[i] for i in row) for row in rows]
    order = sorted(range(len(rows)), key=lambda r: (-row_length[r], r))
    groups: list[list[int]] = []
    for r in order:
        # rows come longest first, so a group's padded length is its first row's
        if groups and (len(groups[-1]) + 1) * row_length[groups[-1][0]] <= micro_batch_tokens:
            groups[-1].append(r)
        else:
            groups.append([r])
    return [MicroBatch(rows=tuple(tuple(rows[r]) for r in group)) for group in groups]


def plan_shards(
    lengths: list[int], world_size: int, micro_batch_tokens: int, packing: bool = True,
    pack_row_tokens: int | None = None,
) -> list[list[MicroBatch]]:
    """Every rank's micro-batches, as many on each rank (fillers: a masked copy of the batch's shortest item)."""
    if not lengths:
        raise ValueError("plan_shards: a batch needs at least one item")
    row_tokens = pack_row_tokens or micro_batch_tokens
    plans = []
    for share in balance_shards(lengths, world_size):
        rows = pack_rows(share, lengths, row_tokens) if packing else [[i] for i in share]
        plans.append(group_rows(rows, lengths, micro_batch_tokens))
    shortest = min(range(len(lengths)), key=lambda i: (lengths[i], i))
    filler = MicroBatch(rows=((shortest,),), filler=True)
    count = max(len(plan) for plan in plans)
    return [plan + [filler] * (count - len(plan)) for plan in plans]


def padding_fraction(plans: list[list[MicroBatch]], lengths: list[int]) -> float:
    """The share of the tensors' token slots (fillers included: they are computed too) that hold no real token."""
    slots = real = 0
    for plan in plans:
        for micro in plan:
            rows, width = micro.shape(lengths)
            slots += rows * width
            real += 0 if micro.filler else sum(lengths[i] for row in micro.rows for i in row)
    return 1.0 - real / slots
