"""The adapter-aware admission policy: budget, slots, residency preference, bounded unfairness, no thrash."""

from __future__ import annotations

import pytest

from runtime.engine.request import Request
from runtime.engine.sampling import SamplingParams
from runtime.engine.scheduler import SchedulerConfig, plan_step


def req(i: int, adapter: str | None, arrival: int = 0, prompt_len: int = 4) -> Request:
    return Request(i, tuple(range(1, prompt_len + 1)), adapter, SamplingParams(), arrival)


def admitted(plan) -> list[int]:
    return [r.request_id for r in plan.admitted]


def test_budget_decodes_first_and_chunked_prefill():
    running = [req(0, None, prompt_len=30), req(1, "a")]
    running[1].prefilled, running[1].output = 4, [7]
    plan = plan_step(SchedulerConfig(token_budget=10), 1, running, [req(2, "a")], 4, 2, lambda a: True)
    assert [(c.request.request_id, c.count) for c in plan.chunks] == [(1, 1), (0, 9)]
    assert admitted(plan) == []


def test_distinct_adapters_never_exceed_slots():
    waiting = [req(i, f"ad{i}") for i in range(5)]
    plan = plan_step(SchedulerConfig(), 0, [], waiting, 8, 3, lambda a: False)
    assert admitted(plan) == [0, 1, 2]


def test_resident_adapters_first_then_cold_only_into_spare_slots():
    waiting = [req(0, "cold"), req(1, "warm"), req(2, None), req(3, "warm")]
    plan = plan_step(SchedulerConfig(), 0, [], waiting, 8, 1, lambda a: a == "warm")
    assert admitted(plan) == [1, 2, 3]  # the single slot stays with "warm" while its queue drains


def test_overdue_requests_go_first_and_block_later_arrivals():
    config = SchedulerConfig(max_wait_steps=5)
    old_cold = req(0, "cold", arrival=0)
    warm_stream = [req(i, "warm", arrival=9) for i in range(1, 4)]
    running = [req(9, "warm")]
    running[0].prefilled, running[0].output = 4, [1]
    plan = plan_step(config, 4, running, [old_cold, *warm_stream], 8, 1, lambda a: a == "warm")
    assert admitted(plan) == [1, 2, 3]  # not overdue yet: warm work wins
    plan = plan_step(config, 6, running, [old_cold, *warm_stream], 8, 1, lambda a: a == "warm")
    assert admitted(plan) == []  # overdue and blocked on the slot: nobody overtakes it
    plan = plan_step(config, 6, [], [old_cold, *warm_stream], 8, 1, lambda a: a == "warm")
    assert admitted(plan) == [0]  # the slot frees: the overdue request gets it before any later arrival


def test_a_request_whose_adapter_is_not_ready_waits_alone_then_keeps_its_place():
    config = SchedulerConfig(max_wait_steps=5)
    cold = req(0, "cold", arrival=0)
    warm = [req(i, "warm", arrival=9) for i in range(1, 3)]
    running = [req(9, "warm")]
    running[0].prefilled, running[0].output = 4, [1]
    ready = {"warm"}

    def plan(step: int):
        return plan_step(config, step, running, [cold, *warm], 8, 2, lambda a: a == "warm", is_ready=ready.__contains__)

    assert admitted(plan(7)) == [1, 2]  # overdue but not ready: it blocks no one and is not admitted
    ready.add("cold")
    assert admitted(plan(7)) == [0, 1, 2]  # ready: overdue, so ahead of the newer warm work


def test_no_free_rows_admits_nobody():
    plan = plan_step(SchedulerConfig(), 0, [], [req(0, None)], 0, 2, lambda a: True)
    assert admitted(plan) == [] and plan.chunks == ()


def _units(adapter: str) -> int:
    return (1, 2, 4, 8)[int(adapter[1:]) % 4]  # rank mix: 1, 2, 4 or 8 pool units


