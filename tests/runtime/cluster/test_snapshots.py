"""Replicas' metric snapshots merged into one of the same shape (what the cluster's /v1/metrics/swaps answers)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve", reason="the cluster extra (ray[serve]) is not installed")

from adapter_manager import Move, SwapMetrics, Tier  # noqa: E402
from adapter_manager.runtime.cluster.snapshots import merge_snapshots  # noqa: E402


def _snapshot(latencies: list[float], hits: int, misses: int) -> dict:
    metrics = SwapMetrics()
    for seconds in latencies:
        metrics.record(Move.HOST_TO_SLOT, "a", seconds, 100)
    for _ in range(hits):
        metrics.hit(Tier.SLOT)
    for _ in range(misses):
        metrics.miss(Tier.SLOT)
    return metrics.snapshot({}).to_dict()


def test_counts_add_and_quantiles_come_from_the_merged_histogram():
    one, two = _snapshot([0.001] * 9, hits=3, misses=1), _snapshot([0.2], hits=1, misses=3)
    merged = merge_snapshots([one, two])
    move = merged["moves"]["host_to_slot"]
    assert (move["count"], move["total_bytes"], move["max_s"]) == (10, 1000, 0.2)
    assert move["total_seconds"] == pytest.approx(0.209)
    assert move["p50_s"] == 0.001  # the bucket holding the 5th of 10 samples (upper bound 1 ms)
    assert move["p99_s"] == 0.2  # capped by max
    assert merged["hits"] == {"slot": 4} and merged["misses"] == {"slot": 4}
    assert merged["hit_rates"] == {"slot": 0.5}
    assert one["moves"]["host_to_slot"]["count"] == 9  # inputs untouched
    assert merge_snapshots([])["moves"] == {}
