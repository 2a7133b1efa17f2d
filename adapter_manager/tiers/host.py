"""The host tier: a byte-bounded cache of prepared adapters (cachetools does the byte accounting), safe to share
between threads. Eviction is LRU; with a `frequency` (the manager's TinyLFU sketch, `policy/admission.py`) it takes
the least valuable entries first, by (estimated frequency, recency), and a new entry is admitted only if it is at
least as popular as every entry it would evict, so one pass over cold adapters cannot flush the hot ones.

A prefetch reserves its room before it prepares anything (`reserve`): the victims it may evict are chosen then
(never one it must keep, with a ceiling never one more popular), the bytes are held by a placeholder that counts
against the bound and is never evicted, and the `put` of the prepared adapter fills it without a second admission
decision. No room: nothing is evicted and the caller prepares nothing."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Container, Hashable

from cachetools import Cache

from ..metrics import SwapMetrics, Tier
from .prepare import PreparedAdapter


class _Reserved:
    """Room held for an adapter being prepared: counts `nbytes` against the bound, never evicted, never served."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


class _ByteCache(Cache):
    """A cachetools Cache sized in bytes, evicting by (frequency, recency), that tells its owner what it evicts."""

    def __init__(self, capacity_bytes: int, on_evict: Callable[[], None]) -> None:
        super().__init__(maxsize=capacity_bytes, getsizeof=lambda prepared: prepared.nbytes)
        self._on_evict = on_evict
        self._order: OrderedDict[Hashable, None] = OrderedDict()  # least recently used first
        self.frequency: Callable[[Hashable], int] | None = None

    def __getitem__(self, key: Hashable) -> PreparedAdapter:
        value = super().__getitem__(key)
        self._order.move_to_end(key)
        return value

    def __setitem__(self, key: Hashable, value: PreparedAdapter) -> None:
        super().__setitem__(key, value)
        self._order[key] = None
        self._order.move_to_end(key)

    def __delitem__(self, key: Hashable) -> None:
        super().__delitem__(key)
        del self._order[key]

    def reserved(self, key: Hashable) -> bool:
        return key in self and isinstance(Cache.__getitem__(self, key), _Reserved)  # no LRU refresh

    def eviction_order(self) -> list[Hashable]:
        """Keys of prepared entries (never a reservation), the first to be evicted first."""
        keys = [k for k in self._order if not self.reserved(k)]
        if self.frequency is None:
            return keys
        frequency = self.frequency
        return [key for _, _, key in sorted((frequency(k), i, k) for i, k in enumerate(keys))]

    def victims(self, nbytes: int, keep: Container[Hashable] = (), ceiling: int | None = None) -> list[Hashable] | None:
        """The entries to evict, first to last, so that `nbytes` fit: none in `keep` and, with a `ceiling`, none
        estimated more popular than it; None when even evicting all of those leaves too little room."""
        room, chosen = self.maxsize - self.currsize, []
        hotter = ceiling is not None and self.frequency is not None
        for victim in self.eviction_order():
            if room >= nbytes:
                break
            if victim in keep or (hotter and self.frequency(victim) > ceiling):
                continue
            chosen.append(victim)
            room += self.getsizeof(Cache.__getitem__(self, victim))
        return chosen if room >= nbytes else None

    def admits(self, key: Hashable, nbytes: int) -> bool:
        """Whether an entry of `nbytes` for `key` may go in: it fits in free room, or in room made by evicting
        prepared entries each at most as popular as it (any, without a frequency)."""
        ceiling = self.frequency(key) if self.frequency is not None else None
        return self.victims(nbytes, (), ceiling) is not None

    def popitem(self) -> tuple[Hashable, PreparedAdapter]:
        try:
            key = self.eviction_order()[0]
        except IndexError:
            raise KeyError("the host tier is empty") from None
        value = Cache.__getitem__(self, key)
        del self[key]
        self._on_evict()
        return key, value


