"""Hypothesis stateful test: the allocator against a plain reference model of its policy, over >= 10,000 operations.

Every step compares the whole state (slot -> adapter, pins, operator pins, draining slots, LRU order, free slots) and
the slot contents with the model, so the slot <-> adapter map is a bijection, a pinned slot is never evicted, the
LRU order is exact, byte bounds hold and nothing leaks (checked again at teardown, after releasing everything).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from adapter_manager import AdapterNotFoundError, BaseModelSpec
from adapter_manager.allocator import SlotAllocator, SlotLease
from adapter_manager.errors import AdapterNotPinnedError, SlotLoadError, SlotsExhaustedError
from adapter_manager.prepare import ModuleWeights, PreparedAdapter
from adapter_manager.slot_pool import SlotPool, SlotPoolConfig

from .test_slot_pool import make_prepared

SPEC = BaseModelSpec("stateful-llama", 8, 12, 1, 2, 1, 4)
SLOTS, RANK = 3, 2
NAMES = ["a", "b", "c", "d", "e", "f"]
names = st.sampled_from(NAMES)
MIN_OPERATIONS = 10_000


@dataclass
class Model:
    """The policy in its plainest form: lists and dicts, no locks, no tensors."""

    slot_of: dict[str, int] = field(default_factory=dict)  # live adapters (not draining)
    holder: dict[int, str] = field(default_factory=dict)  # occupied slot -> adapter (draining ones too)
    value: dict[int, float] = field(default_factory=dict)  # occupied slot -> the value its weights were filled with
    pins: dict[int, int] = field(default_factory=dict)
    manual: set[str] = field(default_factory=set)
    draining: set[int] = field(default_factory=set)
    lru: list[str] = field(default_factory=list)
    free: list[int] = field(default_factory=lambda: list(range(SLOTS)))

    def reserve(self, adapter_id: str, protect: set[str] = frozenset()) -> int:
        if self.free:
            slot = self.free.pop(0)
        else:
            victim = next(a for a in self.lru if a not in protect)
            self.lru.remove(victim)
            slot = self.slot_of.pop(victim)
        self.slot_of[adapter_id] = slot
        self.holder[slot] = adapter_id
        self.pins[slot] = 0
        return slot

    def free_slot(self, slot: int) -> None:
        adapter_id = self.holder.pop(slot)
        self.value.pop(slot, None)
        self.pins.pop(slot)
        self.draining.discard(slot)
        if self.slot_of.get(adapter_id) == slot:
            del self.slot_of[adapter_id]
        self.free = sorted(self.free + [slot])

    def unpin(self, slot: int) -> None:
        self.pins[slot] -= 1
        if self.pins[slot] == 0:
            if slot in self.draining:
                self.free_slot(slot)
            elif self.holder[slot] not in self.manual:
                self.lru.append(self.holder[slot])

    def evictable(self, excluding: set[str]) -> int:
        return len(self.free) + sum(1 for a in self.lru if a not in excluding)


class Catalog:
    """The registry seam: registered adapters by id (some refused by the pool), and one injectable fetch failure."""

    def __init__(self) -> None:
        self.prepared: dict[str, PreparedAdapter] = {}
        self.fail: str | None = None

    def __call__(self, adapter_id: str) -> PreparedAdapter:
        if adapter_id == self.fail:
            raise OSError(f"injected read failure for {adapter_id}")
        if adapter_id not in self.prepared:
            raise AdapterNotFoundError(adapter_id, "not registered")
        return self.prepared[adapter_id]

    def fails(self, adapter_id: str) -> bool:
        prepared = self.prepared.get(adapter_id)
        return adapter_id == self.fail or prepared is None or prepared.sha == "broken"


def broken(prepared: PreparedAdapter) -> PreparedAdapter:
    """The same adapter with its last module one column short: the slot pool refuses it."""
    modules = dict(prepared.modules)
    last = max(modules)
    modules[last] = ModuleWeights(modules[last].a[:, 1:], modules[last].bt, RANK)
    return PreparedAdapter(prepared.adapter_id, "broken", RANK, modules, prepared.storage)


class AllocatorMachine(RuleBasedStateMachine):
    operations = 0  # rules run, over every example of one run

    def __init__(self) -> None:
        super().__init__()
        self.pool = SlotPool(SPEC, SlotPoolConfig(max_slots=SLOTS, max_rank=RANK))
        self.catalog = Catalog()
        self.allocator = SlotAllocator(self.pool, self.catalog)
        self.model = Model()
        self.leases: list[tuple[SlotLease, list[int]]] = []
        self.values = iter(range(1, 1 << 30))
        self.first_key = SPEC.module_keys()[0]

    def _count(self) -> None:
        type(self).operations += 1

    def _loaded(self, adapter_id: str, slot: int) -> None:
        self.model.value[slot] = float(self.catalog.prepared[adapter_id].storage[0])

    @rule(adapter_id=names, is_broken=st.booleans(), partial=st.booleans())
    def register(self, adapter_id: str, is_broken: bool, partial: bool) -> None:
        self._count()
        if adapter_id in self.catalog.prepared:
            return
        modules = SPEC.module_keys()[::2] if partial else None
        prepared = make_prepared(SPEC, adapter_id, RANK, float(next(self.values)), modules)
        self.catalog.prepared[adapter_id] = broken(prepared) if is_broken and not partial else prepared

    @rule(adapter_id=names)
    def unregister(self, adapter_id: str) -> None:
        self._count()
        self.catalog.prepared.pop(adapter_id, None)
        self.allocator.forget(adapter_id)
        model = self.model
        if adapter_id not in model.slot_of:
            return
        slot = model.slot_of[adapter_id]
        if adapter_id in model.lru:
            model.lru.remove(adapter_id)
        model.manual.discard(adapter_id)
        if model.pins[slot] == 0:
            model.free_slot(slot)
        else:
            del model.slot_of[adapter_id]
            model.draining.add(slot)

    @rule(batch=st.lists(st.one_of(st.none(), names), max_size=5), fail=st.one_of(st.none(), names))
    def acquire(self, batch: list[str | None], fail: str | None) -> None:
        self._count()
        model, self.catalog.fail = self.model, fail
        distinct = list(dict.fromkeys(a for a in batch if a is not None))
        missing = [a for a in distinct if a not in model.slot_of]
        try:
            if len(missing) > model.evictable(set(distinct)):
                with pytest.raises(SlotsExhaustedError):
                    self.allocator.acquire(batch)
                return
            for adapter_id in distinct:
                if adapter_id in model.lru:
                    model.lru.remove(adapter_id)
                if adapter_id in model.slot_of:
                    model.pins[model.slot_of[adapter_id]] += 1
            reserved = [model.reserve(a) for a in missing]
            failed = next((i for i, a in enumerate(missing) if self.catalog.fails(a)), None)
            if failed is None:
                for adapter_id, slot in zip(missing, reserved, strict=True):
                    model.pins[slot] = 1
                    self._loaded(adapter_id, slot)
                lease = self.allocator.acquire(batch)
                slots = [model.slot_of[a] for a in distinct]
                assert dict(lease.slots) == dict(zip(distinct, slots, strict=True))
                self.leases.append((lease, slots))
                return
            for adapter_id, slot in zip(missing[:failed], reserved[:failed], strict=True):
                model.pins[slot] = 1
                self._loaded(adapter_id, slot)
            for slot in reserved[failed:]:
                model.free_slot(slot)
            culprit = missing[failed]
            unknown = culprit not in self.catalog.prepared and culprit != fail
            error = AdapterNotFoundError if unknown else SlotLoadError
            with pytest.raises(error, match=repr(culprit)):
                self.allocator.acquire(batch)
            for adapter_id in distinct:
                if adapter_id in model.slot_of:
                    model.unpin(model.slot_of[adapter_id])
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
        model = self.model
        if adapter_id in model.slot_of:
            assert self.allocator.pin(adapter_id) == model.slot_of[adapter_id]
            model.manual.add(adapter_id)
            if adapter_id in model.lru:
                model.lru.remove(adapter_id)
            return
        if model.evictable(set()) == 0:
            with pytest.raises(SlotsExhaustedError):
                self.allocator.pin(adapter_id)
            return
        slot = model.reserve(adapter_id)
        if self.catalog.fails(adapter_id):
            model.free_slot(slot)
            with pytest.raises((AdapterNotFoundError, SlotLoadError)):
                self.allocator.pin(adapter_id)
            return
        assert self.allocator.pin(adapter_id) == slot
        model.manual.add(adapter_id)
        self._loaded(adapter_id, slot)

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
        if model.pins[model.slot_of[adapter_id]] == 0:
            model.lru.append(adapter_id)

    @rule(adapter_id=names, protect=st.sets(names, max_size=3))
    def preload(self, adapter_id: str, protect: set[str]) -> None:
        self._count()
        model = self.model
        if adapter_id in model.slot_of or (not model.free and all(a in protect for a in model.lru)):
            assert self.allocator.preload(adapter_id, protect) is False
            return
        slot = model.reserve(adapter_id, protect)
        if self.catalog.fails(adapter_id):
            model.free_slot(slot)
            with pytest.raises((AdapterNotFoundError, SlotLoadError)):
                self.allocator.preload(adapter_id, protect)
            return
        assert self.allocator.preload(adapter_id, protect) is True
        model.lru.append(adapter_id)
        self._loaded(adapter_id, slot)

    @invariant()
    def matches_the_model(self) -> None:
        model, states = self.model, self.allocator.states()
        assert [s.slot for s in states] == sorted(model.holder)
        assert {s.slot: s.adapter_id for s in states} == model.holder
        assert {s.slot: s.pins for s in states} == model.pins
        assert {s.adapter_id for s in states if s.manual} == model.manual
        assert {s.slot for s in states if s.state == "draining"} == model.draining
        assert all(s.state != "loading" for s in states)
        assert self.allocator.lru_order() == model.lru
        assert self.allocator.free_slots() == model.free
        live = {s.adapter_id: s.slot for s in states if s.state == "ready"}
        assert live == model.slot_of and len(set(live.values())) == len(live)  # a bijection
        assert all(self.allocator.slot_of(a) == s for a, s in live.items())

    @invariant()
    def slots_hold_their_weights_and_bytes_are_bounded(self) -> None:
        a = self.pool.stacks[self.first_key].a  # [S, R, in]
        for slot, value in self.model.value.items():
            assert float(a[slot, 0, 0]) == value
        assert self.allocator.resident_bytes <= len(self.model.holder) * self.pool.slot_nbytes <= self.pool.nbytes

    def teardown(self) -> None:
        for lease, _ in self.leases:
            self.allocator.release(lease)
        for adapter_id in NAMES:
            if self.allocator.slot_of(adapter_id) is not None:
                try:
                    self.allocator.unpin(adapter_id)
                except AdapterNotPinnedError:
                    pass
        assert all(s.pins == 0 and not s.manual and s.state == "ready" for s in self.allocator.states())
        for adapter_id in NAMES:
            self.allocator.forget(adapter_id)
        assert self.allocator.free_slots() == list(range(SLOTS)) and self.allocator.states() == []
        assert self.allocator.resident_bytes == 0


def test_allocator_matches_its_reference_model_over_10000_operations():
    AllocatorMachine.operations = 0
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


def test_broken_helper_really_fails_to_load():
    pool = SlotPool(SPEC, SlotPoolConfig(max_slots=1, max_rank=RANK))
    with pytest.raises(SlotLoadError, match="has shape"):
        pool.load(0, broken(make_prepared(SPEC, "x", RANK, 5.0)))
