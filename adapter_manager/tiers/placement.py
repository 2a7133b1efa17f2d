"""Planning one allocator call on a copy of the space: which adapters to evict, in which order, and where each
missing adapter goes. Pure functions over the allocator's state; the allocator commits a plan only if one exists,
so a refusal changes nothing.

    Worked example, 4 units, max_units 2, LRU order a (units [0,2)), b ([2,3)); placing x of 2 units with nothing
    free: the clone frees a's block, x takes [0,2): Plan(victims=(a,), starts=(0,)). Placing x and y of 2 units each
    with `keep={"b"}`: after a, no victim is left for y, so the plan is None.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass

from .lease import Residency
from .row_space import RowSpace


@dataclass(frozen=True)
class Plan:
    """A call's placement worked out on a copy of the space: adopt `space`, evict `victims`, occupy `starts`."""

    space: RowSpace
    victims: tuple[Residency, ...]  # in eviction order
    starts: tuple[int, ...]  # slot of each missing adapter, in call order


def eviction_candidates(
    lru: Mapping[str, Residency],
    keep: Container[str],
    frequency: Callable[[str], int] | None,
    ceiling: int | None = None,
) -> list[Residency]:
    """Evictable adapters (`lru`, least recently used first) not in `keep`, least valuable first: by (estimated
    frequency, recency) with a `frequency`, else LRU; with `ceiling`, only those no more popular than it."""
    candidates = [r for a, r in lru.items() if a not in keep]
    if frequency is None:
        return candidates
    scored = [(frequency(r.adapter_id), i, r) for i, r in enumerate(candidates)]
    if ceiling is not None:
        scored = [entry for entry in scored if entry[0] <= ceiling]
    return [r for _, _, r in sorted(scored, key=lambda entry: entry[:2])]


def plan_placement(space: RowSpace, candidates: Sequence[Residency], units: Sequence[int]) -> Plan | None:
    """Place requests of `units` units in order on a clone of `space`, evicting `candidates` in order until each
    fits; None when they cannot all be placed (too few units, or fragmentation after every eviction)."""
    space = space.clone()
    remaining = iter(candidates)
    victims, starts = [], []
    for need in units:
        while (start := space.alloc(need)) is None:
            victim = next(remaining, None)
            if victim is None:
                return None
            space.free(victim.slot, victim.units)
            victims.append(victim)
        starts.append(start)
    return Plan(space, tuple(victims), tuple(starts))
