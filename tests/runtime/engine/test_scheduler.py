"""The adapter-aware admission policy: budget, KV blocks and seats, arrival order, preemption, bounded unfairness,
no thrash."""

from __future__ import annotations

import pytest

from adapter_manager.runtime.engine.kv_blocks import BlockPool
from adapter_manager.runtime.engine.kv_space import KVSpace
from adapter_manager.runtime.engine.request import Request
from adapter_manager.runtime.engine.sampling import SamplingParams
from adapter_manager.runtime.engine.scheduler import SchedulerConfig, plan_step


def kv(seats: int, blocks: int = 100_000, block_size: int = 16, reserve: int = 0) -> KVSpace:
    return KVSpace(BlockPool(blocks), block_size, seats, lambda adapter_id: "sha", reserve)


def req(i: int, adapter: str | None, arrival: int = 0, prompt_len: int = 4) -> Request:
    return Request(i, tuple(range(1, prompt_len + 1)), adapter, SamplingParams(), arrival)


def admitted(plan) -> list[int]:
    return [r.request_id for r in plan.admitted]


def test_budget_decodes_first_and_chunked_prefill():
    running = [req(0, None, prompt_len=30), req(1, "a")]
    running[1].prefilled, running[1].output = 4, [7]
    plan = plan_step(SchedulerConfig(token_budget=10), 1, running, [req(2, "a")], kv(4), 2)
    assert [(c.request.request_id, c.count) for c in plan.chunks] == [(1, 1), (0, 9)]
    assert admitted(plan) == []


def test_distinct_adapters_never_exceed_slots():
    waiting = [req(i, f"ad{i}") for i in range(5)]
    plan = plan_step(SchedulerConfig(), 0, [], waiting, kv(8), 3)
    assert admitted(plan) == [0, 1, 2]


def test_ready_requests_go_in_arrival_order_and_never_past_the_slots():
    waiting = [req(0, "cold"), req(1, "warm"), req(2, None), req(3, "warm")]
    plan = plan_step(SchedulerConfig(), 0, [], waiting, kv(8), 1)
    assert admitted(plan) == [0, 2]  # the oldest first; "warm" would push the step past the single slot: it waits
    running = [req(9, "warm")]
    running[0].prefilled, running[0].output = 4, [1]
    plan = plan_step(SchedulerConfig(), 0, running, waiting, kv(8), 1)
    assert admitted(plan) == [1, 2, 3]  # the slot is a running request's: "cold" may not evict it


def test_overdue_requests_block_later_arrivals():
    config = SchedulerConfig(max_wait_steps=5)
    old_cold = req(0, "cold", arrival=0)
    warm_stream = [req(i, "warm", arrival=9) for i in range(1, 4)]
    running = [req(9, "warm")]
    running[0].prefilled, running[0].output = 4, [1]
    plan = plan_step(config, 4, running, [old_cold, *warm_stream], kv(8), 1)
    assert admitted(plan) == [1, 2, 3]  # not overdue yet: it waits for the slot, the running adapter's work goes on
    plan = plan_step(config, 6, running, [old_cold, *warm_stream], kv(8), 1)
    assert admitted(plan) == []  # overdue and blocked on the slot: nobody overtakes it
    plan = plan_step(config, 6, [], [old_cold, *warm_stream], kv(8), 1)
    assert admitted(plan) == [0]  # the slot frees: the overdue request gets it before any later arrival


def test_a_request_whose_adapter_is_not_ready_waits_alone_then_keeps_its_place():
    config = SchedulerConfig(max_wait_steps=5)
    cold = req(0, "cold", arrival=0)
    warm = [req(i, "warm", arrival=9) for i in range(1, 3)]
    running = [req(9, "warm")]
    running[0].prefilled, running[0].output = 4, [1]
    ready = {"warm"}

    def plan(step: int):
        return plan_step(config, step, running, [cold, *warm], kv(8), 2, is_ready=ready.__contains__)

    assert admitted(plan(7)) == [1, 2]  # overdue but not ready: it blocks no one and is not admitted
    ready.add("cold")
    assert admitted(plan(7)) == [0, 1, 2]  # ready: its arrival place, ahead of the newer warm work


def test_no_seat_admits_nobody():
    plan = plan_step(SchedulerConfig(), 0, [], [req(0, None)], kv(0), 2)
    assert admitted(plan) == [] and plan.chunks == ()


def _units(adapter: str) -> int:
    return (1, 2, 4, 8)[int(adapter[1:]) % 4]  # rank mix: 1, 2, 4 or 8 pool units


