"""Adapter-aware admission: which requests run in the next step, under the token budget and the slot count.

Policy, in order, each step:
1. Every running request gets its next piece: one decode token, or the next chunk of its prompt (chunked prefill),
   while the token budget lasts (decodes first, so generation never stalls behind long prompts).
2. Waiting requests are admitted while a KV cache row is free and budget remains, in this order:
   overdue ones (waited more than ``max_wait_steps`` steps; arrival order) — if one of them cannot get a slot, no
   one behind it is admitted (bounded unfairness); then requests for the base model or an adapter that is running
   or resident in a slot (arrival order); then requests for cold adapters (arrival order), and a cold adapter is
   brought in only when it does not push the step's distinct adapters past the slots available, so while warm work
   waits, a cold adapter never evicts a warm one (no thrash: an adapter's queue drains before it is evicted).
   A request whose adapter is not ready (`is_ready`: placing it would mean a download or a preparation) is not
   admitted and blocks no one, overdue or not: it waits alone while the prefetcher brings its adapter up, and once
   ready it takes its arrival-order place again (ahead of newer warm work once overdue).
3. Operator pins stay in the pool whatever runs, so their units are always counted as taken and a request for a
   pinned adapter needs no more. A request whose adapter cannot fit beside the pins alone is unplaceable: it never
   blocks anyone, and the plan names it so the engine can fail it (waiting would not help: no finishing request
   frees a pinned range).

Work per step is linear in the queue: one pass classifies it (residency asked once per distinct adapter), one pass
admits; membership uses id sets, never list scans.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .request import Request


@dataclass
class SchedulerConfig:
    """Admission limits of the engine's scheduler."""

    token_budget: int = 512  # tokens per step: prefill chunks plus decode tokens
    max_wait_steps: int = 64  # a request waiting longer is admitted before any later arrival

    def __post_init__(self) -> None:
        if self.token_budget < 1 or self.max_wait_steps < 0:
            raise ValueError(
                f"token_budget ({self.token_budget}) must be >= 1 and max_wait_steps ({self.max_wait_steps}) >= 0"
            )


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step: `count` tokens starting at its current position."""

    request: Request
    count: int


@dataclass(frozen=True)
class StepPlan:
    """What the next step runs: chunks of running (and newly admitted) requests, and who was admitted."""

    chunks: tuple[ScheduledChunk, ...]
    admitted: tuple[Request, ...]
    unplaceable: tuple[Request, ...] = ()  # their adapter does not fit beside the operator pins


def plan_step(
    config: SchedulerConfig,
    step: int,
    running: Sequence[Request],
    waiting: Sequence[Request],
    free_rows: int,
    units_available: int,
    is_resident: Callable[[str], bool],
    units_of: Callable[[str], int] = lambda adapter_id: 1,
    pinned: Mapping[str, int] | None = None,
    is_ready: Callable[[str], bool] = lambda adapter_id: True,
) -> StepPlan:
    """Choose the next step's work. `units_available`: the pool's units; `is_resident(adapter_id)`: whether the
    adapter is in the pool now; `units_of(adapter_id)`: the units it takes (its rank's share of the row pool);
    `pinned`: the operator-pinned adapters and their units, resident whatever the step runs; `is_ready(adapter_id)`:
    whether a step could place it without a download or a preparation (resident, or prepared on the host)."""
    pinned = pinned or {}
    pinned_units = sum(pinned.values())
    budget = config.token_budget
    chunks: list[ScheduledChunk] = []
    adapters = {r.adapter_id for r in running if r.adapter_id is not None} | set(pinned)
    used = pinned_units + sum(units_of(a) for a in adapters if a not in pinned)
    for request in sorted(running, key=lambda r: r.in_prefill):
        if budget == 0:
            break
        count = min(len(request.prompt) - request.prefilled, budget) if request.in_prefill else 1
        chunks.append(ScheduledChunk(request, count))
        budget -= count
    resident: dict[str, bool] = {}  # adapter id -> is_resident, asked once per distinct adapter
    ready: dict[str, bool] = {}  # adapter id -> is_ready, likewise
    overdue: list[Request] = []
    warm: list[Request] = []
    cold: list[Request] = []
    for r in waiting:
        adapter_id = r.adapter_id
        if adapter_id is not None and adapter_id not in adapters:
            if adapter_id not in ready:
                ready[adapter_id] = is_ready(adapter_id)
            if not ready[adapter_id]:
                continue
        if step - r.arrival_step > config.max_wait_steps:
            overdue.append(r)
        elif adapter_id is None or adapter_id in adapters:
            warm.append(r)
        else:
            if adapter_id not in resident:
                resident[adapter_id] = is_resident(adapter_id)
            (warm if resident[adapter_id] else cold).append(r)
    unit_cost: dict[str, int] = {}
    admitted: list[Request] = []
    unplaceable: list[Request] = []
    for group, blocking in ((overdue, True), (warm, False), (cold, False)):
        for request in group:
            if budget == 0 or free_rows == 0:
                return StepPlan(tuple(chunks), tuple(admitted), tuple(unplaceable))
            needs_slot = request.adapter_id is not None and request.adapter_id not in adapters
            if needs_slot and request.adapter_id not in unit_cost:
                unit_cost[request.adapter_id] = units_of(request.adapter_id)
            units = unit_cost[request.adapter_id] if needs_slot else 0
            if needs_slot and pinned_units + units > units_available:
                unplaceable.append(request)
                continue
            if needs_slot and used + units > units_available:
                if blocking:
                    return StepPlan(tuple(chunks), tuple(admitted), tuple(unplaceable))
                continue
            if needs_slot:
                adapters.add(request.adapter_id)
                used += units
            count = min(len(request.prompt), budget)
            chunks.append(ScheduledChunk(request, count))
            admitted.append(request)
            budget -= count
            free_rows -= 1
    return StepPlan(tuple(chunks), tuple(admitted), tuple(unplaceable))
