"""Timing of every move between tiers, per-tier hit counts, the stall of batches (engine steps) on moves, each
request's adapter wait, and (given by the manager) each adapter's residency.

One vocabulary everywhere (Python snapshot, JSON endpoint, Prometheus labels, CLI, README): a **tier** is where an
adapter lives — ``hub``, ``disk`` (the HF cache or a local directory), ``host`` (prepared weights), ``slot`` (a device
slot) — and a **move** goes from one tier to the next, named ``<from>_to_<to>``: ``hub_to_disk`` (download),
``disk_to_host`` (read, validate, fold, pad), ``host_to_slot`` (copy into the slot stacks). Hits, misses, evictions
and residency are keyed by tier; latencies and bytes by move.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Literal

import numpy as np


class Tier(StrEnum):
    """Where an adapter lives; the value labels hits, misses, evictions and residency."""

    HUB = "hub"
    DISK = "disk"  # adapter files on local disk: the HF cache or a registered local directory
    HOST = "host"  # prepared weights in host memory (the host tier)
    SLOT = "slot"  # a device slot


class Move(StrEnum):
    """A timed move of one adapter from one tier to the next; the value labels latencies and bytes."""

    HUB_TO_DISK = "hub_to_disk"  # download into the HF cache
    DISK_TO_HOST = "disk_to_host"  # read, validate, fold the scale, pad: prepared host weights
    HOST_TO_SLOT = "host_to_slot"  # copy into a device slot


@dataclass(frozen=True)
class AdapterMove:
    """One timed move of one adapter."""

    move: Move
    adapter_id: str
    seconds: float
    nbytes: int
    at: float  # wall-clock time.time() when the move finished


LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)  # upper bounds of the latency histograms (seconds); +Inf is implied by `count`


@dataclass(frozen=True)
class LatencyStats:
    """Latencies since start: count, sum, max, cumulative histogram; percentiles over the most recent `window`."""

    count: int
    total_seconds: float
    p50_s: float
    p95_s: float
    p99_s: float
    max_s: float
    buckets: tuple[tuple[float, int], ...]  # (upper bound s, samples <= it), cumulative, LATENCY_BUCKETS_S order


@dataclass(frozen=True)
class MoveStats(LatencyStats):
    """One kind of move: their latencies and the bytes they moved."""

    total_bytes: int = 0


@dataclass(frozen=True)
class WaitStats(LatencyStats):
    """A wait for adapters: ``stall`` — how long each `acquire` (an engine step, with everyone in it) was blocked
    on moves (0 when every adapter was resident); ``adapter_wait`` — how long each request waited from submit until
    its adapter was ready (resident, or prepared on the host), alone."""


class _Latencies:
    """Running latency aggregates of one series (not thread-safe: SwapMetrics holds its lock)."""

    def __init__(self, window: int) -> None:
        self.recent: deque[float] = deque(maxlen=window)
        self.count, self.total, self.max = 0, 0.0, 0.0
        self.bucket_counts = [0] * len(LATENCY_BUCKETS_S)

    def add(self, seconds: float) -> None:
        self.recent.append(seconds)
        self.count += 1
        self.total += seconds
        self.max = max(self.max, seconds)
        index = bisect.bisect_left(LATENCY_BUCKETS_S, seconds)
        if index < len(self.bucket_counts):
            self.bucket_counts[index] += 1

    def stats(self, kind: type[LatencyStats], **extra: int) -> LatencyStats:
        p50, p95, p99 = np.percentile(np.fromiter(self.recent, float), [50, 95, 99]).tolist()
        cumulative = tuple(zip(LATENCY_BUCKETS_S, itertools.accumulate(self.bucket_counts), strict=True))
        return kind(self.count, self.total, p50, p95, p99, self.max, cumulative, **extra)


class _Counters:
    """One group of named counts (by Tier, Move, outcome or adapter id): the one accumulate / snapshot path of every
    counter dict in a snapshot. Not thread-safe: SwapMetrics holds its lock."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def add(self, key: str, n: int = 1) -> None:
        self._counts[key] = self._counts.get(key, 0) + n

    def set(self, **values: int) -> None:
        """Overwrite some counts (gauges such as the disk tier's bytes)."""
        self._counts.update(values)

    def discard(self, key: str) -> None:
        self._counts.pop(key, None)

    def get(self, key: str) -> int:
        return self._counts.get(key, 0)

    def snapshot(self) -> dict[str, int]:
        """A plain copy keyed by plain strings (a Tier or Move key by its value)."""
        return {str(key): n for key, n in self._counts.items()}


@dataclass(frozen=True)
class AdapterResidency:
    """Where one registered adapter lives now, and when a batch last used it."""

    adapter_id: str
    tier: Literal["slot", "host", "disk"]  # highest tier holding it (a Tier value): a slot, prepared on the host, disk
    slot: int | None  # its device slot when tier == "slot"
    pinned: bool  # held by an in-flight batch or an operator pin
    last_used: float | None  # time.time() of its last acquire or release, None if never used


