"""What a replica holds: counted pin holds on its pool (Serve's loaded models, in-flight requests, operator pins),
the object Serve's multiplexer caches per adapter, and each adapter's decayed request rate."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from adapter_manager import AdapterManager, AdapterNotFoundError, AdapterNotPinnedError

T = TypeVar("T")


class Heat:
    """Requests per adapter, decayed exponentially (half-life `half_life_s`): how valuable each resident is."""

    def __init__(self, half_life_s: float = 10.0) -> None:
        self._rate = math.log(2) / half_life_s
        self._values: dict[str, tuple[float, float]] = {}

    def hit(self, adapter_id: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._values[adapter_id] = (self.value(adapter_id, now) + 1.0, now)

    def value(self, adapter_id: str, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        value, at = self._values.get(adapter_id, (0.0, now))
        return value * math.exp(-self._rate * (now - at))

    def forget(self, adapter_id: str) -> None:
        self._values.pop(adapter_id, None)


class Holds:
    """Counted operator pins: the adapter is pinned in the pool from its first hold to its last drop. Serve's loaded
    model is one hold, each in-flight request another. `hold` runs on the replica's event loop; `drop` may run on
    any thread (Serve calls a model's synchronous `__del__` in an executor), hence the lock around the counts: a
    drop and its unpin happen under it, so `view` sees both or neither."""

    def __init__(self, manager: AdapterManager, pin: Callable[[str], Awaitable[None]]) -> None:
        self._manager, self._pin = manager, pin
        self._counts: dict[str, int] = {}
        self.lock = threading.RLock()  # Resident takes it around its own removal and drop
        self._pinning: dict[str, asyncio.Lock] = {}  # one first hold (one pin) per adapter at a time

    async def hold(self, adapter_id: str) -> None:
        """Take a hold, pinning the adapter if it is the first (raises the pin's error, holding nothing)."""
        async with self._pinning.setdefault(adapter_id, asyncio.Lock()):
            if self._add(adapter_id, first=False):
                return
            await self._pin(adapter_id)  # no hold exists meanwhile, so no drop can unpin it
            self._add(adapter_id, first=True)

    def _add(self, adapter_id: str, first: bool) -> bool:
        with self.lock:
            if not first and adapter_id not in self._counts:
                return False
            self._counts[adapter_id] = self._counts.get(adapter_id, 0) + 1
            return True

    def drop(self, adapter_id: str) -> None:
        """Give a hold back; the last one unpins (the adapter stays resident, and evictable)."""
        with self.lock:
            count = self._counts.get(adapter_id, 0) - 1
            if count > 0:
                self._counts[adapter_id] = count
                return
            self._counts.pop(adapter_id, None)
            try:  # under the lock: a new first hold pins only after this unpin
                self._manager.unpin(adapter_id)
            except (AdapterNotPinnedError, AdapterNotFoundError):
                pass  # unregistered meanwhile: nothing is held

    def counts(self) -> dict[str, int]:
        """Holds per pinned adapter."""
        with self.lock:
            return dict(self._counts)

    def view(self, read: Callable[[], T]) -> tuple[dict[str, int], T]:
        """The holds and `read()` (the pool's state, Serve's loaded models) at one instant: no drop, unpin or
        unload runs between them."""
        with self.lock:
            return dict(self._counts), read()


class Resident:
    """What Serve's multiplexer caches for one adapter: one hold on its pin, dropped once on unload. It lists itself
    in `loaded` (the replica's multiplexed models) while it lives."""

    def __init__(self, loaded: dict[str, Resident], holds: Holds, adapter_id: str) -> None:
        self._loaded, self._holds, self.adapter_id, self._held = loaded, holds, adapter_id, True
        loaded[adapter_id] = self

    def __del__(self) -> None:  # Serve calls it on LRU unload (and Python again at collection: hence `_held`)
        with self._holds.lock:  # leaves `loaded` and drops at once, as a report sees it
            if not self._held:
                return
            self._held = False
            if self._loaded.get(self.adapter_id) is self:
                del self._loaded[self.adapter_id]
            self._holds.drop(self.adapter_id)
