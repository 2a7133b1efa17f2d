"""The AdapterManager facade end to end on CPU: registry -> host -> slots, residency, metrics, prefetch."""

from __future__ import annotations

import threading

import pytest
import torch

from adapter_manager import (
    AdapterError,
    AdapterNotFoundError,
    Move,
    RowOptions,
    SlotPool,
    SlotPoolConfig,
    TensorParallel,
    write_synthetic_adapter,
)
from adapter_manager.manager import AdapterManager, AdapterManagerConfig
from adapter_manager.policy.prefetch import PrefetchConfig, Prefetcher
from tests.adapter_manager._fakes import Catalog, allocator_for


@pytest.fixture
def folders(tmp_path, tiny_spec):
    return {
        name: write_synthetic_adapter(tmp_path / name, tiny_spec, r=4, target_modules=targets, seed=i)
        for i, (name, targets) in enumerate(
            [("a", ["q_proj"]), ("b", ["v_proj", "down_proj"]), ("c", ["o_proj"]), ("d", ["up_proj"])]
        )
    }


def manager_for(spec, **overrides) -> AdapterManager:
    overrides.setdefault("max_slots", 2)
    overrides.setdefault("rows", RowOptions(max_rank=8))
    overrides.setdefault("prefetch_workers", 1)
    return AdapterManager(spec, AdapterManagerConfig(**overrides))


def test_config_validation_shows_the_offending_value():
    with pytest.raises(ValueError, match="needs slot_memory_bytes"):
        AdapterManagerConfig(max_slots="auto")
    with pytest.raises(ValueError, match="prefetch workers must be an int >= 0, got -1"):
        AdapterManagerConfig(prefetch_workers=-1)
    with pytest.raises(ValueError, match="max_rank must be a positive int, got 0"):
        AdapterManagerConfig(rows=RowOptions(max_rank=0))


def test_acquire_serves_prepared_weights_and_reports_residency(folders, tiny_spec):
    with manager_for(tiny_spec) as manager:
        for folder in folders.values():
            manager.register(str(folder))
        lease = manager.acquire(["a", "b", None])
        assert lease.slot_indices(["b", None, "a"]).tolist() == [lease.slots["b"], -1, lease.slots["a"]]
        prepared = manager.registry.prepared("b")
        start = lease.slots["b"] * manager.pool.granule
        assert lease.slot_rows[lease.slots["b"]] == prepared.rows
        for key, stacks in manager.stacks.items():
            weights = prepared.modules.get(key)
            rows = stacks.bt[start : start + prepared.rows]
            expected = torch.zeros_like(rows) if weights is None else weights.bt
            assert torch.equal(rows, expected)
        residency = manager.residency()
        assert residency["a"].tier == "slot" and residency["a"].pinned and residency["a"].last_used is not None
        assert residency["c"].tier in ("host", "disk") and residency["c"].slot is None
        manager.release(lease)
        assert not manager.residency()["a"].pinned
        snapshot = manager.metrics()
        assert snapshot.moves[Move.HOST_TO_SLOT].count == 2 and snapshot.stall.count == 1
        as_dict = snapshot.to_dict()
        assert as_dict["residency"]["b"]["tier"] == "slot" and as_dict["misses"]["slot"] == 2


def test_unregister_while_in_flight_frees_the_slot_at_release(folders, tiny_spec):
    with manager_for(tiny_spec) as manager:
        manager.register(str(folders["a"]))
        lease = manager.acquire(["a"])
        manager.unregister("a")
        assert "a" not in manager.residency() and manager.allocator.free_units() == manager.num_units - 1
        with pytest.raises(AdapterNotFoundError):
            manager.acquire(["a"])
        manager.release(lease)
        assert manager.allocator.free_units() == manager.num_units


def test_prefetch_loads_ahead_and_never_evicts_what_is_needed_sooner(folders, tiny_spec):
    with manager_for(tiny_spec) as manager:
        for folder in folders.values():
            manager.register(str(folder))
        assert manager.prefetch(["a", None, "b", "a"]) == 2
        manager.prefetcher.wait()
        assert manager.allocator.slot_of("a") is not None and manager.allocator.slot_of("b") is not None
        manager.release(manager.acquire(["a", "b"]))
        assert manager.metrics().misses.get("slot", 0) == 0  # both were prefetched: two hits
        assert manager.allocator.lru_order() == ["a", "b"]
        manager.prefetch(["b", "a", "c"])  # every victim for c is queued ahead of it
        manager.prefetcher.wait()
        assert manager.allocator.lru_order() == ["a", "b"] and manager.allocator.slot_of("c") is None
        manager.prefetch(["b", "c", "a"])  # a is queued after c but resident: warm work, run first, never evicted
        manager.prefetcher.wait()
        assert manager.allocator.lru_order() == ["a", "b"] and manager.allocator.slot_of("c") is None
        manager.prefetch(["b", "c"])  # nobody queues for a any more: it may go
        manager.prefetcher.wait()
        assert manager.allocator.lru_order() == ["b", "c"]
        assert manager.metrics().prefetch == {"host_to_slot": 3, "skipped_no_room": 2}  # a, b; c refused twice, then c


