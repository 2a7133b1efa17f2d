"""Host -> slot swap time with one process per tensor-parallel shard (CPU), beside the same swaps unsharded.

    .venv/bin/python -m scripts.bench_swap_tp [--shape tiny|bench] [--tp 2] [--swaps 60] [--fully-sharded-loras]

Six rank-8 adapters (every projection) cycle through 2 slots of an engine that runs no step, so every acquire is a
host -> slot load: at TP 1 one copy of the adapter's block into the pool; at TP N rank 0's one copy of the sectioned
block into the pool's rows, which live in shared memory that every shard maps (each reads its own section), before
the slot is published. Medians over ``--swaps`` (the first 6 dropped). Floors printed beside: one ``copy_`` of the
whole block (TP 1's bytes; at TP N the sections together are about as many bytes) and of one section.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

ADAPTERS, RANK = 6, 8


def _median_ms(fn, repeats: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[ADAPTERS:])


def main() -> None:
    from adapter_manager import write_synthetic_adapter
    from adapter_manager.runtime.model.checkpoint import write_random_checkpoint
    from adapter_manager.runtime.model.config import LlamaConfig
    from scripts.harness.results import cpu_model, write_json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("tiny", "bench"), default="bench")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--swaps", type=int, default=60)
    parser.add_argument("--fully-sharded-loras", action="store_true")
    parser.add_argument("--out", default="out/bench_swap_tp.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-swap-tp-"))
    config = getattr(LlamaConfig, args.shape)()
    write_random_checkpoint(config, work / "base")
    spec = config.to_spec(args.shape)
    for i in range(ADAPTERS):
        write_synthetic_adapter(work / f"a{i}", spec, r=RANK, seed=i)
    try:
        results = {tp: _measure(work, spec, tp, args) for tp in (1, args.tp)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    one, many = results[1], results[args.tp]
    print(f"CPU: {cpu_model()}; {args.shape} shapes, rank {RANK}, {ADAPTERS} adapters through 2 slots, no step running")
    print(f"TP 1: host -> slot p50 {one['swap_ms']:.3f} ms | floor: one copy_ of the block "
          f"({one['block_bytes'] / 2**20:.2f} MiB) {one['copy_ms']['block']:.3f} ms")  # fmt: skip
    print(f"TP {args.tp}: host -> slot p50 {many['swap_ms']:.3f} ms = {many['swap_ms'] / one['swap_ms']:.2f}x TP 1, "
          f"{many['swap_ms'] / one['copy_ms']['block']:.2f}x one copy_ of the block | a section "
          f"{many['section_bytes'] / 2**20:.2f} MiB, one copy_ of it {many['copy_ms']['section']:.3f} ms (every shard "
          f"maps the pool's shared rows: no copy per shard)")  # fmt: skip
    write_json(args.out, {"shape": args.shape, "tp": args.tp, "fully_sharded_loras": args.fully_sharded_loras,
                          "results": {str(k): v for k, v in results.items()}})  # fmt: skip


def _measure(work: Path, spec, tp: int, args: argparse.Namespace) -> dict:  # noqa: ANN001
    from adapter_manager import AdapterManager, AdapterManagerConfig, RowOptions, TensorParallel
    from adapter_manager.runtime.engine.engine import Engine, EngineConfig
    from adapter_manager.runtime.engine.shard_workers import ShardLaunch, start_shard_workers
    from adapter_manager.runtime.model.checkpoint import load_model

    tensor_parallel = TensorParallel(tp, fully_sharded_loras=args.fully_sharded_loras and tp > 1)
    workers = start_shard_workers(ShardLaunch(work / "base", tensor_parallel)) if tp > 1 else None
    model = workers.load_model() if workers else load_model(work / "base", torch.float32, torch.device("cpu"))
    manager = AdapterManager(spec, AdapterManagerConfig(
        max_slots=2, rows=RowOptions(max_rank=RANK, tensor_parallel=tensor_parallel), prefetch_workers=0,
    ))  # fmt: skip
    try:
        for i in range(ADAPTERS):
            manager.register(str(work / f"a{i}"), adapter_id=f"a{i}")
        Engine(model, manager, EngineConfig(max_batch=2, max_seq_len=32))  # the shards map the pool's rows
        turn = iter(range(10**9))
        swap = _median_ms(lambda: manager.release(manager.acquire([f"a{next(turn) % ADAPTERS}"])), args.swaps)
        block = manager.registry.prepared("a0").storage
        section = block[:, 0] if block.dim() == 3 else block
        floors = {}
        for name, source in (("block", block), ("section", section)):
            target = torch.empty_like(source.contiguous())
            floors[name] = _median_ms(lambda s=source, t=target: t.copy_(s), args.swaps)
        nbytes = {"block_bytes": block.numel() * block.element_size(), "section_bytes": section.nbytes}
        return {"swap_ms": swap, **nbytes, "copy_ms": floors}
    finally:
        manager.close()
        if workers:
            workers.close()


if __name__ == "__main__":
    main()
