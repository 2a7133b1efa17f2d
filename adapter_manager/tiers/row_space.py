"""The slot pool's units as a buddy allocator: which unit ranges are free, handed out in power-of-two blocks.

The space is ``num_units`` units tiled by top blocks of ``max_units`` units (a power of two). A block of ``2**k``
units starts at a multiple of ``2**k``; its buddy is the other half of the block of ``2**(k+1)`` it came from.

Policy (exact, so a reference model can mirror it):
- ``alloc(units)`` takes the lowest-addressed free block of the smallest order ``>= units`` that has a free block,
  splits it in halves down to ``units`` (each upper half becomes free) and returns its start; None when no free
  block is large enough.
- ``free(start, units)`` merges the block with its buddy while the buddy is free, up to ``max_units``.

So the free blocks are always the maximal aligned free blocks: they depend only on which blocks are allocated.

    Worked example, 8 units, max_units 4: alloc(1) -> 0 (splits [0,4) into [0,1) [1,2) [2,4)); alloc(2) -> 2;
    alloc(1) -> 1; alloc(4) -> 4; free(1, 1) leaves [1,2) free (its buddy [0,1) is allocated).
"""

from __future__ import annotations

from typing import NamedTuple


class Block(NamedTuple):
    """A run of units: ``[start, start + units)``."""

    start: int
    units: int


def _is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0


class RowSpace:
    """A buddy allocator over ``num_units`` units in blocks of 1, 2, 4, ... ``max_units`` units. Not thread-safe:
    its owner (the slot allocator) holds a lock."""

    def __init__(self, num_units: int, max_units: int) -> None:
        if not _is_power_of_two(max_units):
            raise ValueError(f"max_units must be a positive power of two, got {max_units!r}")
        if not isinstance(num_units, int) or num_units <= 0 or num_units % max_units:
            raise ValueError(f"num_units must be a positive multiple of max_units ({max_units}), got {num_units!r}")
        self.num_units = num_units
        self.max_units = max_units
        self._top = max_units.bit_length() - 1  # order of a top block
        self._free: list[set[int]] = [set() for _ in range(self._top + 1)]  # order -> starts of free blocks
        self._free[self._top] = set(range(0, num_units, max_units))
        self._allocated: dict[int, int] = {}  # start -> units of every allocated block
        self._free_units = num_units

    @property
    def free_units(self) -> int:
        """Units in free blocks."""
        return self._free_units

    def free_blocks(self) -> list[Block]:
        """Every free block, by start."""
        return sorted(Block(start, 1 << order) for order, starts in enumerate(self._free) for start in starts)

    def allocated_blocks(self) -> list[Block]:
        """Every allocated block, by start."""
        return sorted(Block(start, units) for start, units in self._allocated.items())

    def largest_free(self) -> int:
        """Units of the largest free block, 0 when none is free."""
        return next((1 << order for order in range(self._top, -1, -1) if self._free[order]), 0)

    def alloc(self, units: int) -> int | None:
        """Allocate a block of ``units`` units (a power of two <= max_units); its start, or None if none is free."""
        if not _is_power_of_two(units) or units > self.max_units:
            raise ValueError(f"units must be a power of two in 1..{self.max_units}, got {units!r}")
        want = units.bit_length() - 1
        order = next((k for k in range(want, self._top + 1) if self._free[k]), None)
        if order is None:
            return None
        start = min(self._free[order])
        self._free[order].remove(start)
        while order > want:
            order -= 1
            self._free[order].add(start + (1 << order))
        self._allocated[start] = units
        self._free_units -= units
        return start

    def free(self, start: int, units: int) -> None:
        """Free the allocated block ``[start, start + units)``, merging it with free buddies."""
        if self._allocated.get(start) != units:
            raise ValueError(
                f"no block of {units} unit(s) is allocated at {start} (allocated there: {self._allocated.get(start)})"
            )
        del self._allocated[start]
        self._free_units += units
        order = units.bit_length() - 1
        while order < self._top and (buddy := start ^ (1 << order)) in self._free[order]:
            self._free[order].remove(buddy)
            start = min(start, buddy)
            order += 1
        self._free[order].add(start)

    def clone(self) -> RowSpace:
        """An independent copy, to plan on."""
        copy = RowSpace.__new__(RowSpace)
        copy.num_units, copy.max_units, copy._top = self.num_units, self.max_units, self._top
        copy._free = [set(starts) for starts in self._free]
        copy._allocated = dict(self._allocated)
        copy._free_units = self._free_units
        return copy
