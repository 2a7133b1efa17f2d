"""Several replicas' metric snapshots (`MetricsSnapshot.to_dict()`) as one, in the same shape."""

from __future__ import annotations

from typing import Any

_QUANTILES = {"p50_s": 0.50, "p95_s": 0.95, "p99_s": 0.99}


def merge_snapshots(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts, totals and histogram buckets add up; max is the largest; p50 / p95 / p99 are read off the merged
    cumulative buckets (the upper bound of the bucket holding the quantile, capped by max)."""
    out: dict[str, Any] = {"moves": {}, "hits": {}, "misses": {}, "evictions": {}}
    for snapshot in snapshots:
        for move, stats in snapshot["moves"].items():
            out["moves"][move] = _add_latency(out["moves"].get(move), stats, ("total_bytes",))
        for key in ("hits", "misses", "evictions"):
            for tier, count in snapshot[key].items():
                out[key][tier] = out[key].get(tier, 0) + count
        if snapshot.get("stall"):
            out["stall"] = _add_latency(out.get("stall"), snapshot["stall"], ())
    for stats in [*out["moves"].values(), *([out["stall"]] if out.get("stall") else [])]:
        for key, q in _QUANTILES.items():
            stats[key] = _quantile(stats, q)
    out.setdefault("stall", None)
    out["hit_rates"] = {
        tier: out["hits"].get(tier, 0) / total
        for tier in sorted(set(out["hits"]) | set(out["misses"]))
        if (total := out["hits"].get(tier, 0) + out["misses"].get(tier, 0))
    }
    return out


def _add_latency(into: dict[str, Any] | None, stats: dict[str, Any], extra: tuple[str, ...]) -> dict[str, Any]:
    if into is None:
        return {**stats, "buckets": [list(b) for b in stats["buckets"]]}
    for key in ("count", "total_seconds", *extra):
        into[key] += stats[key]
    into["max_s"] = max(into["max_s"], stats["max_s"])
    for bucket, (_, count) in zip(into["buckets"], stats["buckets"], strict=True):
        bucket[1] += count
    return into


def _quantile(stats: dict[str, Any], q: float) -> float:
    target = q * stats["count"]
    for bound, cumulative in stats["buckets"]:
        if cumulative >= target:
            return min(bound, stats["max_s"])
    return stats["max_s"]
