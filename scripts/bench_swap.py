#!/usr/bin/env python3
"""Host -> slot swap time vs one `copy_` of the same bytes, for rank 8/16/64 adapters on the bench base.

Bench base: hidden 1024, intermediate 2816, 8 layers, every projection targeted. For each rank r a pool of
--slots adapters at max_rank r; side by side in one run, interleaved, medians over --repeats: (a) `SlotPool.load` of a
prepared adapter (its [r, width] block copied into its row range: one contiguous copy), (b) a single `copy_` of a flat
host buffer of the same byte count into one of --slots preallocated device buffers (rotating, as the slots do). Floor:
(b), the one copy the bytes need. Prints a table and writes out/bench_swap.json.
With --trace: 1000 adapters with Zipf(1) popularity on 8 slots, no model: each step acquires the slots of the next
--batch queued requests, "runs" for --step-ms, releases them; each host -> slot load takes --load-ms (simulated).
Hit rate and stall (p50/p99/max), without and with the prefetcher fed the waiting queue.
Usage: .venv/bin/python -m scripts.bench_swap [--repeats 15] [--ranks 8 16 64] [--device cpu] [--trace]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from adapter_manager import (
    AdapterRegistry,
    BaseModelSpec,
    RegistryConfig,
    RowOptions,
    SwapMetrics,
    write_synthetic_adapter,
)
from adapter_manager.policy.prefetch import PrefetchConfig, Prefetcher
from adapter_manager.tiers.allocator import SlotAllocator
from adapter_manager.tiers.prepare import ModuleWeights, PreparedAdapter
from adapter_manager.tiers.row_layout import RowLayout
from adapter_manager.tiers.slot_pool import SlotPool, SlotPoolConfig
from scripts.harness import write_json


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xla":
        import torch_xla
        import torch_xla.core.xla_model as xm

        torch_xla.sync()
        xm.wait_device_ops()


def bench_rank(spec: BaseModelSpec, rank: int, slots: int, repeats: int, device: torch.device, root: Path) -> dict:
    folder = write_synthetic_adapter(root / f"r{rank}", spec, r=rank, lora_alpha=2 * rank)
    config = RegistryConfig(rows=RowOptions(max_rank=rank), host_cache_bytes=1 << 31, pin_memory=device.type == "cuda")
    registry = AdapterRegistry(spec, config)
    registry.register(str(folder))
    prepared = registry.prepared(folder.name)
    pool = SlotPool(spec, SlotPoolConfig(max_slots=slots, rows=RowOptions(max_rank=rank), device=device))
    source = torch.empty(prepared.storage.numel(), dtype=prepared.dtype, pin_memory=device.type == "cuda")
    source.copy_(prepared.storage.view(-1))
    target = torch.empty((slots, source.numel()), dtype=source.dtype, device=device)  # rotates like the slots
    loads, copies = [], []
    for i in range(repeats + 1):  # the first round warms up both
        slot = i % slots
        _sync(device)
        start = time.perf_counter()
        pool.load(slot * pool.units_for(rank), prepared)
        load_s = time.perf_counter() - start
        start = time.perf_counter()
        target[slot].copy_(source, non_blocking=device.type == "cuda")
        _sync(device)
        copy_s = time.perf_counter() - start
        if i:
            loads.append(load_s)
            copies.append(copy_s)
    first = next(iter(pool.stacks))
    assert torch.equal(pool.stacks[first].a[:rank].cpu(), prepared.modules[first].a)
    load, copy = statistics.median(loads), statistics.median(copies)
    return {
        "rank": rank,
        "bytes": prepared.nbytes,
        "slot_load_s": load,
        "single_copy_s": copy,
        "ratio": load / copy,
        "load_gb_s": prepared.nbytes / load / 1e9,
        "copy_gb_s": prepared.nbytes / copy / 1e9,
    }


def _tiny_prepared(spec: BaseModelSpec, adapter_id: str, rank: int) -> PreparedAdapter:
    key, layout = spec.module_keys()[0], RowLayout.of(spec)
    storage = torch.ones(rank, layout.width)
    weights = ModuleWeights(layout.a_view(storage, key), layout.bt_view(storage, key), rank)
    return PreparedAdapter(adapter_id, "sim", {key: weights}, storage)


def trace(args: argparse.Namespace, prefetch: bool) -> dict:
    spec, rank = BaseModelSpec("trace", 8, 8, 1, 1, 1, 8), 2
    ids = [f"adapter-{i}" for i in range(args.adapters)]
    prepared = {a: _tiny_prepared(spec, a, rank) for a in ids}

    class SimulatedPool(SlotPool):
        def load(self, slot: int, adapter: PreparedAdapter) -> None:
            time.sleep(args.load_ms / 1e3)  # a host -> slot move of a real adapter on the serving device
            super().load(slot, adapter)

    fetch = prepared.__getitem__  # host-tier hits: prepared weights are in host memory

    weights = torch.tensor([1.0 / (i + 1) for i in range(args.adapters)])  # Zipf(alpha=1)
    generator = torch.Generator().manual_seed(0)
    queue = [ids[i] for i in torch.multinomial(weights, args.steps * args.batch, True, generator=generator)]
    metrics = SwapMetrics()
    pool = SimulatedPool(spec, SlotPoolConfig(max_slots=8, rows=RowOptions(max_rank=rank)))
    allocator = SlotAllocator(pool, fetch, lambda adapter_id: rank, metrics)
    prefetcher = Prefetcher(lambda a, *_: fetch(a) is not None, allocator, PrefetchConfig(workers=2, depth=16))
    try:
        for step in range(args.steps):
            batch = queue[step * args.batch : (step + 1) * args.batch]
            lease = allocator.acquire(batch)
            if prefetch:
                prefetcher.prefetch(queue[(step + 1) * args.batch :][:64])
            time.sleep(args.step_ms / 1e3)
            allocator.release(lease)
    finally:
        prefetcher.close()
    snapshot = metrics.snapshot()
    hits, misses = snapshot.hits.get("slot", 0), snapshot.misses.get("slot", 0)
    wait = snapshot.stall
    return {
        "prefetch": prefetch,
        "slot_hit_rate": hits / (hits + misses),
        "slot_loads": snapshot.moves["host_to_slot"].count,
        "stall_p50_s": wait.p50_s,
        "stall_p99_s": wait.p99_s,
        "exposed_max_s": wait.max_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path("out/bench_swap.json"))
    parser.add_argument("--trace", action="store_true", help="run the Zipf trace instead")
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--load-ms", type=float, default=2.0)
    args = parser.parse_args()
    if args.trace:
        rows = [trace(args, prefetch=False), trace(args, prefetch=True)]
        print(f"Zipf(1) trace: {args.adapters} adapters, 8 slots, {args.steps} steps of {args.batch} requests")
        for row in rows:
            print(
                f"prefetch={row['prefetch']!s:5} slot hit rate {row['slot_hit_rate']:.3f}, {row['slot_loads']} loads, "
                f"stall p50 {row['stall_p50_s'] * 1e3:.2f}ms p99 {row['stall_p99_s'] * 1e3:.2f}ms "
                f"max {row['exposed_max_s'] * 1e3:.2f}ms"
            )
        ratio = rows[1]["stall_p99_s"] / max(rows[0]["stall_p99_s"], 1e-12)
        print(f"exposed p99 with / without prefetch: {ratio:.3f}")
        out = args.out.with_name("bench_swap_trace.json")
        write_json(out, {"args": vars(args) | {"out": str(out)}, "results": rows, "p99_ratio": ratio}, indent=None)
        return
    spec, device = BaseModelSpec.bench(), torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [bench_rank(spec, r, args.slots, args.repeats, device, Path(tmp)) for r in args.ranks]
    print(f"host -> slot on {device}, bench base, {args.slots} slots, {args.repeats} repeats, medians")
    header = ("rank", "bytes", "slot load", "one copy_", "ratio", "GB/s load", "GB/s copy")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (4, 11, 10, 10, 6, 9, 9), strict=True)))
    for row in rows:
        print(
            f"{row['rank']:4} {row['bytes']:11,} {row['slot_load_s'] * 1e3:8.2f}ms {row['single_copy_s'] * 1e3:8.2f}ms "
            f"{row['ratio']:5.2f}x {row['load_gb_s']:9.2f} {row['copy_gb_s']:9.2f}"
        )
    payload = {"device": str(device), "slots": args.slots, "repeats": args.repeats, "results": rows}
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
