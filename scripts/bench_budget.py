"""Speculative moves on a budget: what prefetching costs when the tiers are smaller than the adapters in use.

A server-sized setting: 8 hub adapters (ranks 8-64, all seven projections, on the bench model) served
by the local hub; a host tier and a bounded disk tier each holding about 3 of them; popularity prefetch on
(`--popular`); `--requests` requests cycling through all 8 from `--clients` concurrent clients while the engine steps
in its own thread. Counted: hub downloads and preparations during serving, per request and per miss of the tier
they fill (the floor is 1: one move per miss), the prefetch outcomes (no room = nothing downloaded or prepared), and
the disk tier's bytes sampled every millisecond from the cache folder itself (partial downloads included) against
its bound; also the engine's stall.

    .venv/bin/python -m scripts.bench_budget [--requests 40] [--out out/bench_budget.json]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from huggingface_hub.utils import disable_progress_bars

from adapter_manager import AdapterManager, AdapterManagerConfig, HubConfig, LocalHub, RowOptions
from adapter_manager.runtime.engine.sampling import SamplingParams
from adapter_manager.runtime.model.checkpoint import load_model
from adapter_manager.runtime.model.config import LlamaConfig
from scripts.harness import build_engine, write_adapters, write_checkpoint, write_json

RANKS = (8, 16, 32, 64, 8, 16, 32, 64)


def _blob_bytes(cache: Path) -> int:
    total = 0
    for repo in cache.glob("models--bench--*"):
        blobs = repo / "blobs"
        for entry in os.scandir(blobs) if blobs.is_dir() else ():
            try:
                total += entry.stat().st_size
            except FileNotFoundError:
                pass
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--popular", type=int, default=4, help="prefetch_popular")
    parser.add_argument("--fits", type=float, default=3.0, help="adapters the host tier and the disk bound hold")
    parser.add_argument("--out", type=Path, default=Path("out/bench_budget.json"))
    args = parser.parse_args()
    disable_progress_bars()
    llama = LlamaConfig.bench()
    spec = llama.to_spec("bench")
    with tempfile.TemporaryDirectory(prefix="bench-budget-") as tmp:
        root = Path(tmp)
        model = load_model(write_checkpoint(root / "model", llama), dtype=torch.float32)
        ids = [f"bench/a{i}" for i in range(len(RANKS))]
        folders = write_adapters(root / "hub", spec, ids, RANKS)
        file_bytes = sorted(sum(f.stat().st_size for f in d.iterdir()) for d in folders)
        prepared = sorted(spec.max_adapter_bytes(r, 4) for r in RANKS)
        mean = len(RANKS) // 2
        disk_bound = int(args.fits * file_bytes[mean])
        host_bound = int(args.fits * prepared[mean])
        cache = root / "hf-cache"
        with LocalHub(root / "hub") as hub:
            config = AdapterManagerConfig(
                max_slots=2,
                rows=RowOptions(max_rank=64),
                host_cache_bytes=max(host_bound, prepared[-1]),
                disk_cache_bytes=max(disk_bound, file_bytes[-1]),
                prefetch_popular=args.popular,
                hub=HubConfig(endpoint=hub.endpoint, cache_dir=cache, progress_bars=False),
            )
            with AdapterManager(spec, config) as manager:
                for adapter_id in ids:
                    manager.register(adapter_id)
                engine = build_engine(model, manager, max_batch=4, max_seq_len=128)
                before = manager.metrics()
                samples, stop = [], threading.Event()

                def sample() -> None:
                    while not stop.is_set():
                        samples.append(_blob_bytes(cache))
                        stop.wait(0.001)

                after_answers = []

                def one(i: int) -> None:
                    handle = engine.submit([1 + i, 2, 3, 4], ids[i % len(ids)], SamplingParams(max_tokens=8))
                    handle.result(timeout=600)
                    after_answers.append(_blob_bytes(cache))

                sampler = threading.Thread(target=sample, daemon=True)
                sampler.start()
                engine.start()
                start = time.perf_counter()
                try:
                    with ThreadPoolExecutor(args.clients) as pool:
                        list(pool.map(one, range(args.requests)))
                    wall = time.perf_counter() - start
                    manager.prefetcher.wait(60)
                finally:
                    engine.stop()
                    stop.set()
                    sampler.join()
                after = manager.metrics()
                capacity = manager.registry.disk.capacity_bytes

    def moved(snapshot, move: str) -> int:
        stats = snapshot.moves.get(move)
        return stats.count if stats else 0

    downloads = moved(after, "hub_to_disk") - moved(before, "hub_to_disk")
    preparations = moved(after, "disk_to_host") - moved(before, "disk_to_host")
    misses = {t: after.misses.get(t, 0) - before.misses.get(t, 0) for t in ("disk", "host")}
    stall = after.stall
    result = {
        "requests": args.requests,
        "wall_s": wall,
        "downloads": downloads,
        "preparations": preparations,
        "disk_misses": misses["disk"],
        "host_misses": misses["host"],
        "downloads_per_disk_miss": downloads / misses["disk"] if misses["disk"] else None,
        "preparations_per_host_miss": preparations / misses["host"] if misses["host"] else None,
        "prefetch": dict(after.prefetch),
        "disk_bound_bytes": capacity,
        "disk_max_sampled_bytes": max(samples),
        "disk_max_after_answer_bytes": max(after_answers),
        "samples": len(samples),
        "stall_total_s": stall.total_seconds if stall else 0.0,
        "stall_p99_s": stall.p99_s if stall else 0.0,
    }
    print(f"{args.requests} requests over {len(ids)} hub adapters; host tier and disk bound ~{args.fits:g} adapters; "
          f"popular prefetch {args.popular}; {wall:.1f}s")  # fmt: skip
    print(f"hub downloads   {downloads:5d}  ({downloads / args.requests:.2f}/request, "
          f"{_per(downloads, misses['disk'])} per disk miss; floor 1)")  # fmt: skip
    print(f"preparations    {preparations:5d}  ({preparations / args.requests:.2f}/request, "
          f"{_per(preparations, misses['host'])} per host miss; floor 1)")  # fmt: skip
    print(f"prefetch        {dict(sorted(after.prefetch.items()))}")
    print(f"disk bytes      max sampled {max(samples)} / bound {capacity} ({max(samples) / capacity:.3f}x) over "
          f"{len(samples)} samples; max after an answer {max(after_answers)}")  # fmt: skip
    print(f"stall           {result['stall_total_s'] * 1e3:.1f} ms total, p99 {result['stall_p99_s'] * 1e3:.2f} ms")
    write_json(args.out, result)


def _per(n: int, d: int) -> str:
    return f"{n / d:.3f}" if d else "-"


if __name__ == "__main__":
    main()
