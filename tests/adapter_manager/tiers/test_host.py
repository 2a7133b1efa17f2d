"""The host tier never exceeds its byte bound and evicts exactly in LRU order (hypothesis against a model)."""

from __future__ import annotations

import threading
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapter_manager import HostTier, SwapMetrics
from tests.adapter_manager._fakes import prepared

operations = st.lists(
    st.tuples(st.sampled_from(["put", "get", "discard", "load"]), st.integers(0, 7), st.integers(1, 120)),
    max_size=200,
)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(120, 400), ops=operations)
def test_byte_bound_and_lru_order(capacity, ops):
    tier = HostTier(capacity, SwapMetrics())
    model: OrderedDict[str, int] = OrderedDict()
    evictions = 0
    for op, index, size in ops:
        key = f"k{index}"
        if op == "get":
            hit = tier.get(key)
            assert (hit is not None) == (key in model)
            if key in model:
                model.move_to_end(key)
                assert hit.nbytes == model[key]
        elif op == "discard":
            tier.discard(key)
            model.pop(key, None)
        else:
            if op == "load" and key in model:
                assert tier.get_or_load(key, lambda: pytest.fail("loaded a resident key")).nbytes == model[key]
                model.move_to_end(key)
                continue
            item = prepared(key, size)
            tier.put(key, item) if op == "put" else tier.get_or_load(key, lambda item=item: item)
            model.pop(key, None)
            while model and sum(model.values()) + size > capacity:
                model.popitem(last=False)
                evictions += 1
            model[key] = size
        assert tier.used_bytes == sum(model.values()) <= capacity
        assert tier.keys() == set(model)
    assert tier._metrics.snapshot().evictions.get("host", 0) == evictions


def test_too_large_item_is_refused():
    tier = HostTier(100, SwapMetrics())
    with pytest.raises(ValueError, match="larger than the host tier"):
        tier.put("big", prepared("big", 101))
    assert tier.used_bytes == 0


def test_concurrent_loads_of_one_key_run_the_loader_once():
    tier, calls, barrier = HostTier(1000, SwapMetrics()), [], threading.Barrier(8)

    def loader():
        calls.append(1)
        return prepared("k", 10)

    def work():
        barrier.wait()
        assert tier.get_or_load("k", loader).nbytes == 10

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1


def test_failed_load_caches_nothing_and_can_be_retried():
    tier = HostTier(1000, SwapMetrics())

    def broken():
        raise OSError("disk gone")

    with pytest.raises(OSError):
        tier.get_or_load("k", broken)
    assert "k" not in tier and tier.used_bytes == 0
    assert tier.get_or_load("k", lambda: prepared("k", 5)).nbytes == 5


def test_a_reservation_holds_room_before_the_work_and_evicts_only_what_it_may():
    popularity = {"hot": 9, "kept": 1, "cold": 0, "new": 5}
    tier = HostTier(300, SwapMetrics())
    tier.frequency = lambda key: popularity.get(key, 0)
    for key in ("kept", "cold", "hot"):
        tier.put(key, prepared(key, 100))
    assert not tier.reserve("new", 200, keep={"kept"}, ceiling=5)  # only "cold" may go: 100 B short, nothing done
    assert tier.keys() == {"kept", "cold", "hot"}
    assert tier.reserve("new", 100, keep={"kept"}, ceiling=5)  # "cold" goes, "hot" is above the ceiling
    assert tier.keys() == {"kept", "hot"} and tier.used_bytes == 300 and tier.reserved_bytes == 100
    assert "new" not in tier and tier.get("new") is None and not tier.reserve("new", 100)
    assert tier.eviction_order() == ["kept", "hot"]  # a reservation is never a victim
    assert not tier.put("other", prepared("other", 100))  # no room beside it for something no more popular
    assert tier.put("new", prepared("new", 100))  # fills its own room: no second admission decision
    assert tier.keys() == {"kept", "hot", "new"} and tier.reserved_bytes == 0 and tier.used_bytes == 300
    assert tier.reserve("late", 100)  # the least valuable ("kept", freq 1) makes room
    tier.unreserve("late")  # given back unused
    assert tier.used_bytes == 200 and tier.reserved_bytes == 0
