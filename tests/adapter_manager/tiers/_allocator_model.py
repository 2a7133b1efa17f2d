"""The allocator's policy in its plainest form, the reference the stateful test compares `SlotAllocator` with: the
pool it describes, its occupied ranges, and placement by brute-force first fit over the maximal free aligned blocks."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from adapter_manager import BaseModelSpec
from adapter_manager.tiers.row_space import Block
from adapter_manager.tiers.slot_pool import units_for
from tests.adapter_manager.tiers._brute_force import first_fit, maximal_free_blocks

SPEC = BaseModelSpec("stateful-llama", 8, 12, 1, 2, 1, 4)
MAX_SLOTS, MAX_RANK, GRANULE = 2, 8, 2  # 8 units of 2 rows; ranks 1-2, 3-4, 5-8 take 1, 2, 4 units
NUM_UNITS, MAX_UNITS = 8, 4


@dataclass
class Range:
    """One occupied range in the model."""

    adapter_id: str
    rank: int
    block: torch.Tensor  # Shape: [rank, width], what its rows must hold
    pins: int = 0
    draining: bool = False

    @property
    def units(self) -> int:
        return units_for(self.rank, GRANULE)


@dataclass
class Model:
    """The policy in its plainest form: dicts and lists, no locks, no buddy allocator."""

    ranges: dict[int, Range] = field(default_factory=dict)  # slot -> occupied range (draining ones too)
    live: dict[str, int] = field(default_factory=dict)  # adapter -> slot, not draining
    manual: set[str] = field(default_factory=set)
    lru: list[str] = field(default_factory=list)
    evictions: int = 0

    def copy(self) -> Model:
        ranges = {slot: replace(r) for slot, r in self.ranges.items()}
        return Model(ranges, dict(self.live), set(self.manual), list(self.lru), self.evictions)

    def free_blocks(self) -> list[Block]:
        used = [False] * NUM_UNITS
        for slot, r in self.ranges.items():
            used[slot : slot + r.units] = [True] * r.units
        return maximal_free_blocks(used, MAX_UNITS)

    def free_units(self) -> int:
        return sum(b.units for b in self.free_blocks())

    def evictable_units(self, keep) -> int:
        return sum(self.ranges[self.live[a]].units for a in self.lru if a not in keep)

    def place(self, missing: list[tuple[str, int, torch.Tensor]], keep) -> list[int] | None:
        """Place each missing adapter in order, evicting the LRU adapter not in `keep` until it fits (mutates)."""
        candidates = [a for a in self.lru if a not in keep]
        slots = []
        for adapter_id, rank, block in missing:
            while (slot := first_fit(self.free_blocks(), units_for(rank, GRANULE))) is None:
                if not candidates:
                    return None
                victim = candidates.pop(0)
                self.lru.remove(victim)
                del self.ranges[self.live.pop(victim)]
                self.evictions += 1
            self.ranges[slot] = Range(adapter_id, rank, block)
            self.live[adapter_id] = slot
            slots.append(slot)
        return slots

    def free(self, slot: int) -> None:
        adapter_id = self.ranges.pop(slot).adapter_id
        if self.live.get(adapter_id) == slot:
            del self.live[adapter_id]
            self.manual.discard(adapter_id)
            if adapter_id in self.lru:
                self.lru.remove(adapter_id)

    def unpin(self, slot: int) -> None:
        r = self.ranges[slot]
        r.pins -= 1
        if r.pins == 0:
            if r.draining:
                self.free(slot)
            elif r.adapter_id not in self.manual:
                self.lru.append(r.adapter_id)
