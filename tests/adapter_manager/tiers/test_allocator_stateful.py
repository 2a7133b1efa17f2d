"""Hypothesis stateful test: the allocator against a plain reference model of its policy, over >= 10,000 operations.

Adapters have mixed ranks (1..8 with granule 2: blocks of 1, 2 and 4 units in a pool of 8 units), so the run covers
buddy placement, eviction until a request fits, fragmentation (enough free units in total but no free range: evict
or refuse, nothing changed on refusal), lease and operator pins, failed loads (injected read errors, blocks the pool
or the allocator refuses), unregister while pinned (draining) and preload with `protect`. The model
(`_allocator_model`) places with a brute-force first fit over the maximal free aligned blocks, not with a buddy
allocator. Every step compares the whole state (ranges, units, ranks, pins, operator pins, draining ranges, LRU order,
free blocks, slot_of, bytes) and the pool's rows of every range with the adapter's block, and checks the zero row;
teardown releases everything and checks that nothing leaked.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from adapter_manager import AdapterNotFoundError, RowOptions
from adapter_manager.errors import AdapterNotPinnedError, SlotLoadError, SlotsExhaustedError
from adapter_manager.tiers.allocator import SlotAllocator, SlotLease
from adapter_manager.tiers.prepare import PreparedAdapter
from adapter_manager.tiers.row_space import Block
from adapter_manager.tiers.slot_pool import SlotPool, SlotPoolConfig, units_for
from tests.adapter_manager._fakes import make_prepared
from tests.adapter_manager.tiers._allocator_model import GRANULE, MAX_RANK, MAX_SLOTS, MAX_UNITS, NUM_UNITS, SPEC, Model

NAMES = ["a", "b", "c", "d", "e", "f", "g", "h"]
names = st.sampled_from(NAMES)
ranks = st.sampled_from([1, 1, 2, 2, 3, 4, 5, 8])  # mostly small: small pinned ranges split the space
kinds = st.sampled_from(["narrow", "rows"] + [""] * 6)  # a block the pool or the allocator refuses, or a good one
MIN_OPERATIONS = 10_000


@dataclass
class Entry:
    rank: int  # what rank_of reports
    prepared: PreparedAdapter
    broken: bool  # the pool or the allocator refuses the block


class Catalog:
    """The registry seam: registered adapters with their ranks, and one injectable fetch failure."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self.fail: str | None = None

    def rank_of(self, adapter_id: str) -> int:
        if adapter_id not in self.entries:
            raise AdapterNotFoundError(adapter_id, "not registered")
        return self.entries[adapter_id].rank

    def __call__(self, adapter_id: str) -> PreparedAdapter:
        if adapter_id == self.fail:
            raise OSError(f"injected read failure for {adapter_id}")
        return self.entries[adapter_id].prepared

    def fails(self, adapter_id: str) -> bool:
        return adapter_id == self.fail or self.entries[adapter_id].broken


def broken(prepared: PreparedAdapter, kind: str) -> PreparedAdapter:
    """The block one column short (the pool refuses it) or one row off the reported rank (the allocator does)."""
    if kind == "narrow":
        return PreparedAdapter(prepared.adapter_id, "broken", {}, prepared.storage[:, 1:])
    rows = prepared.rows + 1 if prepared.rows < MAX_RANK else prepared.rows - 1
    return make_prepared(SPEC, prepared.adapter_id, rows, float(prepared.storage[0, 0]))


