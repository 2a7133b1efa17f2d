"""A request for an adapter an operator pinned is admitted even when operator pins fill the pool (the cluster's
multiplexed loader pins every adapter Serve keeps loaded, up to the pool's capacity)."""

from __future__ import annotations

from runtime.engine.sampling import SamplingParams
from tests.runtime._oracle import ADAPTERS, ENGINE_NEW_TOKENS
from tests.runtime.test_engine import make_engine


def test_requests_of_pinned_adapters_run_when_pins_fill_the_pool(written, expected):
    engine, manager = make_engine(written, max_slots=2)
    names = list(ADAPTERS)[:2]
    for name in names:
        manager.pin(name)
    assert sum(s.units for s in manager.allocator.states() if s.manual) == manager.num_units
    handles = [engine.submit([3, 1, 4, 1, 5], n, SamplingParams(max_tokens=ENGINE_NEW_TOKENS)) for n in names]
    engine.run_until_idle(max_steps=200)
    for handle, name in zip(handles, names, strict=True):
        assert handle.done and handle.result(timeout=0) == expected[((3, 1, 4, 1, 5), name)]
