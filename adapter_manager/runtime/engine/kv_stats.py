"""What the KV blocks and the prefix cache report: one snapshot for the JSON metrics, Prometheus and the CLI."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .kv_space import KVSpace


@dataclass(frozen=True)
class KVMetrics:
    """The KV block pool and the prefix cache at one moment (counters since the engine started)."""

    block_size: int  # tokens per block
    blocks_total: int
    blocks_used: int  # held by running sequences
    blocks_free: int  # nameless or cached-and-evictable
    blocks_cached: int  # named (the prefix cache's content), held or free
    cache_bytes: int  # bytes of the pool (every layer's K and V)
    running: int  # sequences holding blocks
    waiting: int
    prefix_queried_tokens: int  # prompt tokens of admitted requests that could have come from the cache
    prefix_hit_tokens: int  # of them, found cached (not computed)
    prefix_queried_requests: int
    prefix_hit_requests: int  # admitted with at least one cached block
    preemptions: int  # running requests preempted when blocks ran out (recomputed later, never failed)
    prefix_dropped_blocks: int  # cached blocks dropped with their adapter (unregistered or refreshed)

    @property
    def prefix_hit_rate(self) -> float:
        """Cached share of the queried prompt tokens (vLLM's ``gpu_prefix_cache_hit_rate``); 0 before any query."""
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    @property
    def prefix_request_hit_rate(self) -> float:
        return self.prefix_hit_requests / self.prefix_queried_requests if self.prefix_queried_requests else 0.0

    def to_dict(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "prefix_hit_rate": self.prefix_hit_rate,
            "prefix_request_hit_rate": self.prefix_request_hit_rate,
        }


def kv_metrics(kv: KVSpace, cache_bytes: int, running: int, waiting: int) -> KVMetrics:
    """The snapshot of ``kv`` (called under the engine's lock): the pool's :class:`BlockCounts` as ``blocks_*``, the
    :class:`PrefixStats` as ``prefix_*`` (preemptions as they are)."""
    counts, stats = dataclasses.asdict(kv.pool.counts()), dataclasses.asdict(kv.stats)
    return KVMetrics(
        block_size=kv.block_size,
        cache_bytes=cache_bytes,
        running=running,
        waiting=waiting,
        preemptions=stats.pop("preemptions"),
        **{f"blocks_{name}": value for name, value in counts.items()},
        **{f"prefix_{name}": value for name, value in stats.items()},
    )
