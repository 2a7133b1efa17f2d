"""Timing of every tier move (hub download, disk -> host prepare, host -> slot copy), per-tier hit counts, the
exposed wait of batches for their adapters, and (given by the manager) each adapter's residency."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Literal

import numpy as np


class Tier(StrEnum):
    """A move between storage tiers; the value is the label used in snapshots and Prometheus."""

    HUB = "hub_download"  # hub -> local disk (HF cache)
    PREPARE = "disk_to_host"  # local files -> prepared host weights (read, validate, fold, pad)
    SLOT = "host_to_slot"  # prepared host weights -> device slot


@dataclass(frozen=True)
class TierMove:
    """One timed move of one adapter."""

    tier: Tier
    adapter_id: str
    seconds: float
    nbytes: int
    at: float  # wall-clock time.time() when the move finished


@dataclass(frozen=True)
class TierStats:
    """Aggregate over the moves of one tier (percentiles over the most recent `window` moves)."""

    count: int
    total_bytes: int
    total_seconds: float
    p50_s: float
    p95_s: float
    p99_s: float
    max_s: float


@dataclass(frozen=True)
class WaitStats:
    """Exposed wait: how long `acquire` calls (runnable batches) waited for their adapters (0 when all hit)."""

    count: int
    total_seconds: float
    p50_s: float
    p95_s: float
    p99_s: float
    max_s: float


@dataclass(frozen=True)
class AdapterResidency:
    """Where one registered adapter lives now, and when a batch last used it."""

    adapter_id: str
    tier: Literal["slot", "host", "disk"]  # highest tier holding it: a device slot, prepared on the host, disk only
    slot: int | None  # its device slot when tier == "slot"
    pinned: bool  # held by an in-flight batch or an operator pin
    last_used: float | None  # time.time() of its last acquire or release, None if never used


@dataclass(frozen=True)
class MetricsSnapshot:
    """A plain copy of the metrics at one moment."""

    tiers: dict[str, TierStats]
    hits: dict[str, int]
    misses: dict[str, int]
    evictions: dict[str, int]
    exposed_wait: WaitStats | None = None  # None until a batch has acquired its slots
    residency: dict[str, AdapterResidency] = field(default_factory=dict)  # by adapter id (from the manager)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SwapMetrics:
    """Thread-safe recorder of tier moves; `snapshot()` is what Python, the CLI and Prometheus read."""

    window: int = 10_000  # moves per tier kept for percentiles
    history: int = 1_000  # most recent moves kept in order (any tier), for per-adapter histories
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _samples: dict[Tier, deque[float]] = field(default_factory=dict, repr=False)
    _count: dict[Tier, int] = field(default_factory=dict, repr=False)
    _bytes: dict[Tier, int] = field(default_factory=dict, repr=False)
    _seconds: dict[Tier, float] = field(default_factory=dict, repr=False)
    _max: dict[Tier, float] = field(default_factory=dict, repr=False)
    _hits: dict[str, int] = field(default_factory=dict, repr=False)
    _misses: dict[str, int] = field(default_factory=dict, repr=False)
    _evictions: dict[str, int] = field(default_factory=dict, repr=False)
    _recent: deque[TierMove] = field(init=False, repr=False)
    _waits: deque[float] = field(init=False, repr=False)
    _wait_count: int = field(default=0, repr=False)
    _wait_seconds: float = field(default=0.0, repr=False)
    _wait_max: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        if self.window <= 0 or self.history <= 0:
            raise ValueError(f"window ({self.window}) and history ({self.history}) must be positive")
        self._recent = deque(maxlen=self.history)
        self._waits = deque(maxlen=self.window)

    def record(self, tier: Tier, adapter_id: str, seconds: float, nbytes: int) -> TierMove:
        move = TierMove(tier, adapter_id, seconds, nbytes, time.time())
        with self._lock:
            self._samples.setdefault(tier, deque(maxlen=self.window)).append(seconds)
            self._count[tier] = self._count.get(tier, 0) + 1
            self._bytes[tier] = self._bytes.get(tier, 0) + nbytes
            self._seconds[tier] = self._seconds.get(tier, 0.0) + seconds
            self._max[tier] = max(self._max.get(tier, 0.0), seconds)
            self._recent.append(move)
        return move

    def hit(self, tier: str) -> None:
        with self._lock:
            self._hits[tier] = self._hits.get(tier, 0) + 1

    def miss(self, tier: str) -> None:
        with self._lock:
            self._misses[tier] = self._misses.get(tier, 0) + 1

    def evicted(self, tier: str) -> None:
        with self._lock:
            self._evictions[tier] = self._evictions.get(tier, 0) + 1

    def waited(self, seconds: float) -> None:
        """Record the exposed wait of one batch for its adapters (0.0 when every adapter was resident)."""
        with self._lock:
            self._waits.append(seconds)
            self._wait_count += 1
            self._wait_seconds += seconds
            self._wait_max = max(self._wait_max, seconds)

    def moves(self, adapter_id: str | None = None) -> list[TierMove]:
        """The most recent moves, oldest first, optionally of one adapter."""
        with self._lock:
            return [m for m in self._recent if adapter_id is None or m.adapter_id == adapter_id]

    def snapshot(self, residency: dict[str, AdapterResidency] | None = None) -> MetricsSnapshot:
        """A plain copy; `residency` (the manager's view of every adapter) is attached as given."""
        with self._lock:
            tiers = {}
            for tier, samples in self._samples.items():
                p50, p95, p99 = np.percentile(np.fromiter(samples, float), [50, 95, 99]).tolist()
                tiers[tier.value] = TierStats(
                    self._count[tier], self._bytes[tier], self._seconds[tier], p50, p95, p99, self._max[tier]
                )
            wait = None
            if self._waits:
                p50, p95, p99 = np.percentile(np.fromiter(self._waits, float), [50, 95, 99]).tolist()
                wait = WaitStats(self._wait_count, self._wait_seconds, p50, p95, p99, self._wait_max)
            return MetricsSnapshot(
                tiers, dict(self._hits), dict(self._misses), dict(self._evictions), wait, dict(residency or {})
            )