@dataclass(frozen=True)
class MetricsSnapshot:
    """A plain copy of the metrics at one moment."""

    moves: dict[str, MoveStats]  # by Move value: "hub_to_disk", "disk_to_host", "host_to_slot"
    hits: dict[str, int]  # by Tier value: "host", "slot"
    misses: dict[str, int]  # by Tier value
    evictions: dict[str, int]  # by Tier value
    stall: WaitStats | None = None  # per acquire (engine step): time blocked on moves; None until a batch acquired
    prefetch: dict[str, int] = field(default_factory=dict)  # "host_to_slot" loads done, "skipped_no_room" jobs
    rejections: dict[str, int] = field(default_factory=dict)  # by Tier value: newcomers admission did not keep
    requests: dict[str, int] = field(default_factory=dict)  # requests submitted per adapter id (registered ones)
    residency: dict[str, AdapterResidency] = field(default_factory=dict)  # by adapter id (from the manager)
    disk: dict[str, int] = field(default_factory=dict)  # bounded disk tier: used_bytes, capacity_bytes, evicted_bytes
    restore: dict[str, int] = field(default_factory=dict)  # durable registrations at start: restored, failed
    adapter_wait: WaitStats | None = None  # per request: submit -> its adapter ready; None until one was found ready

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SwapMetrics:
    """Thread-safe recorder of tier moves; `snapshot()` is what Python, the CLI and Prometheus read."""

    window: int = 10_000  # moves of each kind kept for percentiles
    history: int = 1_000  # most recent moves kept in order (any tier), for per-adapter histories
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _moves: dict[Move, _Latencies] = field(default_factory=dict, repr=False)
    _bytes: _Counters = field(default_factory=_Counters, repr=False)  # by Move
    _hits: _Counters = field(default_factory=_Counters, repr=False)  # by Tier
    _misses: _Counters = field(default_factory=_Counters, repr=False)  # by Tier
    _evictions: _Counters = field(default_factory=_Counters, repr=False)  # by Tier
    _rejections: _Counters = field(default_factory=_Counters, repr=False)  # by Tier
    _prefetch: _Counters = field(default_factory=_Counters, repr=False)  # by prefetch outcome
    _disk: _Counters = field(default_factory=_Counters, repr=False)  # disk tier gauges (set, not added)
    _restore: _Counters = field(default_factory=_Counters, repr=False)  # restored / failed
    _requests: _Counters = field(default_factory=_Counters, repr=False)  # by adapter id
    _recent: deque[AdapterMove] = field(init=False, repr=False)
    _stalls: _Latencies = field(init=False, repr=False)
    _adapter_waits: _Latencies = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.window <= 0 or self.history <= 0:
            raise ValueError(f"window ({self.window}) and history ({self.history}) must be positive")
        self._recent = deque(maxlen=self.history)
        self._stalls = _Latencies(self.window)
        self._adapter_waits = _Latencies(self.window)

    def record(self, move: Move, adapter_id: str, seconds: float, nbytes: int) -> AdapterMove:
        done = AdapterMove(move, adapter_id, seconds, nbytes, time.time())
        with self._lock:
            self._moves.setdefault(move, _Latencies(self.window)).add(seconds)
            self._bytes.add(move, nbytes)
            self._recent.append(done)
        return done

    def hit(self, tier: Tier) -> None:
        with self._lock:
            self._hits.add(tier)

    def miss(self, tier: Tier) -> None:
        with self._lock:
            self._misses.add(tier)

    def evicted(self, tier: Tier) -> None:
        with self._lock:
            self._evictions.add(tier)

    def rejected(self, tier: Tier) -> None:
        """Count a newcomer the tier's admission policy did not keep (served once, not cached)."""
        with self._lock:
            self._rejections.add(tier)

    def requested(self, adapter_id: str) -> None:
        """Count one request submitted for `adapter_id`."""
        with self._lock:
            self._requests.add(adapter_id)

    def forget(self, adapter_id: str) -> None:
        """The adapter was unregistered: drop its request count (keeps the per-adapter map bounded)."""
        with self._lock:
            self._requests.discard(adapter_id)

    def prefetched(self, outcome: str) -> None:
        """Count one prefetch job's outcome: ``host_to_slot`` (it loaded a slot) or ``skipped_no_room``."""
        with self._lock:
            self._prefetch.add(outcome)

    def disk_usage(self, used_bytes: int, capacity_bytes: int, evicted_bytes: int) -> None:
        """The bounded disk tier's bytes now (owned adapter repos in the HF cache) and bytes evicted since start."""
        with self._lock:
            self._disk.set(used_bytes=used_bytes, capacity_bytes=capacity_bytes, evicted_bytes=evicted_bytes)

    def restored(self, ok: bool) -> None:
        """Count one durable registration restored at start-up (``restored``) or not (``failed``)."""
        key = "restored" if ok else "failed"
        with self._lock:
            self._restore.add(key)

    def waited(self, seconds: float) -> None:
        """Record the stall of one batch: how long its `acquire` was blocked on moves (0.0 when all were resident)."""
        with self._lock:
            self._stalls.add(seconds)

    def adapter_waited(self, seconds: float) -> None:
        """Record one request's adapter wait: submit -> its adapter ready (resident, or prepared on the host)."""
        with self._lock:
            self._adapter_waits.add(seconds)

    def moves(self, adapter_id: str | None = None) -> list[AdapterMove]:
        """The most recent moves, oldest first, optionally of one adapter."""
        with self._lock:
            return [m for m in self._recent if adapter_id is None or m.adapter_id == adapter_id]

    def snapshot(self, residency: dict[str, AdapterResidency] | None = None) -> MetricsSnapshot:
        """A plain copy; `residency` (the manager's view of every adapter) is attached as given."""
        with self._lock:
            moves = {
                move.value: latencies.stats(MoveStats, total_bytes=self._bytes.get(move))
                for move, latencies in self._moves.items()
            }
            stall = self._stalls.stats(WaitStats) if self._stalls.count else None
            adapter_wait = self._adapter_waits.stats(WaitStats) if self._adapter_waits.count else None
            return MetricsSnapshot(
                moves,
                self._hits.snapshot(),
                self._misses.snapshot(),
                self._evictions.snapshot(),
                stall,
                self._prefetch.snapshot(),
                self._rejections.snapshot(),
                self._requests.snapshot(),
                dict(residency or {}),
                self._disk.snapshot(),
                self._restore.snapshot(),
                adapter_wait,
            )