class AllocatorMachine(RuleBasedStateMachine):
    operations = 0  # rules run, over every example of one run
    seen: Counter[str] = Counter()  # how often the interesting cases came up

    def __init__(self) -> None:
        super().__init__()
        self.pool = SlotPool(
            SPEC, SlotPoolConfig(max_slots=MAX_SLOTS, rows=RowOptions(max_rank=MAX_RANK), granule=GRANULE)
        )
        assert (self.pool.num_units, self.pool.max_units) == (NUM_UNITS, MAX_UNITS)
        self.catalog = Catalog()
        self.allocator = SlotAllocator(self.pool, self.catalog, self.catalog.rank_of)
        self.model = Model()
        self.leases: list[tuple[SlotLease, list[int]]] = []
        self.values = iter(range(1, 1 << 30))
        self.hits = self.misses = 0

    def _count(self) -> None:
        type(self).operations += 1

    def _bring_in(self, distinct: list[str], keep, pin: bool, manual: bool) -> tuple[Model, list[int]] | None | str:
        """The model's outcome of placing `distinct`: (new model, reserved slots), None (no fit) or the unknown id."""
        model = self.model
        missing = [a for a in distinct if a not in model.live]
        unknown = next((a for a in missing if a not in self.catalog.entries), None)
        if unknown is not None:
            type(self).seen["not registered"] += 1
            return unknown
        requests = [(a, self.catalog.entries[a].rank, self.catalog.entries[a].prepared.storage) for a in missing]
        plan = model.copy()
        reserved = plan.place(requests, keep)
        if reserved is None:
            return None
        if plan.evictions - model.evictions > 1:
            type(self).seen["evicted several"] += 1
        for adapter_id in distinct:
            slot = plan.live[adapter_id]
            if adapter_id in plan.lru:
                plan.lru.remove(adapter_id)
            if manual:
                plan.manual.add(adapter_id)
            elif pin:
                plan.ranges[slot].pins += 1
        if pin or manual:
            self.hits += len(distinct) - len(missing)
            self.misses += len(missing)
        return plan, reserved

    def _expect_refusal(self, call, distinct: list[str], keep) -> None:
        model = self.model
        missing = [a for a in distinct if a not in model.live]
        needed = sum(units_for(self.catalog.entries[a].rank, GRANULE) for a in missing)
        free, evictable = model.free_units(), model.evictable_units(keep)
        with pytest.raises(SlotsExhaustedError) as info:
            call()
        error = info.value
        assert (error.adapters, error.needed, error.free, error.evictable) == (tuple(missing), needed, free, evictable)
        assert error.fragmented == (needed <= free + evictable)
        type(self).seen["fragmented" if error.fragmented else "exhausted"] += 1

    def _loads(self, plan: Model, reserved: list[int], distinct: list[str], release_on_failure: bool) -> bool:
        """Apply the loads to `plan`: on the first failure free it and every later range; True when all loaded."""
        failed = next((i for i, s in enumerate(reserved) if self.catalog.fails(plan.ranges[s].adapter_id)), None)
        self.model = plan
        if failed is None:
            return True
        type(self).seen["failed load"] += 1
        for slot in reserved[failed:]:
            plan.free(slot)
        if release_on_failure:
            for adapter_id in distinct:
                if adapter_id in plan.live:
                    plan.unpin(plan.live[adapter_id])
        return False

    @initialize(ranks=st.lists(ranks, min_size=len(NAMES), max_size=len(NAMES)))
    def register_all(self, ranks: list[int]) -> None:
        for adapter_id, rank in zip(NAMES, ranks, strict=True):
            self._register(adapter_id, rank, "")

    @rule(adapter_id=names, rank=ranks, kind=kinds)
    def register(self, adapter_id: str, rank: int, kind: str) -> None:
        self._count()
        if adapter_id not in self.catalog.entries:
            self._register(adapter_id, rank, kind)

    def _register(self, adapter_id: str, rank: int, kind: str) -> None:
        prepared = make_prepared(SPEC, adapter_id, rank, float(next(self.values)), SPEC.module_keys()[::2])
        self.catalog.entries[adapter_id] = Entry(rank, broken(prepared, kind) if kind else prepared, bool(kind))

    @rule(adapter_id=names, again=st.booleans(), rank=ranks, kind=kinds)
    def unregister(self, adapter_id: str, again: bool, rank: int, kind: str) -> None:
        """Unregister; `again`: register anew at once (a new revision, maybe of another rank) while the old one
        may still be draining."""
        self._count()
        self.catalog.entries.pop(adapter_id, None)
        self.allocator.forget(adapter_id)
        if again:
            self._register(adapter_id, rank, kind)
        model = self.model
        if adapter_id not in model.live:
            return
        slot = model.live.pop(adapter_id)
        model.manual.discard(adapter_id)
        if adapter_id in model.lru:
            model.lru.remove(adapter_id)
        if model.ranges[slot].pins == 0:
            del model.ranges[slot]
        else:
            model.ranges[slot].draining = True
            type(self).seen["drained"] += 1

    @rule(batch=st.lists(st.one_of(st.none(), names), max_size=5), fail=st.one_of(st.none(), names))
    def acquire(self, batch: list[str | None], fail: str | None) -> None:
        self._count()
        self.catalog.fail = fail
        try:
            distinct = list(dict.fromkeys(a for a in batch if a is not None))
            outcome = self._bring_in(distinct, set(distinct), pin=True, manual=False)
            if isinstance(outcome, str):
                with pytest.raises(AdapterNotFoundError, match=repr(outcome)):
                    self.allocator.acquire(batch)
                return
            if outcome is None:
                self._expect_refusal(lambda: self.allocator.acquire(batch), distinct, set(distinct))
                return
            plan, reserved = outcome
            if not self._loads(plan, reserved, distinct, release_on_failure=True):
                with pytest.raises(SlotLoadError):
                    self.allocator.acquire(batch)
                return
            lease = self.allocator.acquire(batch)
            type(self).seen["leased"] += 1
            slots = [plan.live[a] for a in distinct]
            assert dict(lease.slots) == dict(zip(distinct, slots, strict=True))
            assert dict(lease.slot_rows) == {s: plan.ranges[s].rank for s in slots}
            assert lease.slot_indices(batch).tolist() == [-1 if a is None else plan.live[a] for a in batch]
            self.leases.append((lease, slots))
        finally:
            self.catalog.fail = None

    @precondition(lambda self: self.leases)
    @rule(index=st.integers(0, 63))
    def release(self, index: int) -> None:
        self._count()
        lease, slots = self.leases.pop(index % len(self.leases))
        self.allocator.release(lease)
        for slot in slots:
            self.model.unpin(slot)

    @rule(adapter_id=names)
    def pin(self, adapter_id: str) -> None:
        self._count()
        outcome = self._bring_in([adapter_id], {adapter_id}, pin=False, manual=True)
        if isinstance(outcome, str):
            with pytest.raises(AdapterNotFoundError):
                self.allocator.pin(adapter_id)
        elif outcome is None:
            self._expect_refusal(lambda: self.allocator.pin(adapter_id), [adapter_id], {adapter_id})
        elif not self._loads(*outcome, [adapter_id], release_on_failure=False):
            with pytest.raises(SlotLoadError):
                self.allocator.pin(adapter_id)
        else:
            assert self.allocator.pin(adapter_id) == self.model.live[adapter_id]

    @rule(adapter_id=names)
    def unpin(self, adapter_id: str) -> None:
        self._count()
        model = self.model
        if adapter_id not in model.manual:
            with pytest.raises(AdapterNotPinnedError):
                self.allocator.unpin(adapter_id)
            return
        self.allocator.unpin(adapter_id)
        model.manual.remove(adapter_id)
        if model.ranges[model.live[adapter_id]].pins == 0:
            model.lru.append(adapter_id)

    @rule(adapter_id=names, protect=st.sets(names, max_size=3))
    def preload(self, adapter_id: str, protect: set[str]) -> None:
        self._count()
        if adapter_id in self.model.live:
            assert self.allocator.preload(adapter_id, protect) is False
            return
        outcome = self._bring_in([adapter_id], protect, pin=False, manual=False)
        if isinstance(outcome, str):
            with pytest.raises(AdapterNotFoundError):
                self.allocator.preload(adapter_id, protect)
        elif outcome is None:
            type(self).seen["preload refused"] += 1
            assert self.allocator.preload(adapter_id, protect) is False
        elif not self._loads(*outcome, [adapter_id], release_on_failure=False):
            with pytest.raises(SlotLoadError):
                self.allocator.preload(adapter_id, protect)
        else:
            assert self.allocator.preload(adapter_id, protect) is True
            self.model.lru.append(adapter_id)

    @invariant()
    def matches_the_model(self) -> None:
        model, allocator = self.model, self.allocator
        expected = [
            (slot, r.adapter_id, "draining" if r.draining else "ready", r.units, r.rank, r.pins)
            + (not r.draining and r.adapter_id in model.manual,)
            for slot, r in sorted(model.ranges.items())
        ]
        states = allocator.states()
        assert [(s.slot, s.adapter_id, s.state, s.units, s.rank, s.pins, s.manual) for s in states] == expected
        assert allocator.lru_order() == model.lru
        assert allocator.free_blocks() == model.free_blocks()
        assert allocator.free_units() == model.free_units() == NUM_UNITS - sum(r.units for r in model.ranges.values())
        assert {a: allocator.slot_of(a) for a in NAMES} == {a: model.live.get(a) for a in NAMES}
        assert allocator.resident_bytes == sum(r.block.nbytes for r in model.ranges.values())

    @invariant()
    def rows_hold_their_blocks(self) -> None:
        rows = self.pool.rows  # [N, width]
        for slot, r in self.model.ranges.items():
            assert torch.equal(rows[slot * GRANULE : slot * GRANULE + r.rank], r.block), (slot, r.adapter_id)
        assert not rows[self.pool.zero_row].any()

    def teardown(self) -> None:
        for lease, _ in self.leases:
            self.allocator.release(lease)
        for adapter_id in list(self.model.manual):
            self.allocator.unpin(adapter_id)
        assert all(s.pins == 0 and not s.manual and s.state == "ready" for s in self.allocator.states())
        snapshot = self.allocator.metrics.snapshot()
        assert snapshot.evictions.get("slot", 0) == self.model.evictions
        assert (snapshot.hits.get("slot", 0), snapshot.misses.get("slot", 0)) == (self.hits, self.misses)
        for adapter_id in NAMES:
            self.allocator.forget(adapter_id)
        assert self.allocator.free_blocks() == [Block(0, MAX_UNITS), Block(MAX_UNITS, MAX_UNITS)]
        assert self.allocator.states() == [] and self.allocator.resident_bytes == 0


