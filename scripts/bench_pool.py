#!/usr/bin/env python3
"""How many adapters a byte-budgeted row pool holds at once, packed by rank vs padded to max rank.

Bench base (hidden 1024, intermediate 2816, 8 layers, every projection), fp32, a --budget-gib pool, max rank 64;
a population of --adapters adapters with ranks 8/16/32/64 at 40/30/20/10 % (seeded). A Zipf(1) request trace runs
through the real allocator and slot pool (each request acquires its adapter, loading it by one copy and evicting
the LRU ones when it does not fit, then releases it). Reported: adapters resident once the pool is full (median
and min over the trace after the first eviction, so fragmentation is counted), against the floor of the padded
design — the budget divided by one max-rank slot — and the ideal packing (the budget divided by the population's
mean adapter size). Prints a table and writes out/bench_pool.json.

  .venv/bin/python -m scripts.bench_pool [--budget-gib 1] [--adapters 1000] [--requests 3000] [--seed 0]
      [--no-lora-vectors]

The pool keeps its vector rows (DoRA, LoRA bias: 1/(2·G) of its bytes) unless --no-lora-vectors; the padded floor
and the ideal count rows only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from adapter_manager import BaseModelSpec, RowOptions, SwapMetrics
from adapter_manager.tiers.allocator import SlotAllocator
from adapter_manager.tiers.prepare import PreparedAdapter
from adapter_manager.tiers.row_layout import RowLayout
from adapter_manager.tiers.slot_pool import SlotPool, SlotPoolConfig, bytes_needed
from scripts.harness import RANKS, SHARES, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gib", type=float, default=1.0)
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-lora-vectors", dest="lora_vectors", action="store_false", help="a pool without vector rows (DoRA, bias)"
    )
    parser.add_argument("--out", type=Path, default=Path("out/bench_pool.json"))
    args = parser.parse_args()
    spec, dtype, max_rank = BaseModelSpec.bench(), torch.float32, 64
    budget = int(args.budget_gib * (1 << 30))
    config = SlotPoolConfig(
        max_slots="auto",
        rows=RowOptions(max_rank=max_rank, lora_vectors=args.lora_vectors),
        dtype=dtype,
        memory_budget_bytes=budget,
    )
    pool = SlotPool(spec, config)
    width = RowLayout.of(spec).width
    gen = torch.Generator().manual_seed(args.seed)
    ranks = [RANKS[i] for i in torch.multinomial(torch.tensor(SHARES), args.adapters, True, generator=gen).tolist()]
    blocks = {r: torch.ones(r, width, dtype=dtype) for r in RANKS}  # one shared block per rank: no 10 GB of host data
    ids = [f"adapter-{i}" for i in range(args.adapters)]
    rank_of = dict(zip(ids, ranks, strict=True))

    def fetch(adapter_id: str) -> PreparedAdapter:
        return PreparedAdapter(adapter_id, "bench", {}, blocks[rank_of[adapter_id]])

    allocator = SlotAllocator(pool, fetch, rank_of.__getitem__, SwapMetrics())
    zipf = torch.tensor([1.0 / (i + 1) for i in range(args.adapters)])
    trace = torch.multinomial(zipf, args.requests, True, generator=gen).tolist()
    resident, started = [], time.perf_counter()
    for index in trace:
        allocator.release(allocator.acquire([ids[index]]))
        snapshot = allocator.metrics.snapshot()
        if snapshot.evictions.get("slot", 0):  # the pool is full: count what it holds
            resident.append(len(allocator.states()))
    seconds = time.perf_counter() - started
    padded = budget // bytes_needed(spec, max_rank, dtype)
    mean_bytes = statistics.fmean(bytes_needed(spec, r, dtype) for r in ranks)
    row = {
        "budget_bytes": budget,
        "pool_bytes": pool.nbytes,
        "adapters": args.adapters,
        "requests": args.requests,
        "seed": args.seed,
        "padded_to_max_rank": padded,
        "ideal_packing": int(budget // mean_bytes),
        "resident_median": statistics.median(resident) if resident else None,
        "resident_min": min(resident) if resident else None,
        "evictions": allocator.metrics.snapshot().evictions.get("slot", 0),
        "trace_seconds": seconds,
    }
    row["ratio_vs_padded"] = row["resident_median"] / padded if resident else None
    print(f"bench base, {args.budget_gib:g} GiB pool in fp32, max rank {max_rank}, ranks 8/16/32/64 at 40/30/20/10 %, "
          f"{args.adapters} adapters, Zipf(1) trace of {args.requests} requests (seed {args.seed})")  # fmt: skip
    print(f"{'padded to rank 64 (floor)':32}{padded:6d} adapters")
    print(f"{'ideal packing (budget / mean)':32}{row['ideal_packing']:6d} adapters")
    if resident:
        print(
            f"{'rank-packed row pool':32}{row['resident_median']:6.0f} adapters resident (median; min "
            f"{row['resident_min']}) = {row['ratio_vs_padded']:.2f}x padded   (target >= 3x)"
        )
    write_json(args.out, row)


if __name__ == "__main__":
    main()
