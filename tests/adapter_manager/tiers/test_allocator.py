"""The slot allocator on CPU: buddy placement, hits, LRU eviction until fit, fragmentation, pins, exhaustion, failed
loads, unregister, preload, threads, metrics (the unit space alone: test_row_space)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from adapter_manager import (
    AdapterNotFoundError,
    AdapterRegistry,
    Move,
    RegistryConfig,
    RowOptions,
    write_synthetic_adapter,
)
from adapter_manager.errors import AdapterNotPinnedError, SlotLoadError, SlotsExhaustedError
from adapter_manager.tiers.allocator import SlotAllocator
from adapter_manager.tiers.prepare import PreparedAdapter
from adapter_manager.tiers.slot_pool import SlotPool, SlotPoolConfig
from tests.adapter_manager._fakes import Catalog, allocator_for, make_prepared


@pytest.fixture
def catalog(tiny_spec):
    catalog = Catalog(tiny_spec)
    catalog.add("a", "b", "c", "d")
    return catalog


def assert_rows_hold(allocator: SlotAllocator, catalog: Catalog, slots) -> None:
    pool = allocator.pool
    for adapter_id, slot in dict(slots).items():
        block = catalog.adapters[adapter_id].storage
        assert torch.equal(pool.rows[slot * pool.granule : slot * pool.granule + block.shape[0]], block), adapter_id


def test_acquire_loads_pins_and_hits(tiny_spec, catalog):
    allocator = allocator_for(tiny_spec, catalog)
    lease = allocator.acquire(["a", None, "b", "a"])
    assert dict(lease.slots) == {"a": 0, "b": 1} and dict(lease.slot_rows) == {0: 4, 1: 4}
    assert_rows_hold(allocator, catalog, lease.slots)
    assert lease.slot_indices(["a", None, "b", "a"]).tolist() == [0, -1, 1, 0]
    padded = lease.slot_indices(["b"], pad_to=4)
    assert padded.dtype == torch.int32 and padded.tolist() == [1, -1, -1, -1]
    with pytest.raises(AdapterNotPinnedError, match="'c'"):
        lease.slot_indices(["c"])
    assert allocator.lru_order() == []
    allocator.release(lease)
    assert allocator.lru_order() == ["a", "b"]
    again = allocator.acquire(["b"])
    assert dict(again.slots) == {"b": 1} and catalog.fetches == ["a", "b"]
    snapshot = allocator.metrics.snapshot()
    assert snapshot.hits["slot"] == 1 and snapshot.misses["slot"] == 2
    assert snapshot.moves[Move.HOST_TO_SLOT].count == 2
    assert snapshot.moves[Move.HOST_TO_SLOT].total_bytes == 2 * allocator.pool.slot_nbytes
    assert snapshot.stall.count == 2
    assert allocator.resident_bytes == 2 * allocator.pool.slot_nbytes


def test_lru_victim_is_evicted_and_pinned_never(tiny_spec, catalog):
    allocator = allocator_for(tiny_spec, catalog)
    allocator.release(allocator.acquire(["a"]))
    allocator.release(allocator.acquire(["b"]))
    allocator.release(allocator.acquire(["a"]))  # b is now the least recently used
    lease_c = allocator.acquire(["c"])
    assert lease_c.slots["c"] == 1 and allocator.slot_of("b") is None
    assert_rows_hold(allocator, catalog, lease_c.slots)
    with pytest.raises(SlotsExhaustedError) as info:
        allocator.acquire(["b", "d"])  # a is evictable, c is pinned: one unit for two adapters
    assert info.value.adapters == ("b", "d") and (info.value.needed, info.value.available) == (2, 1)
    assert not info.value.fragmented
    assert allocator.lru_order() == ["a"] and allocator.slot_of("a") == 0  # nothing changed
    assert allocator.metrics.snapshot().evictions == {"slot": 1}


def test_too_many_units_raise_without_pinning(tiny_spec, catalog):
    allocator = allocator_for(tiny_spec, catalog)
    allocator.release(allocator.acquire(["a"]))
    with pytest.raises(SlotsExhaustedError, match=r"'b, c'.*needs 2 unit.s. but only 1 of 2 are free \(1\) or evic"):
        allocator.acquire(["a", "b", "c"])
    assert allocator.lru_order() == ["a"] and [s.pins for s in allocator.states()] == [0]


def test_mixed_ranks_pack_by_the_buddy_policy(tiny_spec):
    catalog = Catalog(tiny_spec)
    catalog.add("a", "c", rank=1)
    catalog.add("b", rank=2)
    catalog.add("d", rank=3)
    allocator = allocator_for(tiny_spec, catalog, granule=1)  # 8 units of one row, blocks up to 4 units
    leases = [allocator.acquire([a]) for a in ("a", "b", "c", "d")]
    assert [dict(lease.slots) for lease in leases] == [{"a": 0}, {"b": 2}, {"c": 1}, {"d": 4}]
    assert [dict(lease.slot_rows) for lease in leases] == [{0: 1}, {2: 2}, {1: 1}, {4: 3}]
    assert [(s.slot, s.adapter_id, s.units, s.rank) for s in allocator.states()] == [
        (0, "a", 1, 1),
        (1, "c", 1, 1),
        (2, "b", 2, 2),
        (4, "d", 4, 3),
    ]
    for lease in leases:
        assert_rows_hold(allocator, catalog, lease.slots)
    assert allocator.free_units() == 0 and allocator.free_blocks() == []
    assert allocator.resident_bytes == sum(p.nbytes for p in catalog.adapters.values())


def test_eviction_until_fit_follows_lru_order_and_fragmentation_is_refused_cleanly(tiny_spec):
    catalog = Catalog(tiny_spec)
    catalog.add("a", "c", "g", rank=1)
    catalog.add("b", rank=2)
    catalog.add("e", rank=4)
    allocator = allocator_for(tiny_spec, catalog, granule=1)
    pinned = [allocator.acquire(["a"]), allocator.acquire(["b"]), allocator.acquire(["c"]), allocator.acquire(["g"])]
    assert [lease.slots for lease in pinned] == [{"a": 0}, {"b": 2}, {"c": 1}, {"g": 4}]
    allocator.release(pinned[1])
    allocator.release(pinned[2])  # LRU: b, c; a (unit 0) and g (unit 4) stay pinned, one in each top block
    before = (allocator.states(), allocator.lru_order(), allocator.free_blocks())
    assert allocator.free_blocks() == [(5, 1), (6, 2)]
    fragmented = r"'e'.*needs 4 unit.s. and 6 of 8 are free \(3\) or evictable \(3\), but no free range is large"
    with pytest.raises(SlotsExhaustedError, match=fragmented) as info:
        allocator.acquire(["e"])
    assert info.value.fragmented and (info.value.free, info.value.evictable) == (3, 3)
    assert (allocator.states(), allocator.lru_order(), allocator.free_blocks()) == before  # nothing changed
    assert allocator.metrics.snapshot().evictions == {} and catalog.fetches == ["a", "b", "c", "g"]
    allocator.release(pinned[3])  # g evictable too: LRU b, c, g
    lease = allocator.acquire(["e"])  # evicts b, then c (still no 4-unit range, a pins unit 0), then g
    assert lease.slots == {"e": 4} and allocator.lru_order() == [] and allocator.free_blocks() == [(1, 1), (2, 2)]
    assert allocator.metrics.snapshot().evictions == {"slot": 3}
    assert_rows_hold(allocator, catalog, {"a": 0, "e": 4})


def test_a_failed_load_leaves_its_range_free_and_nothing_pinned(tiny_spec, catalog):
    allocator = allocator_for(tiny_spec, catalog, slots=3)
    allocator.release(allocator.acquire(["a"]))
    catalog.fail.add("c")
    with pytest.raises(SlotLoadError, match="'c': loading into slot 2 failed: injected failure"):
        allocator.acquire(["a", "b", "c"])
    assert allocator.free_blocks() == [(2, 1)] and allocator.lru_order() == ["a", "b"]
    assert all(s.pins == 0 and s.state == "ready" for s in allocator.states())
    with pytest.raises(AdapterNotFoundError, match="'zzz'"):
        allocator.acquire(["c", "zzz"])  # rank_of's typed error passes through before anything changes
    assert allocator.free_blocks() == [(2, 1)] and allocator.lru_order() == ["a", "b"]
    catalog.fail.add("d")
    with pytest.raises(SlotLoadError, match="'d'"):
        allocator.acquire(["d", "c"])  # d takes free unit 2, c evicts a (unit 0); d fails: both freed, c unloaded
    assert allocator.free_blocks() == [(0, 1), (2, 1)] and allocator.lru_order() == ["b"]
    assert allocator.slot_of("c") is None and allocator.acquire(["c"]).slots["c"] == 0


def test_a_refused_block_is_never_published(tiny_spec, catalog):
    allocator = allocator_for(tiny_spec, catalog)
    catalog.adapters["a"] = make_prepared(tiny_spec, "a", 3, 1.0)  # rank_of still says 4
    with pytest.raises(SlotLoadError, match="'a'.*prepared block has 3 rows but rank_of gave rank 4"):
        allocator.acquire(["a"])
    good = catalog.adapters["b"]
    catalog.adapters["b"] = PreparedAdapter("b", "x", {}, good.storage[:, 1:])  # one column short
    with pytest.raises(SlotLoadError, match="'b'.*the pool holds rows of"):
        allocator.acquire(["b"])
    catalog.ranks["c"] = 9
    with pytest.raises(SlotLoadError, match="'c'.*rank 9 is outside 1..max_rank 4"):
        allocator.acquire(["c"])
    assert allocator.free_units() == 2 and allocator.states() == [] and catalog.fetches == ["a", "b"]
    assert not allocator.pool.rows.any()


def test_release_twice_and_unknown_unpin_are_refused(tiny_spec, catalog):
    allocator = allocator_for(tiny_spec, catalog)
    lease = allocator.acquire(["a"])
    allocator.release(lease)
    with pytest.raises(AdapterNotPinnedError, match="released twice"):
        allocator.release(lease)
    with pytest.raises(AdapterNotPinnedError, match="'a'"):
        allocator.unpin("a")


def test_operator_pin_keeps_an_adapter_resident(tiny_spec, catalog):
    allocator = allocator_for(tiny_spec, catalog)
    assert allocator.pin("a") == 0 and allocator.pin("a") == 0
    allocator.release(allocator.acquire(["b"]))
    allocator.release(allocator.acquire(["c"]))  # evicts b, never a
    assert allocator.slot_of("a") == 0 and allocator.slot_of("b") is None
    with pytest.raises(SlotsExhaustedError):
        allocator.acquire(["b", "d"])
    allocator.unpin("a")
    assert allocator.lru_order() == ["c", "a"]


def _pin_waiting_for(allocator: SlotAllocator, adapter_id: str, free) -> bool:
    """Pin `adapter_id` (no room) on a thread, check it waits, call `free`; whether the pin then took the freed
    range promptly (woken by `free`, not by its 30 s timeout)."""
    pinned: list[int] = []
    waiter = threading.Thread(target=lambda: pinned.append(allocator.pin(adapter_id, wait_s=30)))
    waiter.start()
    time.sleep(0.2)
    assert not pinned and waiter.is_alive()  # waiting, not failing
    start = time.monotonic()
    free()
    waiter.join(timeout=30)
    return bool(pinned) and time.monotonic() - start < 5 and allocator.slot_of(adapter_id) == pinned[0]


def test_a_waiting_pin_takes_the_room_a_release_makes_and_times_out_cleanly(tiny_spec, catalog):
    """`pin(wait_s=...)` (the cluster's loader): no room -> it waits for a release, an unpin or an unregister, and
    takes the freed range as soon as one happens; with none it raises after wait_s, changing nothing."""
    allocator = allocator_for(tiny_spec, catalog)
    allocator.pin("a")
    lease = allocator.acquire(["b"])  # both units held: a by the operator, b by a running batch
    start = time.monotonic()
    with pytest.raises(SlotsExhaustedError):
        allocator.pin("c", wait_s=0.2)
    assert time.monotonic() - start >= 0.2 and allocator.slot_of("c") is None
    assert [(s.adapter_id, s.manual, s.pins) for s in allocator.states()] == [("a", True, 0), ("b", False, 1)]
    assert _pin_waiting_for(allocator, "c", lambda: allocator.release(lease))
    allocator.unpin("c")
    allocator.pin("d")  # fill the room again (evicting c), then free it another way
    lease = allocator.acquire(["d"])
    assert _pin_waiting_for(allocator, "c", lambda: allocator.unpin("a"))
    allocator.release(lease)


def test_unregister_frees_unpinned_at_once_and_pinned_at_last_release(tiny_spec, catalog):
    allocator = allocator_for(tiny_spec, catalog)
    allocator.release(allocator.acquire(["a"]))
    allocator.forget("a")
    assert allocator.free_blocks() == [(0, 1), (1, 1)] and allocator.lru_order() == []
    first, second = allocator.acquire(["b"]), allocator.acquire(["b"])
    allocator.forget("b")
    assert allocator.slot_of("b") is None and [s.state for s in allocator.states()] == ["draining"]
    catalog.adapters["b"] = make_prepared(tiny_spec, "b", 4, 7.0)  # re-registered with new weights
    fresh = allocator.acquire(["b"])  # loads afresh into another range while the old one drains
    assert fresh.slots["b"] == 1
    assert_rows_hold(allocator, catalog, fresh.slots)
    allocator.release(first)
    assert allocator.free_blocks() == []
    allocator.release(second)
    assert allocator.free_blocks() == [(0, 1)] and allocator.slot_of("b") == 1


def test_preload_evicts_only_unprotected_and_changes_nothing_when_it_cannot_fit(tiny_spec):
    catalog = Catalog(tiny_spec)
    catalog.add("a", "b", rank=4)
    catalog.add("c", "d", rank=1)
    allocator = allocator_for(tiny_spec, catalog, granule=1)
    allocator.release(allocator.acquire(["a", "b"]))
    assert allocator.preload("c", protect={"a", "b"}) is False
    assert allocator.lru_order() == ["a", "b"] and catalog.fetches == ["a", "b"]
    assert allocator.preload("c", protect={"a"}) is True  # evicts b, not the older but protected a
    assert allocator.lru_order() == ["a", "c"] and allocator.slot_of("c") == 4
    assert [s.pins for s in allocator.states()] == [0, 0] and allocator.preload("c") is False
    assert allocator.metrics.snapshot().evictions == {"slot": 1}
    with pytest.raises(AdapterNotFoundError, match="'zzz'"):
        allocator.preload("zzz")
    catalog.fail.add("d")
    with pytest.raises(SlotLoadError, match="'d': loading into slot 5 failed"):
        allocator.preload("d")
    assert allocator.free_blocks() == [(5, 1), (6, 2)] and allocator.lru_order() == ["a", "c"]
    assert_rows_hold(allocator, catalog, {"a": 0, "c": 4})


def test_concurrent_acquires_load_once_and_leave_nothing_behind(tiny_spec, catalog):
    for i in range(6):
        catalog.add(f"x{i}", rank=1 + i % 4)
    catalog.delay = 0.002
    allocator = allocator_for(tiny_spec, catalog, slots=3, granule=1)  # 12 units: mixed ranks race for ranges
    errors: list[BaseException] = []
    ids = list(catalog.adapters)

    def worker(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for _ in range(25):
            batch = [ids[int(i)] for i in torch.randint(len(ids), (2,), generator=generator)]
            try:
                lease = allocator.acquire(batch)
            except SlotsExhaustedError:
                continue
            except BaseException as error:  # noqa: BLE001 - surfaced by the assert below
                errors.append(error)
                return
            assert_rows_hold(allocator, catalog, lease.slots)
            allocator.release(lease)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    states = allocator.states()
    assert all(s.pins == 0 and s.state == "ready" for s in states)
    assert sorted(s.adapter_id for s in states) == sorted(allocator.lru_order())
    assert sum(s.units for s in states) + allocator.free_units() == allocator.num_units == 12


def test_registry_backed_rows_equal_prepared_blocks(tmp_path, tiny_spec):
    registry = AdapterRegistry(tiny_spec, RegistryConfig(rows=RowOptions(max_rank=8)))
    for name, r, targets in (("one", 4, ["q_proj", "v_proj"]), ("two", 2, ["o_proj", "up_proj", "down_proj"])):
        registry.register(str(write_synthetic_adapter(tmp_path / name, tiny_spec, r=r, target_modules=targets)))
    pool = SlotPool(tiny_spec, SlotPoolConfig(max_slots=2, rows=RowOptions(max_rank=8), granule=2))
    allocator = SlotAllocator(pool, registry.prepared, lambda a: registry.get(a).rank, registry.metrics)
    lease = allocator.acquire(["two", "one"])
    assert dict(lease.slots) == {"two": 0, "one": 2} and dict(lease.slot_rows) == {0: 2, 2: 4}
    for adapter_id, slot in lease.slots.items():
        prepared = registry.prepared(adapter_id)
        rows = pool.rows[slot * 2 : slot * 2 + prepared.rows]
        assert torch.equal(rows, prepared.storage)
        for key, stacks in pool.stacks.items():
            weights = prepared.modules.get(key)
            a = stacks.a[slot * 2 : slot * 2 + prepared.rows]
            assert torch.equal(a, weights.a) if weights is not None else not a.any()
    assert registry.metrics.snapshot().moves[Move.HOST_TO_SLOT].total_bytes == sum(
        registry.get(a).nbytes for a in ("one", "two")
    )


def test_concurrent_acquires_of_one_missing_adapter_load_it_once(tiny_spec, catalog):
    catalog.delay = 0.05
    allocator = allocator_for(tiny_spec, catalog)
    leases = []
    threads = [threading.Thread(target=lambda: leases.append(allocator.acquire(["a"]))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert catalog.fetches == ["a"] and [lease.slots["a"] for lease in leases] == [0, 0, 0]
    assert [s.pins for s in allocator.states()] == [3]
    for lease in leases:
        allocator.release(lease)
    assert allocator.lru_order() == ["a"]
