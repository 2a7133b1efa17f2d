"""Brute-force references for the buddy policy of `RowSpace`: the maximal free aligned blocks, and first fit."""

from __future__ import annotations

from adapter_manager.tiers.row_space import Block


def maximal_free_blocks(used: list[bool], max_units: int) -> list[Block]:
    """Brute force: the largest aligned power-of-two runs (<= max_units) of free units, each free unit in one."""
    blocks, covered, size = [], [False] * len(used), max_units
    while size >= 1:
        for start in range(0, len(used), size):
            run = range(start, start + size)
            if not any(used[u] or covered[u] for u in run):
                blocks.append(Block(start, size))
                for u in run:
                    covered[u] = True
        size //= 2
    return sorted(blocks)


def first_fit(free: list[Block], units: int) -> int | None:
    """Brute force of the buddy policy: the lowest-addressed free block of the smallest size >= units."""
    fitting = [b for b in free if b.units >= units]
    return min(fitting, key=lambda b: (b.units, b.start)).start if fitting else None
