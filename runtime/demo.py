"""The demo: synthetic PEFT adapters on a bench-size base, served by the local hub, registered by hub ID."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from adapter_manager import (
    PROJECTIONS,
    AdapterRegistry,
    BaseModelSpec,
    HubConfig,
    RegistryConfig,
    Tier,
    write_synthetic_adapter,
)
from adapter_manager.local_hub import LocalHub

_MB = 1e6
_TARGETS = (PROJECTIONS, ("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj"))


def run_demo(num_adapters: int = 12, workdir: Path | None = None) -> int:
    """Write `num_adapters` adapters of mixed ranks and targets, register them through huggingface_hub from the
    local hub, show what each tier move took, then re-prepare evicted adapters from disk with no new download."""
    with tempfile.TemporaryDirectory(prefix="adapter-manager-demo-") as tmp:
        root = Path(workdir or tmp)
        spec = BaseModelSpec.bench()
        ranks = [8, 16, 32, 64]
        print(
            f"base model: {spec.name} (hidden {spec.hidden_size}, {spec.num_layers} layers, "
            f"intermediate {spec.intermediate_size}, {spec.num_kv_heads} KV heads)"
        )
        print(f"writing {num_adapters} synthetic PEFT adapters to {root / 'hub'} ...")
        for i in range(num_adapters):
            write_synthetic_adapter(
                root / "hub" / "demo" / f"adapter-{i:02d}",
                spec,
                r=ranks[i % 4],
                lora_alpha=2 * ranks[i % 4],
                target_modules=_TARGETS[i % len(_TARGETS)],
                seed=i,
            )
        one = spec.max_adapter_bytes(64, 2)
        config = RegistryConfig(max_rank=64, dtype=torch.bfloat16, host_cache_bytes=3 * one)
        with LocalHub(root / "hub") as hub:
            config.hub = HubConfig(endpoint=hub.endpoint, cache_dir=root / "hf-cache", progress_bars=False)
            registry = AdapterRegistry(spec, config)
            print(f"local hub at {hub.endpoint}; host tier {config.host_cache_bytes / _MB:.0f} MB (bf16, R=64)\n")
            print(
                f"{'adapter':18} {'rank':>4} {'modules':>7} {'sha':10} {'download':>9} {'MB':>6} "
                f"{'prepare':>8} {'host MB':>7}"
            )
            for i in range(num_adapters):
                result = registry.register(f"demo/adapter-{i:02d}")
                record = result.record
                print(
                    f"{record.adapter_id:18} {record.rank:4d} {len(record.modules):7d} {record.sha[:10]} "
                    f"{result.download_s * 1e3:7.1f}ms {result.downloaded_bytes / _MB:6.1f} "
                    f"{result.prepare_s * 1e3:6.1f}ms {record.nbytes / _MB:7.1f}"
                )
            again = registry.register("demo/adapter-00")
            print(f"\nregister demo/adapter-00 again: {again.action}, no download")
            downloads = sum(1 for r in hub.requests if r.method == "GET" and "/resolve/" in r.path)
            for record in registry.list():
                registry.prepared(record.adapter_id)
            after = sum(1 for r in hub.requests if r.method == "GET" and "/resolve/" in r.path)
            print(
                f"prepared every adapter again (host tier holds {len(registry.host.keys())}); "
                f"file downloads from the hub: {downloads} before, {after} after\n"
            )
        snapshot = registry.metrics.snapshot()
        print(f"{'tier move':14} {'count':>5} {'MB':>8} {'p50':>8} {'p95':>8} {'p99':>8} {'max':>8}")
        for name in (Tier.HUB.value, Tier.PREPARE.value):
            stats = snapshot.tiers[name]
            print(
                f"{name:14} {stats.count:5d} {stats.total_bytes / _MB:8.1f} "
                + " ".join(f"{v * 1e3:6.1f}ms" for v in (stats.p50_s, stats.p95_s, stats.p99_s, stats.max_s))
            )
        print(
            f"host tier: hits {snapshot.hits.get('host', 0)}, misses {snapshot.misses.get('host', 0)}, "
            f"evictions {snapshot.evictions.get('host', 0)}"
        )
    return 0