@pytest.mark.timeout(60)
def test_ten_thousand_waiting_with_hundreds_of_slots_keeps_no_thrash():
    """10,000 waiting requests over 1000 adapters, a pool of 512 units: admitted greedily in arrival order, a request
    skipped (never blocking) when its adapter would push the step's adapters past the pool, so no adapter a running
    or earlier-admitted request needs has to be evicted for a later one."""
    running = [req(20_000 + i, f"a{i}") for i in range(50)]
    for r in running:
        r.prefilled, r.output = 4, [1]
    waiting = [req(i, f"a{i % 1000}", arrival=10) for i in range(10_000)]
    plan = plan_step(SchedulerConfig(token_budget=10**7), 10, running, waiting, kv(10_000), 512, _units)
    ids = admitted(plan)
    assert len(ids) == len(set(ids))
    taken = {r.adapter_id for r in running}
    used, expected = sum(_units(a) for a in taken), []
    for r in waiting:
        if r.adapter_id not in taken:
            if used + _units(r.adapter_id) > 512:
                continue
            taken.add(r.adapter_id)
            used += _units(r.adapter_id)
        expected.append(r.request_id)
    assert ids == expected and len(ids) > 1000
    assert sum(_units(a) for a in {r.adapter_id for r in (*plan.admitted, *running)}) <= 512
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
    plan = plan_step(config, 100, running, waiting, kv(10_000), held + 4, _units)
    assert admitted(plan) == list(range(4_999))  # overdue ones that fit, then the blocked one stops everyone
    plan = plan_step(config, 100, running, waiting, kv(10_000), held + 8, _units)
    assert admitted(plan) == list(range(10_000))  # room for it: overdue first, then the rest in order
    plan = plan_step(config, 100, running, waiting, kv(300), held + 8, _units)
    assert admitted(plan) == list(range(300))  # seats bind: the oldest go first


def test_operator_pins_always_take_their_units():
    """Pins stay in the pool whatever the step runs: a request for a pinned adapter needs no more units, one for
    any other adapter must fit beside all the pins, and one that never can is returned as unplaceable instead of
    blocking the queue behind it (it used to be admitted, fail to acquire and be requeued every step)."""
    config = SchedulerConfig(max_wait_steps=0)
    overdue = req(0, "c", arrival=0)
    waiting = [overdue, req(1, "a", arrival=5), req(2, "b", arrival=5)]
    plan = plan_step(config, 10, [], waiting, kv(8), 2, pinned={"a": 1, "b": 1})
    assert admitted(plan) == [1, 2]
    assert [r.request_id for r in plan.unplaceable] == [0]
    # one unit free beside the pins: the overdue request fits once the running adapter's unit is free, and until
    # then it still holds back those behind it (bounded unfairness is kept)
    running = [req(3, "d")]
    running[0].prefilled, running[0].output = 4, [7]
    plan = plan_step(config, 10, running, waiting, kv(8), 3, pinned={"a": 1, "b": 1})
    assert admitted(plan) == [] and plan.unplaceable == ()
    plan = plan_step(config, 10, [], waiting, kv(8), 3, pinned={"a": 1, "b": 1})
    assert admitted(plan) == [0, 1, 2]


def test_blocks_decide_admission_in_arrival_order():
    """Admission takes a request's uncached blocks from the free ones, beside the reserve; the first that does not
    fit stops everyone behind it (a short later request does not overtake a long one)."""
    space = kv(8, blocks=10, block_size=4, reserve=1)
    waiting = [req(0, None, prompt_len=16), req(1, None, prompt_len=24), req(2, None, prompt_len=4)]
    plan = plan_step(SchedulerConfig(), 0, [], waiting, space, 2)
    assert admitted(plan) == [0]  # 4 blocks; the next needs 6 of the 6 free, one of which is the reserve
    assert [c.count for c in plan.chunks] == [16]
    alone = plan_step(SchedulerConfig(), 0, [], waiting[1:], space, 2)
    assert admitted(alone) == [1, 2]  # alone it may use the reserve; then 1 block for the last, 0 left


def test_running_requests_that_outgrow_the_blocks_preempt_the_newest():
    space = kv(8, blocks=4, block_size=4)
    running = [req(i, None, prompt_len=4) for i in range(3)]
    for r in running:
        space.admit(r)
        assert space.grow(r, 4)
        r.prefilled, r.output = 4, [1]  # each at position 4: its next token needs a second block
    assert space.free == 1
    waiting = [req(9, None)]
    plan = plan_step(SchedulerConfig(), 5, running, waiting, space, 2)
    assert [r.request_id for r in plan.preempted] == [2]  # its block freed, the two older ones grow into 2
    assert [c.request.request_id for c in plan.chunks] == [0, 1]
    space.pool.allocate(1)  # one block fewer: the next newest goes too
    plan = plan_step(SchedulerConfig(), 5, running, waiting, space, 2)
    assert [r.request_id for r in plan.preempted] == [2, 1]
    assert [c.request.request_id for c in plan.chunks] == [0]
    assert admitted(plan) == []  # a step that preempts admits no one
