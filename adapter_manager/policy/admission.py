"""Popularity for the host and slot tiers: a TinyLFU frequency sketch (count-min sketch behind a doorkeeper, aged by
halving) that the tiers consult before they evict.

TinyLFU (Einziger, Friedman, Manes 2017): every request of an adapter is recorded; its estimated frequency is the
minimum of `depth` saturating counters it hashes to, plus one if the doorkeeper has seen it since the last aging.
The doorkeeper (a set of ids seen once) keeps one-off adapters out of the counters, so a scan of cold adapters
barely moves them. Every `sample_size` records the counters are halved and the doorkeeper cleared, so popularity
follows the recent past (an adapter hot an hour ago is not hot forever).

How the tiers use it (`value` = (frequency, recency)):
- slot tier: a requested adapter is always served; to make room the allocator evicts the least valuable evictable
  adapters first (lowest frequency, then least recently used), so a burst of cold adapters evicts each other before
  it evicts a hot one. A prefetch evicts only adapters no more popular than the one it brings in.
- host tier: a newly prepared adapter is cached only if it is at least as popular as every entry it would evict;
  otherwise it is served once without being kept (TinyLFU admission).
With no requests recorded every frequency is 0 and both tiers are exactly LRU.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np


@dataclass
class SketchConfig:
    """Size and memory of the frequency sketch."""

    width: int = 4096  # counters per row (rounded up to a power of two); ~4x the distinct adapters keeps errors small
    depth: int = 4  # rows (hash functions); the estimate is the minimum over them
    sample_size: int = 10_000  # records between agings (halve counters, clear the doorkeeper)
    max_count: int = 15  # counters saturate here (TinyLFU's 4-bit counters)
    top_k: int = 64  # the most popular keys tracked by name (heavy hitters), for popularity prefetch

    def __post_init__(self) -> None:
        if self.width < 1 or not 1 <= self.depth <= 8 or self.sample_size < 1 or self.max_count < 1 or self.top_k < 0:
            raise ValueError(
                f"sketch width ({self.width}) and sample_size ({self.sample_size}) must be >= 1, depth ({self.depth}) "
                f"in 1..8, max_count ({self.max_count}) >= 1, top_k ({self.top_k}) >= 0"
            )
        self.width = 1 << (self.width - 1).bit_length()


class FrequencySketch:
    """Approximate, aging request counts per key; thread-safe. `record` on every request, `estimate` when choosing
    what to keep."""

    def __init__(self, config: SketchConfig | None = None) -> None:
        self.config = config or SketchConfig()
        self._counts = np.zeros((self.config.depth, self.config.width), dtype=np.uint8)  # [depth, width]
        self._rows = np.arange(self.config.depth)
        self._doorkeeper: set[Hashable] = set()
        self._top: dict[Hashable, int] = {}  # up to top_k keys -> their estimate when last recorded
        self._records = 0
        self._agings = 0
        self._lock = threading.Lock()

    @property
    def agings(self) -> int:
        """How many times the counters were halved."""
        return self._agings

    def record(self, key: Hashable) -> None:
        """Count one request of `key`: its first since the last aging goes to the doorkeeper, later ones to the
        counters (each of its cells below `max_count` is incremented)."""
        cells = self._cells(key)
        with self._lock:
            if key not in self._doorkeeper:
                self._doorkeeper.add(key)
            else:
                counts = self._counts[self._rows, cells]
                self._counts[self._rows, cells] = np.minimum(counts + 1, self.config.max_count)
            self._track(key, int(self._counts[self._rows, cells].min()) + 1)
            self._records += 1
            if self._records >= self.config.sample_size:
                self._counts >>= 1
                self._doorkeeper.clear()
                self._top = {k: v >> 1 for k, v in self._top.items()}
                self._records = 0
                self._agings += 1

    def top(self, n: int) -> list[Hashable]:
        """Up to `n` of the most requested keys (of the `top_k` tracked), most popular first."""
        with self._lock:
            keys = list(self._top)
        scored = sorted(((self.estimate(k), i, k) for i, k in enumerate(keys)), key=lambda e: (-e[0], e[1]))
        return [k for estimate, _, k in scored[:n] if estimate > 0]

    def discard(self, key: Hashable) -> None:
        """Stop tracking `key` by name (unregistered); its counters age away."""
        with self._lock:
            self._top.pop(key, None)
            self._doorkeeper.discard(key)

    def estimate(self, key: Hashable) -> int:
        """Estimated requests of `key` in the recent past (never below the truth since the last aging, up to
        `max_count` + 1)."""
        cells = self._cells(key)
        with self._lock:
            return int(self._counts[self._rows, cells].min()) + (key in self._doorkeeper)

    def _track(self, key: Hashable, estimate: int) -> None:
        """Keep `key` among the tracked top keys if it is, or beats the least of them (lock held)."""
        top = self._top
        if key in top or len(top) < self.config.top_k:
            top[key] = estimate
        elif top:
            least = min(top, key=top.__getitem__)
            if estimate > top[least]:
                del top[least]
                top[key] = estimate

    def _cells(self, key: Hashable) -> np.ndarray:
        digest = hashlib.blake2b(repr(key).encode(), digest_size=4 * self.config.depth).digest()
        return np.frombuffer(digest, dtype=np.uint32) & np.uint32(self.config.width - 1)  # [depth]
