"""A replica's pool metrics in Ray's Prometheus export (beside Serve's own `ray_serve_multiplexed_*` metrics):
`ray.serve.metrics` tags each series with its application, deployment and replica, and Ray's metrics agent serves
them all on one port per node (`ray.init(_metrics_export_port=...)`; names get Ray's `ray_` prefix)."""

from __future__ import annotations

from typing import Any

from ray.serve import metrics

_QUANTILES = ("p50_s", "p95_s", "p99_s", "max_s")


class ReplicaGauges:
    """Gauges set from each periodic snapshot (counts are totals since the replica started)."""

    def __init__(self) -> None:
        self.move_seconds = metrics.Gauge(
            "adapter_manager_move_seconds", "Tier move latency by move and quantile", tag_keys=("move", "quantile")
        )
        self.moves = metrics.Gauge("adapter_manager_moves", "Tier moves done since start", tag_keys=("move",))
        self.move_bytes = metrics.Gauge("adapter_manager_move_bytes", "Bytes moved since start", tag_keys=("move",))
        self.hits = metrics.Gauge("adapter_manager_hits", "Hits by tier since start", tag_keys=("tier",))
        self.misses = metrics.Gauge("adapter_manager_misses", "Misses by tier since start", tag_keys=("tier",))
        self.evictions = metrics.Gauge("adapter_manager_evictions", "Evictions by tier since start", tag_keys=("tier",))
        self.loaded = metrics.Gauge("adapter_manager_multiplexed_adapters", "Adapters Serve holds loaded (pinned)")
        self.free_units = metrics.Gauge("adapter_manager_free_units", "Pool units holding no adapter")
        self.stall = metrics.Gauge(
            "adapter_manager_stall_seconds", "Engine stall on moves by quantile", tag_keys=("quantile",)
        )

    def update(self, snapshot: dict[str, Any]) -> None:
        stats = snapshot["metrics"]
        for move, s in stats["moves"].items():
            for q in _QUANTILES:
                self.move_seconds.set(s[q], tags={"move": move, "quantile": q.removesuffix("_s")})
            self.moves.set(s["count"], tags={"move": move})
            self.move_bytes.set(s["total_bytes"], tags={"move": move})
        for gauge, key in ((self.hits, "hits"), (self.misses, "misses"), (self.evictions, "evictions")):
            for tier, count in stats[key].items():
                gauge.set(count, tags={"tier": tier})
        wait = stats.get("stall")
        if wait:
            for q in _QUANTILES:
                self.stall.set(wait[q], tags={"quantile": q.removesuffix("_s")})
        self.loaded.set(len(snapshot["loaded"]))
        self.free_units.set(snapshot["free_units"])
