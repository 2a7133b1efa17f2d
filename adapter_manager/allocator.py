"""The slot allocator: adapter -> slot, LRU over unpinned slots, refcounted pins for in-flight batches.

Policy (exact, so a reference model can mirror it):
- `acquire(ids)` pins every distinct adapter of a batch. Resident ones are hits; missing ones take the lowest free
  slot, else evict the least recently used unpinned slot, in first-appearance order. If the missing ones outnumber
  the free plus evictable slots, `SlotsExhaustedError` is raised and nothing changes.
- Loads run outside the lock, into slots reserved for them (not free, not evictable). A slot is published only after
  its copy completed; a failed load frees its slot, frees the slots reserved after it unloaded, unpins every other
  adapter of the call (loaded ones stay resident, unpinned) and re-raises: no partial pin is ever left behind.
- A released slot (no batch pins, no operator pin) goes to the most recent end of the LRU order.
- `forget` (unregister) frees an unpinned slot at once; a pinned or loading one is drained: it leaves the
  adapter -> slot map at once (a re-registered adapter loads afresh) and its slot is freed when the last lease
  holding it is released.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from .errors import AdapterError, AdapterNotPinnedError, SlotLoadError, SlotsExhaustedError
from .metrics import Move, SwapMetrics, Tier
from .prepare import PreparedAdapter
from .slot_pool import SlotPool


@dataclass(eq=False)
class _Residency:
    """One adapter's stay in one slot, from reservation to the slot being freed."""

    adapter_id: str
    slot: int
    pins: int = 0  # leases holding it
    manual: bool = False  # operator pin
    ready: bool = False  # copy complete, published
    draining: bool = False  # unregistered while pinned or loading: freed at the last release
    nbytes: int = 0
    last_used: float = 0.0


@dataclass(frozen=True)
class SlotState:
    """A plain copy of one occupied slot."""

    slot: int
    adapter_id: str
    state: Literal["loading", "ready", "draining"]
    pins: int  # in-flight batches holding it
    manual: bool  # pinned by an operator
    nbytes: int  # bytes moved host -> slot when it was loaded
    last_used: float  # clock() of the last acquire or release


