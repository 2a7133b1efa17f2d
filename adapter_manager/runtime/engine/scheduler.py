"""Adapter-aware admission: which requests run in the next step, under the token budget, the KV blocks and the slots.

Policy, in order, each step:
1. Every running request gets its next piece: one decode token, or the next chunk of its prompt (chunked prefill),
   while the token budget lasts (decodes first, so generation never stalls behind long prompts). When the KV blocks
   those pieces need exceed the free ones, the newest running requests are preempted (vLLM's recompute preemption:
   their blocks freed, they wait again at their arrival place and recompute what they had, losing nothing) until
   the rest fit.
2. Waiting requests are admitted in arrival order while a sequence may start (``KVRoom.seats``: ``max_batch`` caps
   the running sequences) and budget remains; the first whose blocks do not fit (its uncached tokens' blocks, and
   the free cached blocks its prefix takes, beside ``KVRoom.reserve``) stops admission, so no later arrival
   overtakes it. A request's cached prefix (the prefix cache) is not computed again: only the rest counts against
   the budget. A request whose adapter would push the step's distinct adapters past the pool's units is skipped
   (it waits; placing it would evict an adapter a running or earlier-admitted request needs), unless it is overdue
   (waited more than ``max_wait_steps`` steps): then no one behind it is admitted (bounded unfairness). A step
   that preempts admits no one.
   A request whose adapter is not ready (`is_ready`: placing it would mean a download or a preparation) is not
   admitted and blocks no one, overdue or not: it waits alone while the prefetcher brings its adapter up, and once
   ready it takes its arrival-order place again.
3. Operator pins stay in the pool whatever runs, so their units are always counted as taken and a request for a
   pinned adapter needs no more. A request whose adapter cannot fit beside the pins alone is unplaceable: it never
   blocks anyone, and the plan names it so the engine can fail it (waiting would not help: no finishing request
   frees a pinned range).

Work per step is linear in the queue: one pass admits; readiness is asked once per distinct adapter, membership
uses id sets, never list scans.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

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


class KVRoom(Protocol):
    """What admission needs to know of the KV blocks (:class:`runtime.engine.kv_space.KVSpace`)."""

    @property
    def free(self) -> int:
        """Blocks free now (nameless, or cached and evictable)."""
        ...

    @property
    def reserve(self) -> int:
        """Free blocks admission leaves for the running sequences to grow into."""
        ...

    @property
    def seats(self) -> int:
        """Sequences that may still start (``max_batch`` less the running ones)."""
        ...

    def growth(self, request: Request, count: int) -> int:
        """New blocks a running request needs for its next ``count`` tokens."""
        ...

    def freed_by(self, request: Request) -> int:
        """Blocks preempting a running request would free (those no other sequence holds)."""
        ...

    def admission(self, request: Request, budget: int) -> tuple[int, int]:
        """For a waiting request: (prompt tokens its cached prefix holds, free blocks its first chunk of at most
        ``budget`` tokens takes, the cached ones its prefix revives included)."""
        ...


@dataclass(frozen=True)
class StepPlan:
    """What the next step runs: chunks of running (and newly admitted) requests, and who was admitted."""

    chunks: tuple[ScheduledChunk, ...]
    admitted: tuple[Request, ...]
    unplaceable: tuple[Request, ...] = ()  # their adapter does not fit beside the operator pins
    preempted: tuple[Request, ...] = ()  # running requests whose blocks go back to the pool; they wait again


def plan_step(
    config: SchedulerConfig,
    step: int,
    running: Sequence[Request],
    waiting: Sequence[Request],
    kv: KVRoom,
    units_available: int,
    units_of: Callable[[str], int] = lambda adapter_id: 1,
    pinned: Mapping[str, int] | None = None,
    is_ready: Callable[[str], bool] = lambda adapter_id: True,
) -> StepPlan:
    """Choose the next step's work. ``running`` in admission order (the newest last: preempted first);
    ``waiting`` in arrival order; `units_available`: the pool's units; `units_of(adapter_id)`: the units it takes
    (its rank's share of the row pool); `pinned`: the operator-pinned adapters and their units, resident whatever
    the step runs; `is_ready(adapter_id)`: whether a step could place it without a download or a preparation
    (resident, or prepared on the host)."""
    pinned = pinned or {}
    pinned_units = sum(pinned.values())
    budget = config.token_budget
    pieces: dict[int, ScheduledChunk] = {}  # id(request) -> its chunk
    for request in sorted(running, key=lambda r: r.in_prefill):
        if budget == 0:
            break
        count = min(len(request.context) - request.prefilled, budget) if request.in_prefill else 1
        pieces[id(request)] = ScheduledChunk(request, count)
        budget -= count
    free = kv.free
    need = sum(kv.growth(c.request, c.count) for c in pieces.values())
    preempted: list[Request] = []
    staying = list(running)
    while need > free and staying:
        victim = staying.pop()
        preempted.append(victim)
        chunk = pieces.pop(id(victim), None)
        if chunk is not None:
            need -= kv.growth(victim, chunk.count)
            budget += chunk.count
        free += kv.freed_by(victim)
    free -= need
    chunks = [pieces[id(r)] for r in sorted(staying, key=lambda r: r.in_prefill) if id(r) in pieces]
    adapters = {r.adapter_id for r in staying if r.adapter_id is not None} | set(pinned)
    used = pinned_units + sum(units_of(a) for a in adapters if a not in pinned)
    seats = kv.seats  # a step that preempts admits no one, so the seats its victims free are never counted
    ready: dict[str, bool] = {}  # adapter id -> is_ready, asked once per distinct adapter
    unit_cost: dict[str, int] = {}
    admitted: list[Request] = []
    unplaceable: list[Request] = []
    for request in () if preempted else waiting:  # a step that preempts admits no one
        if budget == 0 or seats == 0:
            break
        adapter_id = request.adapter_id
        needs_slot = adapter_id is not None and adapter_id not in adapters
        if needs_slot:
            if adapter_id not in ready:
                ready[adapter_id] = is_ready(adapter_id)
            if not ready[adapter_id]:
                continue
            if adapter_id not in unit_cost:
                unit_cost[adapter_id] = units_of(adapter_id)
            if pinned_units + unit_cost[adapter_id] > units_available:
                unplaceable.append(request)
                continue
            if used + unit_cost[adapter_id] > units_available:
                if step - request.arrival_step > config.max_wait_steps:
                    break  # overdue: no one behind it goes first
                continue
        cached, blocks = kv.admission(request, budget)
        room = free if not staying and not admitted else free - kv.reserve  # alone, it may take every block
        if blocks > room:
            break  # arrival order: nobody overtakes a request whose blocks do not fit
        if needs_slot:
            adapters.add(adapter_id)
            used += unit_cost[adapter_id]
        count = min(len(request.context) - cached, budget)
        chunks.append(ScheduledChunk(request, count))
        admitted.append(request)
        budget -= count
        free -= blocks
        seats -= 1
    return StepPlan(tuple(chunks), tuple(admitted), tuple(unplaceable), tuple(preempted))
