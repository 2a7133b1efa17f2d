"""The engine's KV blocks and prefix cache as Prometheus metrics (``adapter_manager_kv_*``, ``_prefix_*``), read
from one :meth:`runtime.engine.engine.Engine.kv_metrics` snapshot per scrape."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..engine.engine import Engine


class KVCacheCollector(Collector):
    """Blocks used / free / cached, the pool's bytes, prefix-cache hits and queries (tokens and requests), the hit
    rate (vLLM's ``gpu_prefix_cache_hit_rate``) and preemptions."""

    def __init__(self, engine: Engine, namespace: str = "adapter_manager") -> None:
        self.engine, self.namespace = engine, namespace

    def collect(self) -> Iterator[Metric]:
        m, ns = self.engine.kv_metrics(), self.namespace
        blocks = GaugeMetricFamily(f"{ns}_kv_blocks", "KV cache blocks by state", labels=["state"])
        for state, value in (("used", m.blocks_used), ("free", m.blocks_free), ("cached", m.blocks_cached)):
            blocks.add_metric([state], value)
        yield blocks
        yield GaugeMetricFamily(f"{ns}_kv_blocks_total", "KV cache blocks in the pool", value=m.blocks_total)
        yield GaugeMetricFamily(f"{ns}_kv_block_size_tokens", "Tokens per KV cache block", value=m.block_size)
        yield GaugeMetricFamily(f"{ns}_kv_cache_bytes", "Bytes of the KV block pool", value=m.cache_bytes)
        yield GaugeMetricFamily(f"{ns}_kv_usage_ratio", "Share of the KV blocks held by running sequences",
                                value=m.blocks_used / m.blocks_total)  # fmt: skip
        yield CounterMetricFamily(
            f"{ns}_kv_preemptions", "Running requests preempted for KV blocks (recomputed)", value=m.preemptions
        )
        for unit, queried, hit in (
            ("tokens", m.prefix_queried_tokens, m.prefix_hit_tokens),
            ("requests", m.prefix_queried_requests, m.prefix_hit_requests),
        ):
            yield CounterMetricFamily(f"{ns}_prefix_queries_{unit}", f"Prefix-cache lookups ({unit})", value=queried)
            yield CounterMetricFamily(f"{ns}_prefix_hits_{unit}", f"Prefix-cache hits ({unit})", value=hit)
        yield GaugeMetricFamily(
            f"{ns}_prefix_cache_hit_rate", "Cached share of the queried prompt tokens", value=m.prefix_hit_rate
        )
        yield CounterMetricFamily(
            f"{ns}_prefix_dropped_blocks", "Cached blocks dropped with their adapter's revision",
            value=m.prefix_dropped_blocks,
        )  # fmt: skip
