"""How the benchmarks time closures: medians of repeats, interleaved so that contention and drift on a shared machine
hit every variant alike."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median ms of ``repeats`` calls of ``fn`` alone, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def samples_ms(fns: Sequence[Callable[[], object]], repeats: int) -> list[list[float]]:
    """Interleaved repeats of each fn in a fixed order (after one untimed call each: warm-up, compiles); per fn its
    times in ms."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[i].append((time.perf_counter() - start) * 1e3)
    return times


def medians_ms(fns: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """Per fn the median in ms of its :func:`samples_ms`."""
    return [statistics.median(t) for t in samples_ms(fns, repeats)]


def interleaved_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms of each closure, every round in a fresh (seeded) random order, so contention, drift and the closure
    run just before (a read pass over the weights flushes the caches the next step would find warm) hit all alike:
    a rotation keeps each closure's predecessor fixed and biased the first config (base) by 4-10 %."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {key: [] for key in fns}
    keys, order = list(fns), random.Random(0)
    for _ in range(repeats):
        for key in order.sample(keys, len(keys)):
            start = time.perf_counter()
            fns[key]()
            times[key].append(time.perf_counter() - start)
    return {key: 1e3 * statistics.median(ts) for key, ts in times.items()}
