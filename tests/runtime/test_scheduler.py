"""The adapter-aware admission policy: budget, slots, residency preference, bounded unfairness, no thrash."""

from __future__ import annotations

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


def test_no_free_rows_admits_nobody():
    plan = plan_step(SchedulerConfig(), 0, [], [req(0, None)], 0, 2, lambda a: True)
    assert admitted(plan) == [] and plan.chunks == ()