def test_allocator_matches_its_reference_model_over_10000_operations():
    AllocatorMachine.operations = 0
    AllocatorMachine.seen = Counter()
    run_state_machine_as_test(
        AllocatorMachine,
        settings=settings(
            max_examples=200,
            stateful_step_count=100,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    assert AllocatorMachine.operations >= MIN_OPERATIONS
    seen = AllocatorMachine.seen
    cases = ("evicted several", "fragmented", "exhausted", "failed load", "drained", "preload refused")
    assert all(seen[case] > 0 for case in cases), seen


@pytest.mark.parametrize("kind", ["narrow", "rows"])
def test_broken_blocks_really_fail_to_load(kind):
    pool = SlotPool(SPEC, SlotPoolConfig(max_slots=MAX_SLOTS, rows=RowOptions(max_rank=MAX_RANK), granule=GRANULE))
    catalog = Catalog()
    catalog.entries["x"] = Entry(3, broken(make_prepared(SPEC, "x", 3, 5.0), kind), True)
    allocator = SlotAllocator(pool, catalog, catalog.rank_of)
    with pytest.raises(SlotLoadError, match="the pool holds rows of" if kind == "narrow" else "4 rows but rank_of"):
        allocator.acquire(["x"])
    assert allocator.states() == [] and not pool.rows.any()