@pytest.mark.timeout(60)
def test_ten_thousand_waiting_with_hundreds_of_slots_keeps_no_thrash():
    """10,000 waiting requests over 1000 adapters, a pool of 512 units: every request for a resident or running
    adapter is admitted first, in arrival order; cold ones then fill the spare units in arrival order, never pushing
    the step's adapters past the pool (so no resident adapter has to be evicted for them)."""
    resident = {f"a{i}" for i in range(100)}
    running = [req(20_000 + i, f"a{i}") for i in range(50)]
    for r in running:
        r.prefilled, r.output = 4, [1]
    waiting = [req(i, f"a{i % 1000}", arrival=10) for i in range(10_000)]
    plan = plan_step(
        SchedulerConfig(token_budget=10**7), 10, running, waiting, 10_000, 512, resident.__contains__, _units
    )
    ids = admitted(plan)
    assert len(ids) == len(set(ids))
    warm = [r.request_id for r in waiting if r.adapter_id in resident]
    assert ids[: len(warm)] == warm  # all 1000 warm requests, first, in arrival order
    used = sum(_units(a) for a in resident)
    expected, taken = [], set(resident)
    for r in waiting:  # the cold ones, greedy in arrival order within the units left
        if r.adapter_id in taken:
            if r.adapter_id not in resident:
                expected.append(r.request_id)
            continue
        if used + _units(r.adapter_id) <= 512:
            taken.add(r.adapter_id)
            used += _units(r.adapter_id)
            expected.append(r.request_id)
    assert ids[len(warm) :] == expected
    assert sum(_units(a) for a in {r.adapter_id for r in plan.admitted} | resident) <= 512
    assert len(plan.chunks) == len(running) + len(ids)


@pytest.mark.timeout(60)
def test_ten_thousand_waiting_bounded_unfairness():
    """An overdue request whose adapter cannot get room blocks every later arrival, among 10,000 waiting."""
    config = SchedulerConfig(token_budget=10**7, max_wait_steps=64)
    running = [req(20_000 + i, f"a{i}") for i in range(200)]  # 200 adapters in flight: 500 units
    for r in running:
        r.prefilled, r.output = 4, [1]
    held = sum(_units(r.adapter_id) for r in running)
    overdue = [req(i, f"a{i % 200}", arrival=0) for i in range(4_999)] + [req(4_999, "a203", arrival=0)]  # 8 units
    later = [req(5_000 + i, f"a{i % 200}", arrival=90) for i in range(5_000)]
    waiting = overdue + later
    plan = plan_step(config, 100, running, waiting, 10_000, held + 4, lambda a: True, _units)
    assert admitted(plan) == list(range(4_999))  # overdue ones that fit, then the blocked one stops everyone
    plan = plan_step(config, 100, running, waiting, 10_000, held + 8, lambda a: True, _units)
    assert admitted(plan) == list(range(10_000))  # room for it: overdue first, then the rest in order
    plan = plan_step(config, 100, running, waiting, 300, held + 8, lambda a: True, _units)
    assert admitted(plan) == list(range(300))  # rows bind: the oldest go first


def test_operator_pins_always_take_their_units():
    """Pins stay in the pool whatever the step runs: a request for a pinned adapter needs no more units, one for
    any other adapter must fit beside all the pins, and one that never can is returned as unplaceable instead of
    blocking the queue behind it (it used to be admitted, fail to acquire and be requeued every step)."""
    config = SchedulerConfig(max_wait_steps=0)
    overdue = req(0, "c", arrival=0)
    waiting = [overdue, req(1, "a", arrival=5), req(2, "b", arrival=5)]
    plan = plan_step(config, 10, [], waiting, 8, 2, lambda a: a in "ab", pinned={"a": 1, "b": 1})
    assert admitted(plan) == [1, 2]
    assert [r.request_id for r in plan.unplaceable] == [0]
    # one unit free beside the pins: the overdue request fits once the running adapter's unit is free, and until
    # then it still holds back those behind it (bounded unfairness is kept)
    running = [req(3, "d")]
    running[0].prefilled, running[0].output = 4, [7]
    plan = plan_step(config, 10, running, waiting, 8, 3, lambda a: a in "abd", pinned={"a": 1, "b": 1})
    assert admitted(plan) == [] and plan.unplaceable == ()
    plan = plan_step(config, 10, [], waiting, 8, 3, lambda a: a in "ab", pinned={"a": 1, "b": 1})
    assert admitted(plan) == [0, 1, 2]
