"""Popularity-aware tiers: the TinyLFU sketch (never under-counts before aging, ages by halving, doorkeeper), and the
host and slot tiers acting on it (bounds never exceeded, a hot adapter survives a scan of cold ones, every request
served, a prefetch never evicts a hotter adapter)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapter_manager import FrequencySketch, HostTier, RowOptions, SketchConfig, SwapMetrics
from adapter_manager.policy.prefetch import PrefetchConfig, Prefetcher
from adapter_manager.tiers.allocator import SlotAllocator
from adapter_manager.tiers.slot_pool import SlotPool, SlotPoolConfig
from tests.adapter_manager._fakes import Catalog, prepared


@settings(max_examples=100, deadline=None)
@given(keys=st.lists(st.integers(0, 50), max_size=300))
def test_sketch_never_undercounts_before_aging(keys):
    sketch = FrequencySketch(SketchConfig(width=64, sample_size=10_000, max_count=255))
    for key in keys:
        sketch.record(f"a{key}")
    for key, count in Counter(keys).items():
        assert count <= sketch.estimate(f"a{key}") <= len(keys)  # count-min: collisions only add
    assert sketch.estimate("never-seen") <= len(keys)


def test_sketch_doorkeeper_saturation_and_aging():
    sketch = FrequencySketch(SketchConfig(width=1024, sample_size=100, max_count=15))
    sketch.record("once")
    assert sketch.estimate("once") == 1  # in the doorkeeper only
    for _ in range(40):
        sketch.record("hot")
    assert sketch.estimate("hot") == 16  # saturated counters (15) + the doorkeeper
    for i in range(59):
        sketch.record(f"cold{i}")  # the 100th record ages the sketch
    assert sketch.agings == 1
    assert sketch.estimate("hot") == 7 and sketch.estimate("once") == 0  # halved; the doorkeeper cleared
    with pytest.raises(ValueError, match=r"depth \(9\) in 1..8"):
        SketchConfig(depth=9)
    assert SketchConfig(width=1000).width == 1024


@settings(max_examples=150, deadline=None)
@given(
    capacity=st.integers(120, 400),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 19), st.integers(1, 60)), max_size=150),
)
def test_host_tier_with_admission_never_exceeds_its_bound_and_keeps_the_hot(capacity, ops):
    sketch = FrequencySketch(SketchConfig(width=256))
    tier = HostTier(capacity, SwapMetrics())
    tier.frequency = sketch.estimate
    for _ in range(8):
        sketch.record("hot")
    tier.put("hot", prepared("hot", 40))
    for is_get, index, size in ops:  # a scan of cold keys, each requested once
        key = f"cold{index}"
        sketch.record(key)
        if is_get:
            tier.get(key)
        else:
            served = tier.get_or_load(key, lambda key=key, size=size: prepared(key, size))
            assert served.adapter_id == key  # served, cached or not
        assert tier.used_bytes <= capacity
        assert "hot" in tier  # more popular than anything a cold newcomer could evict


def test_host_tier_without_frequency_is_plain_lru():
    tier = HostTier(100, SwapMetrics())
    for key in "abc":
        tier.put(key, prepared(key, 40))
    assert tier.keys() == {"b", "c"} and tier.eviction_order() == ["b", "c"]


def cold_scan_allocator(tiny_spec, sketch: FrequencySketch | None) -> tuple[SlotAllocator, Catalog]:
    catalog = Catalog(tiny_spec)
    catalog.add("hot", *(f"cold{i}" for i in range(30)))
    pool = SlotPool(tiny_spec, SlotPoolConfig(max_slots=4, rows=RowOptions(max_rank=4), granule=4))
    frequency = sketch.estimate if sketch is not None else None
    return SlotAllocator(pool, catalog, catalog.rank_of, frequency=frequency), catalog


@pytest.mark.parametrize("popularity", [True, False])
def test_a_hot_adapter_survives_a_scan_of_cold_ones_only_with_popularity(tiny_spec, popularity):
    sketch = FrequencySketch(SketchConfig(width=256))
    allocator, _ = cold_scan_allocator(tiny_spec, sketch if popularity else None)
    for _ in range(10):
        sketch.record("hot")
        allocator.release(allocator.acquire(["hot"]))
    for i in range(30):  # a burst of cold adapters, each requested once and served at once
        sketch.record(f"cold{i}")
        lease = allocator.acquire([f"cold{i}"])
        assert lease.slots[f"cold{i}"] is not None
        allocator.release(lease)
    assert (allocator.slot_of("hot") is not None) == popularity  # plain LRU flushes it


@settings(max_examples=60, deadline=None)
@given(
    batches=st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=2), max_size=60),
    preloads=st.lists(st.integers(0, 12), max_size=60),
)
def test_popularity_allocator_serves_every_batch_within_bounds(tiny_spec, batches, preloads):
    sketch = FrequencySketch(SketchConfig(width=256))
    catalog = Catalog(tiny_spec)
    for i in range(13):
        catalog.add(f"a{i}", rank=1 + i % 4)
    pool = SlotPool(
        tiny_spec, SlotPoolConfig(max_slots=2, rows=RowOptions(max_rank=4), granule=1)
    )  # 8 units; ranks take 1, 2 or 4
    allocator = SlotAllocator(pool, catalog, catalog.rank_of, frequency=sketch.estimate)
    for batch, preload in zip(batches, preloads + [None] * len(batches), strict=False):
        ids = [f"a{i}" for i in batch]
        for adapter_id in ids:
            sketch.record(adapter_id)
        lease = allocator.acquire(ids)  # two adapters take at most 8 units: they always fit once others go
        assert set(lease.slots) == set(ids)
        assert sum(s.units for s in allocator.states()) <= pool.num_units
        allocator.release(lease)
        if preload is not None:
            candidate = f"a{preload}"
            resident = {s.adapter_id for s in allocator.states()}
            loaded = allocator.preload(candidate)
            evicted = resident - {s.adapter_id for s in allocator.states()}
            assert not loaded or all(sketch.estimate(a) <= sketch.estimate(candidate) for a in evicted)
            assert loaded or not evicted
    assert allocator.free_units() + sum(s.units for s in allocator.states()) == pool.num_units


def test_popularity_prefetch_brings_a_hot_adapter_back_after_a_burst(tiny_spec):
    sketch = FrequencySketch(SketchConfig(width=256))
    allocator, catalog = cold_scan_allocator(tiny_spec, sketch)
    prefetcher = Prefetcher(catalog.stage, allocator, PrefetchConfig(workers=1, popular=2), sketch.top)
    try:
        for _ in range(10):
            sketch.record("hot")
            allocator.release(allocator.acquire(["hot"]))
        burst = [f"cold{i}" for i in range(4)]
        for adapter_id in burst:
            sketch.record(adapter_id)
        allocator.release(allocator.acquire(burst))  # one batch needs all 4 slots: the hot adapter has to go
        assert allocator.slot_of("hot") is None
        assert prefetcher.prefetch(burst[:3]) == 1  # cold0..2 are queued/running: protected
        prefetcher.wait(10)
        assert allocator.slot_of("hot") is not None  # back before its next request
        assert all(allocator.slot_of(a) is not None for a in burst[:3]) and allocator.slot_of("cold3") is None
        assert allocator.metrics.snapshot().prefetch == {"popular_to_slot": 1}
        for _ in range(20):  # a popular adapter whose fetch fails
            sketch.record("missing")
        catalog.fail.add("missing")
        catalog.add("missing")
        prefetcher.prefetch([])
        prefetcher.wait(10)
        assert prefetcher.errors() == {}  # a popular job's failure is only logged: nobody waits for it
    finally:
        prefetcher.close()
