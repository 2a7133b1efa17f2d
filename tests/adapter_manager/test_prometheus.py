"""The Prometheus collector: what a scrape of `manager.metrics()` looks like, read back with prometheus_client's own
text parser."""

from __future__ import annotations

import pytest

from adapter_manager import AdapterManager, AdapterManagerConfig, RowOptions, write_synthetic_adapter

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from adapter_manager.metrics import LATENCY_BUCKETS_S  # noqa: E402
from adapter_manager.prometheus import AdapterManagerCollector  # noqa: E402


@pytest.fixture
def manager(tmp_path, tiny_spec):
    manager = AdapterManager(
        tiny_spec, AdapterManagerConfig(max_slots=1, rows=RowOptions(max_rank=8), prefetch_workers=0)
    )
    for i, name in enumerate(("org/a", "org/b", "org/c")):
        manager.register(str(write_synthetic_adapter(tmp_path / f"ad{i}", tiny_spec, r=4, seed=i)), name)
    yield manager
    manager.close()


def scrape(manager: AdapterManager) -> dict:
    registry = prometheus_client.CollectorRegistry()
    registry.register(AdapterManagerCollector(manager))
    text = prometheus_client.generate_latest(registry).decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def samples(family, **labels) -> dict[str, float]:
    return {s.name: s.value for s in family.samples if all(s.labels.get(k) == v for k, v in labels.items())}


def test_scrape_matches_the_snapshot(manager):
    for name in ("org/a", "org/b", "org/a", "org/c"):  # one slot: every switch is a miss and an eviction
        manager.release(manager.acquire([name]))
    snapshot = manager.metrics()
    families = scrape(manager)

    moves = families["adapter_manager_move_seconds"]
    assert moves.type == "histogram"
    for move, stats in snapshot.moves.items():
        got = samples(moves, move=move)
        assert got["adapter_manager_move_seconds_count"] == stats.count
        assert got["adapter_manager_move_seconds_sum"] == pytest.approx(stats.total_seconds)
        buckets = [
            (s.labels["le"], s.value) for s in moves.samples if s.labels.get("move") == move and "le" in s.labels
        ]
        assert buckets[-1] == ("+Inf", stats.count)
        counts = [count for _, count in buckets]
        assert counts == sorted(counts) and len(buckets) == len(LATENCY_BUCKETS_S) + 1
        assert all(count == stats.count for le, count in buckets if le != "+Inf" and float(le) >= stats.max_s)
    assert (
        samples(families["adapter_manager_move_bytes"], move="host_to_slot")["adapter_manager_move_bytes_total"]
        == snapshot.moves["host_to_slot"].total_bytes
    )

    for name in ("hits", "misses", "evictions"):
        family = families[f"adapter_manager_{name}"]
        assert family.type == "counter"
        assert {s.labels["tier"]: s.value for s in family.samples} == getattr(snapshot, name)
    assert snapshot.evictions["slot"] == 3 and snapshot.misses["slot"] == 4

    wait = samples(families["adapter_manager_stall_seconds"])
    assert wait["adapter_manager_stall_seconds_count"] == snapshot.stall.count == 4
    assert families["adapter_manager_adapter_wait_seconds"].type == "histogram"  # no request waited yet: empty
    manager.swap_metrics.adapter_waited(0.02)
    wait = samples(scrape(manager)["adapter_manager_adapter_wait_seconds"])
    assert wait["adapter_manager_adapter_wait_seconds_count"] == 1
    assert wait["adapter_manager_adapter_wait_seconds_sum"] == pytest.approx(0.02)

    residency = {s.labels["tier"]: s.value for s in families["adapter_manager_adapters"].samples}
    assert residency == {"slot": 1, "host": 2, "disk": 0}
    variants = {s.labels["variant"]: s.value for s in families["adapter_manager_adapters_by_variant"].samples}
    assert variants == {"lora": 3, "dora": 0, "lora_bias": 0}
    gauge = families["adapter_manager_adapters_by_vocab_module"].samples
    vocab = {(s.labels["module"], s.labels["kind"]): s.value for s in gauge}
    assert set(vocab) == {(m, k) for m in ("embed_tokens", "lm_head") for k in ("lora", "tokens")}
    assert not any(vocab.values())
    assert samples(families["adapter_manager_slots"])["adapter_manager_slots"] == 1
    used = samples(families["adapter_manager_host_tier_used_bytes"])["adapter_manager_host_tier_used_bytes"]
    assert (
        0
        < used
        <= samples(families["adapter_manager_host_tier_capacity_bytes"])["adapter_manager_host_tier_capacity_bytes"]
    )


def test_labels_stay_low_cardinality(manager):
    manager.release(manager.acquire(["org/a"]))
    manager.pin("org/b")
    families = scrape(manager)
    assert samples(families["adapter_manager_slots_pinned"])["adapter_manager_slots_pinned"] == 1
    label_names = {name for f in families.values() for s in f.samples for name in s.labels}
    assert label_names <= {"tier", "move", "le", "adapter", "variant", "module", "kind"}  # three, two, two values
    assert not any("org/" in str(s.labels) for f in families.values() for s in f.samples)  # no requests noted yet


def test_per_adapter_requests_are_the_top_k_and_the_rest_summed(manager):
    counts = {f"org/x{i}": 1 + i % 7 for i in range(40)} | {"org/a": 50, "org/b": 30}
    for adapter_id, count in counts.items():
        for _ in range(count):
            manager.note_request(adapter_id)
    manager.note_request(None)  # the base model is not an adapter
    assert manager.metrics().to_dict()["requests"] == counts  # the JSON snapshot has every adapter
    registry = prometheus_client.CollectorRegistry()
    registry.register(AdapterManagerCollector(manager, top_adapters=3))
    text = prometheus_client.generate_latest(registry).decode()
    family = {f.name: f for f in text_string_to_metric_families(text)}["adapter_manager_adapter_requests"]
    got = {s.labels["adapter"]: s.value for s in family.samples}
    assert got == {"org/a": 50, "org/b": 30, "org/x13": 7, "other": sum(counts.values()) - 87}
    manager.unregister("org/a")
    assert "org/a" not in manager.metrics().requests
    with pytest.raises(ValueError, match="top_adapters must be >= 0, got -1"):
        AdapterManagerCollector(manager, top_adapters=-1)


def test_an_idle_manager_scrapes_cleanly(tiny_spec):
    with AdapterManager(
        tiny_spec, AdapterManagerConfig(max_slots=2, rows=RowOptions(max_rank=8), prefetch_workers=0)
    ) as manager:
        families = scrape(manager)
    assert families["adapter_manager_move_seconds"].samples == []
    assert samples(families["adapter_manager_slots_pinned"])["adapter_manager_slots_pinned"] == 0