@dataclass(frozen=True, eq=False)
class SlotLease:
    """The pinned slots of one batch; hand it back to `SlotAllocator.release` exactly once."""

    lease_id: int
    slots: Mapping[str, int]  # adapter id -> slot, stable until released
    _entries: tuple[_Residency, ...] = field(repr=False)

    def slot_indices(
        self, adapter_ids: Sequence[str | None], pad_to: int | None = None, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Per-token slot indices, int32, -1 for tokens without an adapter (and for padding up to `pad_to`).

        Shape: adapter_ids [T]; returns [pad_to or T], built on the host and moved whole to `device`.
        """
        size = len(adapter_ids) if pad_to is None else pad_to
        if size < len(adapter_ids):
            raise ValueError(f"pad_to ({pad_to}) is smaller than the number of tokens ({len(adapter_ids)})")
        values = []
        for adapter_id in adapter_ids:
            if adapter_id is None:
                values.append(-1)
            elif adapter_id in self.slots:
                values.append(self.slots[adapter_id])
            else:
                raise AdapterNotPinnedError(adapter_id, f"not pinned by lease {self.lease_id}")
        indices = torch.tensor(values + [-1] * (size - len(values)), dtype=torch.int32)  # [T]
        return indices if device is None else indices.to(device)


class SlotAllocator:
    """Maps adapters to the slots of a `SlotPool`; thread-safe (engine, prefetch workers and admin calls).

    `fetch(adapter_id)` returns the adapter's prepared host weights (the registry's `prepared`); it and the copy run
    without the allocator's lock held.
    """

    def __init__(
        self,
        pool: SlotPool,
        fetch: Callable[[str], PreparedAdapter],
        metrics: SwapMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.pool = pool
        self.num_slots = pool.num_slots
        self.metrics = metrics or SwapMetrics()
        self._fetch = fetch
        self._clock = clock
        self._cond = threading.Condition()
        self._slots: list[_Residency | None] = [None] * self.num_slots
        self._by_adapter: dict[str, _Residency] = {}  # live residencies (loading or ready), not draining
        self._lru: OrderedDict[str, _Residency] = OrderedDict()  # ready, unpinned; oldest first
        self._free: list[int] = list(range(self.num_slots))  # heap: the lowest free slot is taken first
        self._leases: set[int] = set()
        self._last_used: dict[str, float] = {}  # adapter id -> clock() of its last acquire or release
        self._lease_ids = itertools.count()

    def acquire(self, adapter_ids: Iterable[str | None]) -> SlotLease:
        """Pin one slot per distinct adapter of a batch (None = no adapter), loading the missing ones.

        Raises `SlotsExhaustedError` when they cannot all be pinned, or the failed adapter's error (an
        `AdapterError`; `SlotLoadError` for a failed copy) when a load fails — in both cases nothing stays pinned.
        """
        start = time.perf_counter()
        distinct = list(dict.fromkeys(a for a in adapter_ids if a is not None))
        entries = self._bring_in(distinct, manual=False)
        with self._cond:
            lease = SlotLease(next(self._lease_ids), {r.adapter_id: r.slot for r in entries}, tuple(entries))
            self._leases.add(lease.lease_id)
            self._last_used.update((r.adapter_id, r.last_used) for r in entries if not r.draining)
        self.metrics.waited(time.perf_counter() - start)
        return lease

    def release(self, lease: SlotLease) -> None:
        """Unpin a lease's slots; a slot nobody pins any more becomes the most recently used evictable one."""
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

    def pin(self, adapter_id: str) -> int:
        """Operator pin: keep `adapter_id` resident (loading it if needed) until `unpin`. Returns its slot."""
        return self._bring_in([adapter_id], manual=True)[0].slot

    def unpin(self, adapter_id: str) -> None:
        """Undo `pin`; the adapter stays resident but becomes evictable once no batch holds it."""
        with self._cond:
            residency = self._by_adapter.get(adapter_id)
            if residency is None or not residency.manual:
                raise AdapterNotPinnedError(adapter_id, "is not pinned by an operator")
            residency.manual = False
            self._settle(residency)
            self._cond.notify_all()

    def preload(self, adapter_id: str, protect: Container[str] = ()) -> bool:
        """Load `adapter_id` without pinning it (prefetch), into a free slot or in place of the least recently used
        evictable adapter not in `protect`. Returns whether it loaded anything; a failed load frees the slot and
        raises."""
        with self._cond:
            if adapter_id in self._by_adapter:
                return False
            victim = None
            if not self._free:
                victim = next((a for a in self._lru if a not in protect), None)
                if victim is None:
                    return False
            residency = self._reserve(adapter_id, manual=False, victim=victim)
        self._load_reserved([residency])
        return True

    def forget(self, adapter_id: str) -> None:
        """The adapter was unregistered: free its slot now if unpinned, else when its last lease is released."""
        with self._cond:
            self._last_used.pop(adapter_id, None)
            residency = self._by_adapter.pop(adapter_id, None)
            if residency is None:
                return
            self._lru.pop(adapter_id, None)
            residency.manual = False
            if residency.ready and residency.pins == 0:
                self._free_slot(residency)
            else:
                residency.draining = True
            self._cond.notify_all()

    def slot_of(self, adapter_id: str) -> int | None:
        """The slot of a resident (published) adapter, else None."""
        with self._cond:
            residency = self._by_adapter.get(adapter_id)
            return residency.slot if residency is not None and residency.ready else None

    def last_used(self) -> dict[str, float]:
        """clock() of each adapter's last acquire or release, resident or not (forgotten on unregister)."""
        with self._cond:
            return dict(self._last_used)

    def lru_order(self) -> list[str]:
        """Evictable adapters, least recently used first."""
        with self._cond:
            return list(self._lru)

    def free_slots(self) -> list[int]:
        with self._cond:
            return sorted(self._free)

    def states(self) -> list[SlotState]:
        """Every occupied slot, by slot index."""
        with self._cond:
            return [_state(r) for r in self._slots if r is not None]

    @property
    def resident_bytes(self) -> int:
        """Bytes of the adapters published in slots (<= pool.nbytes)."""
        with self._cond:
            return sum(r.nbytes for r in self._slots if r is not None and r.ready)

    def _bring_in(self, distinct: list[str], manual: bool) -> list[_Residency]:
        with self._cond:
            self._cond.wait_for(lambda: not any(self._loading(a) for a in distinct))
            resident = [self._by_adapter[a] for a in distinct if a in self._by_adapter]
            missing = [a for a in distinct if a not in self._by_adapter]
            wanted = set(distinct)
            available = len(self._free) + sum(1 for a in self._lru if a not in wanted)
            if len(missing) > available:
                raise SlotsExhaustedError(tuple(missing), len(missing), available, self.num_slots)
            now = self._clock()
            for residency in resident:
                self._lru.pop(residency.adapter_id, None)
                residency.last_used = now
                if manual:
                    residency.manual = True
                else:
                    residency.pins += 1
                self.metrics.hit(Tier.SLOT)
            reserved = [self._reserve(a, manual) for a in missing]
            for residency in reserved:
                residency.pins = 0 if manual else 1
                residency.last_used = now
                self.metrics.miss(Tier.SLOT)
            by_id = {r.adapter_id: r for r in resident + reserved}
            entries = [by_id[a] for a in distinct]
        try:
            self._load_reserved(reserved)
        except BaseException:
            with self._cond:
                for residency in entries:
                    if residency.ready and not manual:
                        self._unpin(residency)
                self._cond.notify_all()
            raise
        return entries

    def _load_reserved(self, reserved: list[_Residency]) -> None:
        """Load each reserved slot in turn; on the first failure free it and every later one, then re-raise."""
        for i, residency in enumerate(reserved):
            try:
                prepared = self._fetch(residency.adapter_id)
                start = time.perf_counter()
                self.pool.load(residency.slot, prepared)
                seconds = time.perf_counter() - start
            except BaseException as error:
                with self._cond:
                    for failed in reserved[i:]:
                        self._free_slot(failed)
                    self._cond.notify_all()
                if isinstance(error, AdapterError) or not isinstance(error, Exception):
                    raise
                raise SlotLoadError(
                    residency.adapter_id, f"loading into slot {residency.slot} failed: {error}"
                ) from error
            self.metrics.record(Move.HOST_TO_SLOT, residency.adapter_id, seconds, prepared.nbytes)
            with self._cond:
                residency.nbytes = prepared.nbytes
                residency.ready = True
                self._settle(residency)
                self._cond.notify_all()

    def _loading(self, adapter_id: str) -> bool:
        residency = self._by_adapter.get(adapter_id)
        return residency is not None and not residency.ready

    def _reserve(self, adapter_id: str, manual: bool, victim: str | None = None) -> _Residency:
        """Take the lowest free slot, else evict `victim` (default: the least recently used evictable adapter)."""
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            victim = self._lru.pop(victim) if victim is not None else self._lru.popitem(last=False)[1]
            del self._by_adapter[victim.adapter_id]
            self._slots[victim.slot] = None
            self.metrics.evicted(Tier.SLOT)
            slot = victim.slot
        residency = _Residency(adapter_id, slot, manual=manual)
        self._slots[slot] = residency
        self._by_adapter[adapter_id] = residency
        return residency

    def _unpin(self, residency: _Residency) -> None:
        assert residency.pins > 0, f"unpin of {residency.adapter_id!r} with no pins"
        residency.pins -= 1
        self._settle(residency)

    def _settle(self, residency: _Residency) -> None:
        """Place a ready residency nobody pins: freed if draining, else at the most recent end of the LRU order."""
        if not residency.ready or residency.pins > 0:
            return
        if residency.draining:
            self._free_slot(residency)
        elif not residency.manual:
            self._lru[residency.adapter_id] = residency
            self._lru.move_to_end(residency.adapter_id)

    def _free_slot(self, residency: _Residency) -> None:
        if self._slots[residency.slot] is not residency:
            return
        self._slots[residency.slot] = None
        heapq.heappush(self._free, residency.slot)
        if self._by_adapter.get(residency.adapter_id) is residency:
            del self._by_adapter[residency.adapter_id]
        if self._lru.get(residency.adapter_id) is residency:
            del self._lru[residency.adapter_id]


def _state(residency: _Residency) -> SlotState:
    state = "draining" if residency.draining else "ready" if residency.ready else "loading"
    return SlotState(
        residency.slot,
        residency.adapter_id,
        state,
        residency.pins,
        residency.manual,
        residency.nbytes,
        residency.last_used,
    )
