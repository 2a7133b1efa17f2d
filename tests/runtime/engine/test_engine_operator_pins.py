"""A request for an adapter an operator pinned is admitted even when operator pins fill the pool (the cluster's
multiplexed loader pins every adapter Serve keeps loaded, up to the pool's capacity)."""

from __future__ import annotations

import pytest

from adapter_manager import SlotsExhaustedError
from adapter_manager.runtime.engine.request import RequestFailedError
from adapter_manager.runtime.engine.sampling import SamplingParams
from tests.runtime._oracle import ADAPTERS, ENGINE_NEW_TOKENS


def test_requests_of_pinned_adapters_run_when_pins_fill_the_pool(expected, make_engine):
    engine, manager = make_engine(max_slots=2)
    names = list(ADAPTERS)[:2]
    for name in names:
        manager.pin(name)
    assert sum(s.units for s in manager.allocator.states() if s.manual) == manager.num_units
    handles = [engine.submit([3, 1, 4, 1, 5], n, SamplingParams(max_tokens=ENGINE_NEW_TOKENS)) for n in names]
    engine.run_until_idle(max_steps=200)
    for handle, name in zip(handles, names, strict=True):
        assert handle.done and handle.result(timeout=0) == expected[((3, 1, 4, 1, 5), name)]


def test_request_that_cannot_fit_beside_the_pins_fails_alone_and_stalls_no_one(expected, make_engine):
    """The cluster hang: every slot pinned, a request for a third adapter waits past max_wait_steps. It used to be
    admitted first, fail to acquire, be requeued, and take every later request back to waiting with it, each step,
    for ever. It now fails with a typed error at once and the pinned adapters' requests finish."""
    engine, manager = make_engine(max_slots=2)
    engine.config.scheduler.max_wait_steps = 0
    pinned, cold = list(ADAPTERS)[:2], list(ADAPTERS)[2]
    for name in pinned:
        manager.pin(name)
    blocked = engine.submit([3, 1, 4, 1, 5], cold, SamplingParams(max_tokens=ENGINE_NEW_TOKENS))
    engine.step()  # the cold request is overdue from here on
    handles = [engine.submit([3, 1, 4, 1, 5], n, SamplingParams(max_tokens=ENGINE_NEW_TOKENS)) for n in pinned]
    steps = engine.run_until_idle(max_steps=200)
    assert steps < 200
    with pytest.raises(RequestFailedError, match="pinned") as failed:
        blocked.result(timeout=0)
    assert isinstance(failed.value.cause, SlotsExhaustedError)
    for handle, name in zip(handles, pinned, strict=True):
        assert handle.result(timeout=0) == expected[((3, 1, 4, 1, 5), name)]
    manager.unpin(pinned[0])  # room again: the same adapter is served
    again = engine.submit([3, 1, 4, 1, 5], cold, SamplingParams(max_tokens=ENGINE_NEW_TOKENS))
    engine.run_until_idle(max_steps=200)
    assert again.result(timeout=0) == expected[((3, 1, 4, 1, 5), cold)]
