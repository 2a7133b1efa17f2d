"""The slot allocator: adapter -> a range of pool units, LRU over evictable adapters, refcounted pins.

An adapter of rank r takes ``pool.units_for(r)`` units (a power of two) from slot s on: the kernels read its rows
``[s*G, s*G + r)``. Ranges come from a buddy allocator (`row_space.RowSpace`); each call is planned on a copy of it
(`placement.py`). An adapter is *evictable* when it is ready (published), pinned by no lease and not pinned by an
operator.

Policy (exact, so a reference model can mirror it):
- `acquire(ids)` pins every distinct adapter of a batch. Resident ones are hits. The rank of each missing one is
  read with `rank_of` before anything changes (its error passes through, nothing changed). Missing ones, in
  first-appearance order, each take ``space.alloc(units)``: the lowest-addressed free block of the smallest order
  that fits. While a request does not fit, the least recently used evictable adapter not wanted by the call is
  evicted (its range freed, merging buddies) and the request is retried. The whole call is planned on a copy of the
  space first: when it cannot be satisfied — fewer free plus evictable units than needed, or enough in total but no
  free range large enough even after evicting every evictable adapter (fragmentation) — `SlotsExhaustedError` is
  raised and nothing changes.
- With a `frequency` (the manager's TinyLFU sketch, `policy/admission.py`), "least recently used" above reads "least
  valuable": evictable adapters are taken in order of (estimated frequency, recency), so a burst of cold adapters
  evicts its own kind before a hot adapter. Without one (or while every frequency is equal) the order is exact LRU.
- `pin(id)` is the same for one adapter with an operator pin instead of a lease pin. `preload(id, protect)` is the
  same for one adapter with no pin, evicting only adapters not in `protect` and, with a `frequency`, no more popular
  than `id` itself (a prefetch never evicts a hotter adapter); it returns False, changing nothing, when the adapter
  is resident or loading, or cannot be placed.
- Loads run outside the lock, in order, into ranges reserved for them (not free, not evictable). A range is
  published only after its copy completed; a failed load frees its range and every range reserved after it
  (unloaded), unpins every other adapter of the call (loaded ones stay resident, unpinned) and re-raises
  (`SlotLoadError` wrapping an error that is not an `AdapterError`): no partial pin is ever left behind.
- An adapter nobody pins any more (no lease, no operator pin) goes to the most recent end of the LRU order.
- `forget` (unregister) frees an unpinned range at once; a pinned or loading one is drained: it leaves the
  adapter -> slot map at once (a re-registered adapter loads afresh) and its range is freed when the last lease
  holding it is released.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Mapping

from ..errors import AdapterError, AdapterNotPinnedError, AdapterNotReadyError, SlotLoadError, SlotsExhaustedError
from ..metrics import Move, SwapMetrics, Tier
from .lease import Residency, SlotLease, SlotState, state_of
from .placement import Plan, eviction_candidates, plan_placement
from .prepare import PreparedAdapter
from .row_space import Block, RowSpace
from .slot_pool import SlotPool

__all__ = ["SlotAllocator", "SlotLease", "SlotState"]


class SlotAllocator:
    """Maps adapters to unit ranges of a `SlotPool`; thread-safe (engine, prefetch workers and admin calls).

    `fetch(adapter_id)` returns the adapter's prepared host weights (the registry's `prepared`); `rank_of(adapter_id)`
    its rank before they are fetched (the registry's record); `peek(adapter_id)` the prepared weights only if they are
    at hand without loading (the registry's `peek`). All, and the copy, run without the allocator's lock.
    """

    def __init__(
        self,
        pool: SlotPool,
        fetch: Callable[[str], PreparedAdapter],
        rank_of: Callable[[str], int],
        metrics: SwapMetrics | None = None,
        clock: Callable[[], float] = time.time,
        frequency: Callable[[str], int] | None = None,
        peek: Callable[[str], PreparedAdapter | None] | None = None,
    ) -> None:
        self.pool = pool
        self.num_slots = pool.num_slots
        self.num_units = pool.num_units
        self.metrics = metrics or SwapMetrics()
        self._fetch = fetch
        self._peek = peek  # adapter id -> its prepared weights if at hand now, else None (no loading); None: fetch
        self._rank_of = rank_of
        self._clock = clock
        self._frequency = frequency  # adapter id -> estimated recent requests (None: pure LRU)
        self._cond = threading.Condition()
        self._space = RowSpace(pool.num_units, pool.max_units)
        self._ranges: dict[int, Residency] = {}  # slot -> occupied range (loading, ready or draining)
        self._by_adapter: dict[str, Residency] = {}  # live residencies (loading or ready), not draining
        self._lru: OrderedDict[str, Residency] = OrderedDict()  # evictable; oldest first
        self._leases: set[int] = set()
        self._last_used: dict[str, float] = {}  # adapter id -> clock() of its last acquire or release
        self._lease_ids = itertools.count()

    def acquire(
        self, adapter_ids: Iterable[str | None], prepared_only: Container[str] = (), wait_s: float = 0.0
    ) -> SlotLease:
        """Pin one range per distinct adapter of a batch (None = no adapter), loading the missing ones; a missing
        one in `prepared_only` is copied only from weights `peek` has at hand, never fetched. With `wait_s`, a call
        that finds no room waits up to that long for releases and finished loads to make some (as `pin`).

        Raises `SlotsExhaustedError` when they cannot all be placed, `rank_of`'s error for an unknown adapter, or the
        failed adapter's error (an `AdapterError`; `SlotLoadError` for a failed copy, `AdapterNotReadyError` for a
        `prepared_only` adapter not at hand) when a load fails — in every case nothing stays pinned.
        """
        start = time.perf_counter()
        distinct = list(dict.fromkeys(a for a in adapter_ids if a is not None))
        entries = self._bring_in(distinct, manual=False, wait_s=wait_s, prepared_only=prepared_only)
        with self._cond:
            lease = SlotLease(
                next(self._lease_ids),
                {r.adapter_id: r.slot for r in entries},
                {r.slot: r.rank for r in entries},
                {r.slot: r.vector for r in entries if r.vector is not None},
                tuple(entries),
            )
            self._leases.add(lease.lease_id)
            self._last_used.update((r.adapter_id, r.last_used) for r in entries if not r.draining)
        self.metrics.waited(time.perf_counter() - start)
        return lease

    def release(self, lease: SlotLease) -> None:
        """Unpin a lease's ranges; an adapter nobody pins any more becomes the most recently used evictable one."""
        with self._cond:
            if lease.lease_id not in self._leases:
                names = ", ".join(lease.slots) or "<no adapter>"
                raise AdapterNotPinnedError(names, f"lease {lease.lease_id} is not held (released twice?)")
            self._leases.remove(lease.lease_id)
            now = self._clock()
            for residency in lease._entries:
                residency.last_used = now
                if not residency.draining:
                    self._last_used[residency.adapter_id] = now
                self._unpin(residency)
            self._cond.notify_all()

    def pin(self, adapter_id: str, wait_s: float = 0.0) -> int:
        """Operator pin: keep `adapter_id` resident (loading it if needed) until `unpin`. Returns its slot. With
        `wait_s`, a pin that finds no room waits up to that long for a release, unpin or unregister to make some
        (woken by each) before it raises `SlotsExhaustedError`."""
        return self._bring_in([adapter_id], manual=True, wait_s=wait_s)[0].slot

    def unpin(self, adapter_id: str) -> None:
        """Undo `pin`; the adapter stays resident but becomes evictable once no batch holds it."""
        with self._cond:
            residency = self._by_adapter.get(adapter_id)
            if residency is None or not residency.manual:
                raise AdapterNotPinnedError(adapter_id, "is not pinned by an operator")
            residency.manual = False
            self._settle(residency)
            self._cond.notify_all()

    def preload(self, adapter_id: str, protect: Container[str] = (), strict: bool = False) -> bool:
        """Load `adapter_id` without pinning it (prefetch), evicting the least valuable adapters not in `protect` as
        needed (with a frequency: only ones no more popular than it; `strict`: only less popular ones). Returns
        whether it loaded anything; a failed load frees its range and raises."""
        rank: int | None = None
        while True:
            with self._cond:
                if adapter_id in self._by_adapter:
                    return False
                if rank is not None:
                    ceiling = self._frequency(adapter_id) - strict if self._frequency is not None else None
                    plan = self._plan([adapter_id], {adapter_id: rank}, protect, ceiling)
                    if plan is None:
                        return False
                    reserved = self._commit(plan, [adapter_id], {adapter_id: rank})
                    break
            rank = self._rank(adapter_id)
        self._load_reserved(reserved)
        return True

    def forget(self, adapter_id: str) -> None:
        """The adapter was unregistered: free its range now if unpinned, else when its last lease is released."""
        with self._cond:
            self._last_used.pop(adapter_id, None)
            residency = self._by_adapter.pop(adapter_id, None)
            if residency is None:
                return
            self._lru.pop(adapter_id, None)
            residency.manual = False
            if residency.ready and residency.pins == 0:
                self._free_range(residency)
            else:
                residency.draining = True
            self._cond.notify_all()

    def slot_of(self, adapter_id: str) -> int | None:
        """The slot of a resident (published) adapter, else None."""
        with self._cond:
            residency = self._by_adapter.get(adapter_id)
            return residency.slot if residency is not None and residency.ready else None

    def is_loading(self, adapter_id: str) -> bool:
        """Whether the adapter's range is reserved and its copy under way (an `acquire` of it would wait for it)."""
        with self._cond:
            return self._loading(adapter_id)

    def last_used(self) -> dict[str, float]:
        """clock() of each adapter's last acquire or release, resident or not (forgotten on unregister)."""
        with self._cond:
            return dict(self._last_used)

    def lru_order(self) -> list[str]:
        """Evictable adapters, least recently used first."""
        with self._cond:
            return list(self._lru)

    def free_units(self) -> int:
        """Units in no range."""
        with self._cond:
            return self._space.free_units

    def free_blocks(self) -> list[Block]:
        """The free unit ranges (maximal buddy blocks), by start."""
        with self._cond:
            return self._space.free_blocks()

    def states(self) -> list[SlotState]:
        """Every occupied range, by slot."""
        with self._cond:
            return [state_of(self._ranges[slot]) for slot in sorted(self._ranges)]

    @property
    def resident_bytes(self) -> int:
        """Bytes of the adapters published in the pool (<= pool.nbytes)."""
        with self._cond:
            return sum(r.nbytes for r in self._ranges.values() if r.ready)

    def _rank(self, adapter_id: str) -> int:
        rank = self._rank_of(adapter_id)
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= self.pool.max_rank:
            raise SlotLoadError(adapter_id, f"rank {rank!r} is outside 1..max_rank {self.pool.max_rank}")
        return rank

    def _bring_in(
        self, distinct: list[str], manual: bool, wait_s: float = 0.0, prepared_only: Container[str] = ()
    ) -> list[Residency]:
        ranks: dict[str, int] = {}
        deadline = time.monotonic() + wait_s
        while True:  # ranks are read without the lock; retried until every missing adapter's rank is known
            with self._cond:
                self._cond.wait_for(lambda: not any(self._loading(a) for a in distinct))
                missing = [a for a in distinct if a not in self._by_adapter]
                unknown = [a for a in missing if a not in ranks]
                if not unknown:
                    try:
                        entries, reserved = self._place(distinct, missing, ranks, manual)
                    except SlotsExhaustedError:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            raise
                        self._cond.wait(remaining)  # every release, unpin and forget notifies
                        continue
                    break
            ranks.update((a, self._rank(a)) for a in unknown)
        try:
            self._load_reserved(reserved, prepared_only)
        except BaseException:
            with self._cond:
                for residency in entries:
                    if residency.ready and not manual:
                        self._unpin(residency)
                self._cond.notify_all()
            raise
        return entries

    def _place(
        self, distinct: list[str], missing: list[str], ranks: Mapping[str, int], manual: bool
    ) -> tuple[list[Residency], list[Residency]]:
        """Plan, then commit: pin the resident adapters and reserve ranges for the missing ones (lock held)."""
        wanted = set(distinct)
        plan = self._plan(missing, ranks, wanted)
        if plan is None:
            needed = sum(self.pool.units_for(ranks[a]) for a in missing)
            evictable = sum(r.units for a, r in self._lru.items() if a not in wanted)
            raise SlotsExhaustedError(tuple(missing), needed, self._space.free_units, evictable, self.num_units)
        resident = [self._by_adapter[a] for a in distinct if a in self._by_adapter]
        reserved = self._commit(plan, missing, ranks)
        now = self._clock()
        for residency in resident:
            self._lru.pop(residency.adapter_id, None)
            self.metrics.hit(Tier.SLOT)
        for _ in reserved:
            self.metrics.miss(Tier.SLOT)
        for residency in resident + reserved:
            residency.last_used = now
            if manual:
                residency.manual = True
            else:
                residency.pins += 1
        by_id = {r.adapter_id: r for r in resident + reserved}
        return [by_id[a] for a in distinct], reserved

    def eviction_order(self) -> list[str]:
        """Evictable adapters, the first to be evicted first: by (frequency, recency), or LRU without a frequency."""
        with self._cond:
            return [r.adapter_id for r in self._candidates(())]

    def _candidates(self, keep: Container[str], ceiling: int | None = None) -> list[Residency]:
        return eviction_candidates(self._lru, keep, self._frequency, ceiling)

    def _plan(
        self, missing: list[str], ranks: Mapping[str, int], keep: Container[str], ceiling: int | None = None
    ) -> Plan | None:
        """Place `missing` in order on a copy of the space, evicting the least valuable adapters not in `keep` (and
        with `ceiling`, no more popular than it) until each fits; None when they cannot all be placed."""
        units = [self.pool.units_for(ranks[a]) for a in missing]
        return plan_placement(self._space, self._candidates(keep, ceiling), units)

    def _commit(self, plan: Plan, missing: list[str], ranks: Mapping[str, int]) -> list[Residency]:
        """Evict the plan's victims, adopt its space and reserve its ranges (lock held)."""
        for victim in plan.victims:
            del self._ranges[victim.slot], self._by_adapter[victim.adapter_id], self._lru[victim.adapter_id]
            self.metrics.evicted(Tier.SLOT)
        self._space = plan.space
        reserved = []
        for adapter_id, start in zip(missing, plan.starts, strict=True):
            rank = ranks[adapter_id]
            residency = Residency(adapter_id, start, rank, self.pool.units_for(rank))
            self._ranges[start] = self._by_adapter[adapter_id] = residency
            reserved.append(residency)
        return reserved

    def _prepared(self, adapter_id: str, prepared_only: Container[str]) -> PreparedAdapter:
        if self._peek is None or adapter_id not in prepared_only:
            return self._fetch(adapter_id)
        prepared = self._peek(adapter_id)
        if prepared is None:
            raise AdapterNotReadyError(adapter_id, "not prepared on the host; it may not be loaded inside this call")
        return prepared

    def _load_reserved(self, reserved: list[Residency], prepared_only: Container[str] = ()) -> None:
        """Load each reserved range in turn; on the first failure free it and every later one, then re-raise."""
        for i, residency in enumerate(reserved):
            try:
                prepared = self._prepared(residency.adapter_id, prepared_only)
                if prepared.rows != residency.rank:
                    raise SlotLoadError(
                        residency.adapter_id,
                        f"prepared block has {prepared.rows} rows but rank_of gave rank {residency.rank}",
                    )
                start = time.perf_counter()
                self.pool.load(residency.slot, prepared)
                seconds = time.perf_counter() - start
            except BaseException as error:
                with self._cond:
                    for failed in reserved[i:]:
                        self._free_range(failed)
                    self._cond.notify_all()
                if isinstance(error, AdapterError) or not isinstance(error, Exception):
                    raise
                raise SlotLoadError(
                    residency.adapter_id, f"loading into slot {residency.slot} failed: {error}"
                ) from error
            self.metrics.record(Move.HOST_TO_SLOT, residency.adapter_id, seconds, prepared.nbytes)
            with self._cond:
                residency.nbytes, residency.content = prepared.nbytes, prepared.digest
                residency.vector = prepared.variant.epilogue if prepared.vector is not None else None
                residency.ready = True
                self._settle(residency)
                self._cond.notify_all()

    def _loading(self, adapter_id: str) -> bool:
        residency = self._by_adapter.get(adapter_id)
        return residency is not None and not residency.ready

    def _unpin(self, residency: Residency) -> None:
        assert residency.pins > 0, f"unpin of {residency.adapter_id!r} with no pins"
        residency.pins -= 1
        self._settle(residency)

    def _settle(self, residency: Residency) -> None:
        """Place a ready residency nobody pins: freed if draining, else at the most recent end of the LRU order."""
        if not residency.ready or residency.pins > 0:
            return
        if residency.draining:
            self._free_range(residency)
        elif not residency.manual:
            self._lru[residency.adapter_id] = residency
            self._lru.move_to_end(residency.adapter_id)

    def _free_range(self, residency: Residency) -> None:
        if self._ranges.get(residency.slot) is not residency:
            return
        del self._ranges[residency.slot]
        self._space.free(residency.slot, residency.units)
        if self._by_adapter.get(residency.adapter_id) is residency:
            del self._by_adapter[residency.adapter_id]
        if self._lru.get(residency.adapter_id) is residency:
            del self._lru[residency.adapter_id]
