"""The host tier: a byte-bounded LRU of prepared adapters (cachetools), safe to share between threads."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

from cachetools import LRUCache

from .metrics import SwapMetrics, Tier
from .prepare import PreparedAdapter


class _ByteLRU(LRUCache):
    """LRUCache sized in bytes that tells its owner what it evicts."""

    def __init__(self, capacity_bytes: int, on_evict: Callable[[], None]) -> None:
        super().__init__(maxsize=capacity_bytes, getsizeof=lambda prepared: prepared.nbytes)
        self._on_evict = on_evict

    def popitem(self):
        item = super().popitem()
        self._on_evict()
        return item


class HostTier:
    """Prepared adapters kept in host memory, least recently used evicted first, `capacity_bytes` never exceeded.

    `get_or_load` runs a loader at most once per key at a time: concurrent callers for the same key wait for the
    first one's result instead of preparing the same adapter twice.
    """

    def __init__(self, capacity_bytes: int, metrics: SwapMetrics) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"host tier capacity must be positive, got {capacity_bytes} bytes")
        self._metrics = metrics
        self._cache = _ByteLRU(capacity_bytes, lambda: metrics.evicted(Tier.HOST))
        self._lock = threading.Lock()
        self._loading: dict[Hashable, threading.Event] = {}

    @property
    def capacity_bytes(self) -> int:
        return self._cache.maxsize

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._cache.currsize

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._cache

    def keys(self) -> set[Hashable]:
        """Keys of the resident adapters."""
        with self._lock:
            return set(self._cache.keys())

    def get(self, key: Hashable) -> PreparedAdapter | None:
        """The prepared adapter if resident (counts a hit or a miss and refreshes its LRU position)."""
        with self._lock:
            prepared = self._cache.get(key)
        if prepared is None:
            self._metrics.miss(Tier.HOST)
        else:
            self._metrics.hit(Tier.HOST)
        return prepared

    def put(self, key: Hashable, prepared: PreparedAdapter) -> None:
        if prepared.nbytes > self.capacity_bytes:
            raise ValueError(
                f"adapter {prepared.adapter_id!r} ({prepared.nbytes} B) is larger than the host tier "
                f"({self.capacity_bytes} B)"
            )
        with self._lock:
            # Replace as remove + insert: cachetools may evict the key being replaced and then miscount its size.
            self._cache.pop(key, None)
            self._cache[key] = prepared

    def discard(self, key: Hashable) -> None:
        with self._lock:
            self._cache.pop(key, None)

    def get_or_load(self, key: Hashable, loader: Callable[[], PreparedAdapter]) -> PreparedAdapter:
        """The resident adapter, or the loader's result (then cached). A loader's exception reaches every waiter's
        own retry: nothing is cached for a failed load."""
        while True:
            with self._lock:
                prepared = self._cache.get(key)
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
