"""Prometheus export of the manager's metrics: a prometheus_client custom collector reading `manager.metrics()` at
scrape time.

Labels stay low-cardinality and use the metrics module's vocabulary: ``move`` (``hub_to_disk``, ``disk_to_host``,
``host_to_slot``) and ``tier`` (``hub``, ``disk``, ``host``, ``slot``). The one per-adapter series, requests, is
bounded: the `top_adapters` most requested adapters by name, every other adapter summed under ``adapter="other"``
(so 1000 adapters make at most K + 1 series; the full per-adapter counts are in the JSON snapshot). Latencies are
histograms in seconds (`metrics.LATENCY_BUCKETS_S`)::

    adapter_manager_move_seconds_bucket{move="host_to_slot",le="0.01"}  host -> slot copies that took <= 10 ms
    adapter_manager_move_seconds_count{move="host_to_slot"}             every move since start
    adapter_manager_move_seconds_sum{move="host_to_slot"}               their total seconds
    adapter_manager_move_bytes_total{move=...}                          bytes moved
    adapter_manager_{hits,misses,evictions}_total{tier="slot"|"host"}
    adapter_manager_stall_seconds_bucket{le=...} (+ _count, _sum)        engine steps blocked on moves (target 0)
    adapter_manager_adapter_wait_seconds_bucket{le=...} (+ _count, _sum) each request: submit -> its adapter ready
    adapter_manager_adapters{tier="slot"|"host"|"disk"}                 registered adapters by highest tier
    adapter_manager_adapter_requests{adapter="org/a"|...|"other"}      requests so far (top K by name, the rest summed)
    adapter_manager_admission_rejections_total{tier="host"}             newcomers the host tier served but did not keep
    adapter_manager_slots, adapter_manager_slots_pinned, adapter_manager_host_tier_{used,capacity}_bytes
    adapter_manager_disk_tier_{used,capacity}_bytes, _disk_tier_evicted_bytes_total  (with disk_cache_bytes)
    adapter_manager_restored_adapters_total, _restore_failures_total, _adapters_unrestorable (durable registrations)

The requests series is a gauge, not a counter: an adapter can enter or leave the top K, moving its count into or out
of "other", so no series is guaranteed monotonic.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from .base_model import VOCAB_MODULES
from .manager import AdapterManager
from .metrics import LatencyStats, Tier
from .sources.peft_format import Variant

_RESIDENCY = (Tier.SLOT.value, Tier.HOST.value, Tier.DISK.value)


class AdapterManagerCollector(Collector):
    """Register it on a `CollectorRegistry` (one per server; not the global default registry)."""

    def __init__(self, manager: AdapterManager, namespace: str = "adapter_manager", top_adapters: int = 10) -> None:
        if top_adapters < 0:
            raise ValueError(f"top_adapters must be >= 0, got {top_adapters}")
        self._manager = manager
        self._ns = namespace
        self._top = top_adapters

    def collect(self) -> Iterator[Metric]:
        manager, ns = self._manager, self._ns
        snapshot = manager.metrics()

        moves = HistogramMetricFamily(
            f"{ns}_move_seconds",
            "Latency of moves between tiers (<from>_to_<to>)",
            labels=["move"],
        )
        moved = CounterMetricFamily(f"{ns}_move_bytes", "Bytes moved between tiers", labels=["move"])
        for move, stats in sorted(snapshot.moves.items()):
            moves.add_metric([move], _buckets(stats), stats.total_seconds)
            moved.add_metric([move], stats.total_bytes)
        yield moves
        yield moved

        for name, counts, doc in (
            ("hits", snapshot.hits, "Adapter lookups served by the tier"),
            ("misses", snapshot.misses, "Adapter lookups the tier could not serve"),
            ("evictions", snapshot.evictions, "Adapters evicted from the tier"),
            ("admission_rejections", snapshot.rejections, "Newcomers served but not kept by the tier's admission"),
        ):
            family = CounterMetricFamily(f"{ns}_{name}", doc, labels=["tier"])
            for tier, count in sorted(counts.items()):
                family.add_metric([tier], count)
            yield family

        for name, stats, doc in (
            ("stall", snapshot.stall, "Time engine steps (everyone in them) were blocked on adapter moves"),
            (
                "adapter_wait",
                snapshot.adapter_wait,
                "Time each request waited alone from submit until its adapter "
                "was ready (resident, or prepared on the host)",
            ),
        ):
            wait = HistogramMetricFamily(f"{ns}_{name}_seconds", doc)
            if stats is not None:
                wait.add_metric([], _buckets(stats), stats.total_seconds)
            yield wait

        requests = GaugeMetricFamily(
            f"{ns}_adapter_requests",
            f"Requests submitted per adapter: the {self._top} most requested by name, the rest summed as 'other'",
            labels=["adapter"],
        )
        ranked = sorted(snapshot.requests.items(), key=lambda item: (-item[1], item[0]))
        for adapter_id, count in ranked[: self._top]:
            requests.add_metric([adapter_id], count)
        requests.add_metric(["other"], sum(count for _, count in ranked[self._top :]))
        yield requests

        by_tier = dict.fromkeys(_RESIDENCY, 0)
        for residency in snapshot.residency.values():
            by_tier[residency.tier] += 1
        adapters = GaugeMetricFamily(f"{ns}_adapters", "Registered adapters by highest tier", labels=["tier"])
        for tier, count in by_tier.items():
            adapters.add_metric([tier], count)
        yield adapters
        doc = "Registered adapters by LoRA variant (lora, dora, lora_bias)"
        variants = GaugeMetricFamily(f"{ns}_adapters_by_variant", doc, labels=["variant"])
        by_variant = Counter(record.variant.value for record in manager.records())
        for variant in Variant:
            variants.add_metric([variant.value], by_variant[variant.value])
        yield variants
        doc = "Registered adapters adapting a vocabulary module (embed_tokens, lm_head) by LoRA or trainable tokens"
        vocab = GaugeMetricFamily(f"{ns}_adapters_by_vocab_module", doc, labels=["module", "kind"])
        by_vocab = Counter(pair for record in manager.records() for pair in record.vocab.items())
        for module in VOCAB_MODULES:
            for kind in ("lora", "tokens"):
                vocab.add_metric([module, kind], by_vocab[module, kind])
        yield vocab

        states = manager.allocator.states()
        yield GaugeMetricFamily(f"{ns}_slots", "Device adapter slots", value=manager.num_slots)
        yield GaugeMetricFamily(
            f"{ns}_slots_pinned",
            "Slots pinned by in-flight batches or operators",
            value=sum(1 for s in states if s.pins > 0 or s.manual),
        )
        host = manager.registry.host
        yield GaugeMetricFamily(f"{ns}_host_tier_used_bytes", "Bytes of prepared adapters on the host", host.used_bytes)
        yield GaugeMetricFamily(f"{ns}_host_tier_capacity_bytes", "Byte bound of the host tier", host.capacity_bytes)
        if snapshot.disk:
            for key in ("used_bytes", "capacity_bytes"):
                doc = f"Bounded disk tier: {key.replace('_', ' ')} of the manager's adapter repos in the HF cache"
                yield GaugeMetricFamily(f"{ns}_disk_tier_{key}", doc, snapshot.disk[key])
            yield CounterMetricFamily(
                f"{ns}_disk_tier_evicted_bytes", "Bytes evicted from the disk tier", snapshot.disk["evicted_bytes"]
            )
        restored, failed = snapshot.restore.get("restored", 0), snapshot.restore.get("failed", 0)
        yield CounterMetricFamily(f"{ns}_restored_adapters", "Durable registrations restored at start-up", restored)
        yield CounterMetricFamily(f"{ns}_restore_failures", "Durable registrations not restored at start-up", failed)
        yield GaugeMetricFamily(
            f"{ns}_adapters_unrestorable",
            "Durable registrations that could not be restored (listed by GET /v1/adapters)",
            len(manager.registry.unrestored()),
        )


def _buckets(stats: LatencyStats) -> list[tuple[str, int]]:
    return [(repr(bound), count) for bound, count in stats.buckets] + [("+Inf", stats.count)]
