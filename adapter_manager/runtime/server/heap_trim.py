"""The C heap of a serving process hands its free pages back to the system every few seconds (glibc ``malloc_trim``).

glibc serves an allocation below its mmap threshold from an arena (one per thread, up to 8 per core). The threshold
is dynamic: freeing a mapped block raises it to that block's size (up to 32 MiB). A server under adapter churn frees
blocks of a few MB all the time (downloads' buffers, safetensors reads, a step's activations), so soon they all
come from the arenas, between small long-lived allocations of the same threads, and the arenas keep the free pages
they leave: the soak's RSS grew ~20-30 MiB a minute with in-use bytes flat, all of it returned by one
``malloc_trim(0)`` (docs/benchmarks.md, soak). Trimming while serving returns those pages and leaves the arenas'
layout, and so the steps' allocations, as they are; fixing the threshold instead (every block of 128 KiB or more
mapped on its own) also held RSS flat but cost ~20 % throughput on the soak's bursts.

On a C library without ``malloc_trim`` nothing runs.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

TRIM_INTERVAL_S = 10.0
"""Seconds between trims: at the soak's ~0.5 MiB/s, a few MiB kept between two."""


def malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim(pad)``, or None where the C library has none."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None
    trim.restype, trim.argtypes = ctypes.c_int, [ctypes.c_size_t]
    return trim


@dataclass
class HeapTrimmer:
    """A daemon thread calling ``malloc_trim(0)`` every `interval_s` until :meth:`stop`; counts its work."""

    interval_s: float = TRIM_INTERVAL_S  # seconds between trims
    trims: int = 0  # trims done
    released: int = 0  # trims that gave memory back
    seconds: float = 0.0  # time spent trimming
    longest_s: float = 0.0  # the longest trim
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")

    def start(self) -> HeapTrimmer:
        """Start trimming (nothing where the C library has no malloc_trim); returns self."""
        trim = malloc_trim()
        if trim is not None and self._thread is None:
            self._thread = threading.Thread(target=self._run, args=(trim,), name="heap-trim", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _run(self, trim: Callable[[int], int]) -> None:
        while not self._stop.wait(self.interval_s):
            began = time.perf_counter()
            gave_back = trim(0)
            took = time.perf_counter() - began
            self.trims += 1
            self.released += bool(gave_back)
            self.seconds += took
            self.longest_s = max(self.longest_s, took)