def test_a_prefetch_without_slot_room_to_use_stops_at_the_host_tier(folders, tiny_spec):
    """An engine with no free KV row asks for host-tier moves only: a slot copy ahead of a request's turn would only
    reorder its queue."""
    with manager_for(tiny_spec) as manager:
        for folder in folders.values():
            manager.register(str(folder))
        manager.registry.host.discard(("a", manager.registry.get("a").digest))
        assert manager.prefetch(["a"], to_slot=False) == 1
        manager.prefetcher.wait()
        assert manager.registry.is_prepared("a") and manager.allocator.slot_of("a") is None
        assert manager.is_ready("a") and manager.metrics().prefetch == {"to_host": 1}
        manager.prefetch(["a"])  # room again: the copy follows
        manager.prefetcher.wait()
        assert manager.allocator.slot_of("a") is not None


@pytest.mark.parametrize(
    "rows",
    [
        RowOptions(max_rank=8),
        RowOptions(max_rank=8, tensor_parallel=TensorParallel(2, fully_sharded_loras=True)),
        RowOptions(max_rank=8, lora_vectors=False, lora_vocab=True),
    ],
    ids=["plain", "tp2-fully-sharded", "vocab"],
)
def test_the_registry_and_the_pool_share_the_one_row_layout_the_manager_derives(tiny_spec, rows):
    """The rows' options travel whole, and the manager derives their `RowLayout` once: its registry prepares blocks
    in the very object its pool holds; a component handed the layout of other options refuses it."""
    with manager_for(tiny_spec, rows=rows, prefetch_workers=0) as manager:
        assert manager.registry.layout is manager.pool.layout
        assert manager.pool.layout == rows.layout(tiny_spec)
        assert manager.registry.config.rows is manager.pool.config.rows is rows
    other = RowOptions(max_rank=8, lora_vocab=not rows.lora_vocab).layout(tiny_spec)
    with pytest.raises(ValueError, match="a row layout over"):
        SlotPool(tiny_spec, SlotPoolConfig(max_slots=1, rows=rows), other)


def test_prefetch_errors_are_surfaced_at_acquire(folders, tiny_spec):
    with manager_for(tiny_spec) as manager:
        manager.register(str(folders["a"]))
        manager.registry.host.discard(("a", manager.registry.get("a").digest))
        (folders["a"] / "adapter_model.safetensors").write_bytes(b"not safetensors")
        manager.prefetch(["a"])
        manager.prefetcher.wait()
        assert "'a'" in manager.prefetcher.errors()["a"]
        with pytest.raises(AdapterError, match="'a'"):  # whatever the registry refuses it with
            manager.acquire(["a"])
        assert manager.prefetcher.errors() == {} and manager.allocator.free_units() == manager.num_units


def test_prefetcher_cancels_jobs_the_queue_no_longer_holds(tiny_spec):
    catalog = Catalog(tiny_spec)
    catalog.add("a", "b", "c")
    catalog.delay = 0.05
    allocator = allocator_for(tiny_spec, catalog, slots=3)
    prefetcher = Prefetcher(catalog.stage, allocator, PrefetchConfig(workers=1, depth=2))
    try:
        assert prefetcher.prefetch(["a", "b", "c"]) == 2  # depth 2: c is not considered
        prefetcher.prefetch(["a"])  # b's job has not started: cancelled
        prefetcher.wait()
        assert allocator.slot_of("a") == 0 and allocator.slot_of("b") is None and "c" not in catalog.fetches
    finally:
        prefetcher.close()


def test_the_facade_answers_what_runtime_asks(folders, tiny_spec):
    """What runtime reads and does through the facade (never through its components): registrations, slots,
    prefetch, metrics and the pool's shape."""
    with manager_for(tiny_spec) as manager:
        for name in ("a", "b"):
            manager.register(str(folders[name]))
        assert [r.adapter_id for r in manager.records()] == ["a", "b"] and manager.unrestored() == []
        assert manager.is_registered("a") and not manager.is_registered("z")
        assert manager.record("a").sha == manager.registry.get("a").sha
        with pytest.raises(AdapterNotFoundError):
            manager.record("z")
        assert (manager.max_rank, manager.granule) == (manager.pool.max_rank, manager.pool.granule)
        assert manager.device_lock is manager.pool.device_lock and manager.prefetching
        manager.registry.host.discard(("a", manager.record("a").digest))
        manager.prepare("a")
        assert manager.registry.is_prepared("a") and manager.slot_of("a") is None
        moved = threading.Event()

        def listener(adapter_id: str) -> None:
            if adapter_id == "a":
                moved.set()

        manager.on_prefetched(listener)
        manager.prefetch(["a"])
        assert moved.wait(10) and manager.slot_of("a") is not None and manager.take_prefetch_errors() == {}
        manager.off_prefetched(listener)
        states = [(s.adapter_id, s.slot, s.state) for s in manager.slot_states()]
        assert states == [("a", manager.slot_of("a"), "ready")]
        assert [m.move for m in manager.moves("a")][-2:] == [Move.DISK_TO_HOST, Move.HOST_TO_SLOT]
        manager.note_adapter_wait(0.5)
        assert manager.metrics().adapter_wait.count == 1
