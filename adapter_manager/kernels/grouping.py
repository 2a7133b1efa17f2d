"""Where each active adapter lives in the row pool, and the step's tokens grouped by slot (eager backends).

The row pool holds slot s's adapter of rank r in rows ``[s·G, s·G + r)`` (G = granule). The eager forms read those
rows as a plain slice of the pool (:class:`AdapterRows`), so their cost follows the active adapters only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class AdapterRows(NamedTuple):
    """One active slot's adapter: pool rows ``[first, first + rank)``."""

    slot: int
    first: int
    """s·G, the adapter's first row in the pool."""
    rank: int
    """r_s, its row count (1 ≤ r_s ≤ R); rows past it hold stale data and are never read."""

    @property
    def rows(self) -> slice:
        return slice(self.first, self.first + self.rank)


class Segment(NamedTuple):
    """Tokens ``[start, start + count)`` of one token order, all of one adapter."""

    adapter: AdapterRows
    start: int
    count: int

    @property
    def tokens(self) -> slice:
        return slice(self.start, self.start + self.count)


@dataclass(frozen=True)
class SlotGrouping:
    """Tokens sorted by slot once per step; per-slot matmuls on the sorted rows, or, padded per active slot, one
    batched matmul against the compact table (:mod:`kernels.active_table`).

    Worked example, slot indices ``[2, -1, 0, 2, 2]`` (T = 5), active slots (0, 2) with 1 and 3 tokens:
      order        ``[2, 0, 3, 4]``                  (the tokens with a slot, sorted by slot, stable)
      segments     slot 0: start 0, count 1; slot 2: start 1, count 3   (into ``order``)
      capacity C = 3; padded (2·3 = 6 cells ≤ 1.5 × 4 tokens):
      gather_index ``[[2, 2, 2], [0, 3, 4]]``        (row per compact slot; padding repeats a real token)
      valid        ``[[T, F, F], [T, T, T]]``        (padding cells are zeroed before anything is added)
    Token 1 (slot -1) appears nowhere, so it receives exactly nothing.
    """

    order: torch.Tensor
    """Shape: [n] int64, the n tokens with a slot, sorted by slot (stable)."""
    segments: tuple[Segment, ...]
    """One per active slot, ascending by slot (the compact order), into ``order``."""
    capacity: int
    """C, the largest token count of any active slot."""
    padded: bool
    """Use the padded batched form; False when padding would waste too much (skewed mixes): per-slot matmuls."""
    gather_index: torch.Tensor | None
    """Padded only. Shape: [k·C] int64, the token of each (compact slot, position) cell."""
    valid: torch.Tensor | None
    """Padded only. Shape: [k, C, 1] bool: True for real cells, False for padding."""


_MAX_PADDING_WASTE = 1.5
"""Padded grouping is used while k·C ≤ this × the assigned tokens."""


def group_by_slot(
    token_slots: torch.Tensor, adapters: tuple[AdapterRows, ...], counts: tuple[int, ...], num_slots: int
) -> SlotGrouping:
    """Group the step's tokens. ``token_slots``: Shape: [T] int32 on the device; ``adapters``/``counts``: the active
    slots ascending and their token counts (host ints)."""
    device = token_slots.device
    capacity = max(counts)
    slots = token_slots.long()
    # a stable sort puts each slot's tokens together in token order; -1 tokens go to the end
    order = torch.argsort(torch.where(slots < 0, num_slots, slots), stable=True)
    segments, offset = [], 0
    for adapter, count in zip(adapters, counts, strict=True):
        segments.append(Segment(adapter, offset, count))
        offset += count
    assigned = offset
    padded = capacity * len(counts) <= _MAX_PADDING_WASTE * assigned
    gather_index = valid = None
    if padded:
        count_t = torch.tensor(counts, device=device)[:, None]
        pos = torch.arange(capacity, device=device)[None, :]
        starts = torch.tensor([s.start for s in segments], device=device)[:, None]
        gather_index = order[starts + torch.minimum(pos, count_t - 1)].reshape(-1)
        valid = (pos < count_t)[:, :, None]
    return SlotGrouping(order[:assigned], tuple(segments), capacity, padded, gather_index, valid)


def slot_runs(slots: list[int]) -> tuple[dict[int, int], list[tuple[int, int, int]]]:
    """(token count per slot ≥ 0, each maximal run of one slot ≥ 0 as (slot, start, count)) of a step's slots in
    token order; -1 runs are left out. Plain Python: for a step's few host ints it is several times faster than
    numpy's per-call overhead, and a step's host work is on its critical path.

    Example: ``[2, 2, -1, 0, 0, 0, 2]`` -> counts {2: 3, 0: 3}, runs (2, 0, 2), (0, 3, 3), (2, 6, 1).
    """
    counts: dict[int, int] = {}
    runs: list[tuple[int, int, int]] = []
    start, previous = 0, -1
    for index, slot in enumerate(slots):
        if slot != previous:
            if previous >= 0:
                runs.append((previous, start, index - start))
            start, previous = index, slot
        if slot >= 0:
            counts[slot] = counts.get(slot, 0) + 1
    if previous >= 0:
        runs.append((previous, start, len(slots) - start))
    return counts, runs