class HostTier:
    """Prepared adapters kept in host memory, `capacity_bytes` never exceeded: least recently used evicted first, or
    with `frequency` set, least valuable first and unpopular newcomers not admitted (see the module doc).

    `get_or_load` runs a loader at most once per key at a time: concurrent callers for the same key wait for the
    first one's result instead of preparing the same adapter twice.
    """

    def __init__(self, capacity_bytes: int, metrics: SwapMetrics) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"host tier capacity must be positive, got {capacity_bytes} bytes")
        self._metrics = metrics
        self._cache = _ByteCache(capacity_bytes, lambda: metrics.evicted(Tier.HOST))
        self._lock = threading.Lock()
        self._loading: dict[Hashable, threading.Event] = {}

    @property
    def frequency(self) -> Callable[[Hashable], int] | None:
        """Key -> estimated recent requests (the manager's sketch); None: plain LRU, every newcomer admitted."""
        return self._cache.frequency

    @frequency.setter
    def frequency(self, frequency: Callable[[Hashable], int] | None) -> None:
        with self._lock:
            self._cache.frequency = frequency

    def eviction_order(self) -> list[Hashable]:
        """Resident keys, the first to be evicted first."""
        with self._lock:
            return self._cache.eviction_order()

    @property
    def capacity_bytes(self) -> int:
        return self._cache.maxsize

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._cache.currsize

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._cache and not self._cache.reserved(key)

    def keys(self) -> set[Hashable]:
        """Keys of the resident adapters (not the reservations)."""
        with self._lock:
            return {key for key in self._cache.keys() if not self._cache.reserved(key)}

    @property
    def reserved_bytes(self) -> int:
        """Bytes held for adapters being prepared (part of `used_bytes`)."""
        with self._lock:
            return sum(Cache.__getitem__(self._cache, k).nbytes for k in self._cache if self._cache.reserved(k))

    def _get(self, key: Hashable) -> PreparedAdapter | None:
        """The prepared entry (refreshing its LRU position), None for a reservation or a missing key. Lock held."""
        if key not in self._cache or self._cache.reserved(key):
            return None
        return self._cache[key]

    def get(self, key: Hashable) -> PreparedAdapter | None:
        """The prepared adapter if resident (counts a hit or a miss and refreshes its LRU position)."""
        with self._lock:
            prepared = self._get(key)
        if prepared is None:
            self._metrics.miss(Tier.HOST)
        else:
            self._metrics.hit(Tier.HOST)
        return prepared

    def put(self, key: Hashable, prepared: PreparedAdapter) -> bool:
        """Cache `prepared` under `key` unless admission refuses it (less popular than what it would evict); returns
        whether it was cached."""
        if prepared.nbytes > self.capacity_bytes:
            raise ValueError(
                f"adapter {prepared.adapter_id!r} ({prepared.nbytes} B) is larger than the host tier "
                f"({self.capacity_bytes} B)"
            )
        with self._lock:
            # Replace as remove + insert: cachetools may evict the key being replaced and then miscount its size.
            # A reservation for the key is its room: filled without a second admission decision.
            held = self._cache.pop(key, None)
            if not isinstance(held, _Reserved) and not self._cache.admits(key, prepared.nbytes):
                self._metrics.rejected(Tier.HOST)
                return False
            victims = self._cache.victims(prepared.nbytes)
            if victims is None:  # larger than its reservation, and the rest is reserved too
                self._metrics.rejected(Tier.HOST)
                return False
            self._evict(victims)
            self._cache[key] = prepared
        return True

    def reserve(self, key: Hashable, nbytes: int, keep: Container[Hashable] = (), ceiling: int | None = None) -> bool:
        """Hold room for `key` (about to be prepared, `nbytes`) before any work is done, evicting least valuable
        entries not in `keep` and, with `ceiling`, none estimated more popular than it. False, changing nothing,
        when there is no such room or `key` is already resident or reserved. `put` fills it; `unreserve` gives it
        back."""
        if nbytes > self.capacity_bytes:
            return False
        with self._lock:
            if key in self._cache:
                return False
            victims = self._cache.victims(nbytes, keep, ceiling)
            if victims is None:
                return False
            self._evict(victims)
            self._cache[key] = _Reserved(nbytes)
        return True

    def unreserve(self, key: Hashable) -> None:
        """Give back the room `reserve` held for `key` if nothing filled it."""
        with self._lock:
            if self._cache.reserved(key):
                del self._cache[key]

    def _evict(self, victims: list[Hashable]) -> None:
        for victim in victims:
            del self._cache[victim]
            self._metrics.evicted(Tier.HOST)

    def discard(self, key: Hashable) -> None:
        with self._lock:
            self._cache.pop(key, None)

    def get_or_load(self, key: Hashable, loader: Callable[[], PreparedAdapter]) -> PreparedAdapter:
        """The resident adapter, or the loader's result (then cached). A loader's exception reaches every waiter's
        own retry: nothing is cached for a failed load."""
        while True:
            with self._lock:
                prepared = self._get(key)
                if prepared is not None:
                    self._metrics.hit(Tier.HOST)
                    return prepared
                pending = self._loading.get(key)
                if pending is None:
                    pending = self._loading[key] = threading.Event()
                    break
            pending.wait()
        self._metrics.miss(Tier.HOST)
        try:
            prepared = loader()
            self.put(key, prepared)
            return prepared
        finally:
            with self._lock:
                del self._loading[key]
            pending.set()
