#!/usr/bin/env python3
"""Do background workers slow the engine's parallel torch ops? (OpenMP oversubscription, CPU)

The main thread times a fixed piece of engine work — the bench model's seven projections of one layer at M = 8
rows as ``W @ x.T`` (a form that runs parallel regions on every core), plus a SiLU over an intermediate-sized
activation, repeated — in three set-ups measured interleaved in one run (medians over --repeats):
  none       no background threads;
  plain      2 idle worker threads of a plain ThreadPoolExecutor that each ran one parallel slot-sized ``copy_``
             (each keeps an OpenMP team of its own alive);
  workers    2 idle workers of `adapter_manager.background_executor` that ran the same copies on one intra-op thread.
Floor: "none". Target: "workers" / "none" <= 1.0 (noise aside). Prints a table and writes out/bench_threads.json.

  .venv/bin/python -m scripts.probes.threads [--repeats 15] [--iterations 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from adapter_manager import BaseModelSpec, background_executor
from adapter_manager.base_model import PROJECTIONS
from scripts.harness import write_json


def engine_work(weights: list[torch.Tensor], x: torch.Tensor, iterations: int) -> float:
    start = time.perf_counter()
    for _ in range(iterations):
        for w in weights:
            torch.nn.functional.silu(torch.mm(w, x[:, : w.shape[1]].t()))
    return time.perf_counter() - start


def warm(pool: ThreadPoolExecutor, workers: int) -> None:
    """Each worker runs one parallel copy (a rank-16 adapter's worth of bytes), then idles."""

    def copy() -> None:
        source = torch.ones(9_306_112 // 4)
        torch.empty_like(source).copy_(source)
        time.sleep(0.05)  # keep the worker busy so the next task lands on another one

    for future in [pool.submit(copy) for _ in range(workers)]:
        future.result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("out/bench_threads.json"))
    args = parser.parse_args()
    spec = BaseModelSpec.bench()
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(spec.projection_shape(p)[::-1], generator=gen) for p in PROJECTIONS]  # [out, in]
    x = torch.randn(8, max(w.shape[1] for w in weights), generator=gen)
    plain = ThreadPoolExecutor(2, thread_name_prefix="plain")
    workers = background_executor(2, "bench")
    warm(plain, 2)
    warm(workers, 2)
    times: dict[str, list[float]] = {"none": [], "plain": [], "workers": []}
    engine_work(weights, x, args.iterations)  # warm-up
    try:
        for _ in range(args.repeats):
            times["none"].append(engine_work(weights, x, args.iterations))
            warm(plain, 2)  # the plain pool's threads have just run parallel copies
            times["plain"].append(engine_work(weights, x, args.iterations))
            warm(workers, 2)
            times["workers"].append(engine_work(weights, x, args.iterations))
    finally:
        plain.shutdown()
        workers.shutdown()
    med = {name: statistics.median(v) / args.iterations * 1e3 for name, v in times.items()}
    print(f"main-thread engine work: 7 bench projections at M = 8, {torch.get_num_threads()} intra-op threads, "
          f"medians of {args.repeats}")  # fmt: skip
    for name in times:
        print(f"{name:8} {med[name]:8.2f} ms per layer   {med[name] / med['none']:5.2f}x none")
    print("target: workers / none <= 1.0 (noise aside)")
    write_json(args.out, {"ms_per_iteration": med, "repeats": args.repeats})


if __name__ == "__main__":
    main()
