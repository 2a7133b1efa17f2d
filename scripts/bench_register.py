#!/usr/bin/env python3
"""Cold register time vs raw file read time for a rank-16 adapter on the bench base (hidden 1024, 8 layers).

Side by side in one run, medians over --repeats: (a) reading adapter_model.safetensors into memory (page cache
warm), (b) registering from a local directory (read, validate, fold scale, pad: disk -> host), (c) a cold register
by hub ID from the local hub on loopback into an empty HF cache (download + prepare). Prints a table and writes
out/bench_register.json.  Usage: .venv/bin/python scripts/bench_register.py [--repeats 15] [--rank 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from adapter_manager import AdapterRegistry, BaseModelSpec, HubConfig, RegistryConfig, write_synthetic_adapter
from adapter_manager.sources.local_hub import LocalHub
from adapter_manager.sources.peft_format import WEIGHTS_NAME


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("out/bench_register.json"))
    args = parser.parse_args()
    spec = BaseModelSpec.bench()
    results, raw_reads = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = write_synthetic_adapter(root / "hub" / "bench" / "r16", spec, r=args.rank, lora_alpha=2 * args.rank)
        weights = folder / WEIGHTS_NAME
        with LocalHub(root / "hub") as hub:
            for dtype in (torch.float32, torch.bfloat16):
                raw, local, cold, download, prepare = [], [], [], [], []
                for i in range(args.repeats):
                    start = time.perf_counter()
                    weights.read_bytes()
                    raw.append(time.perf_counter() - start)
                    raw_reads.append(raw[-1])
                    config = RegistryConfig(max_rank=args.rank, dtype=dtype, host_cache_bytes=1 << 30)
                    registry = AdapterRegistry(spec, config)
                    start = time.perf_counter()
                    registry.register(str(folder), adapter_id="local")
                    local.append(time.perf_counter() - start)
                    config.hub = HubConfig(
                        endpoint=hub.endpoint, cache_dir=root / f"cache-{dtype}-{i}", progress_bars=False
                    )
                    registry = AdapterRegistry(spec, config)
                    start = time.perf_counter()
                    result = registry.register("bench/r16")
                    cold.append(time.perf_counter() - start)
                    download.append(result.download_s)
                    prepare.append(result.prepare_s)
                med = {
                    k: statistics.median(v)
                    for k, v in dict(
                        raw_read=raw, register_local=local, register_cold_hub=cold, download=download, prepare=prepare
                    ).items()
                }
                results[str(dtype).removeprefix("torch.")] = med
        results["file_bytes"] = weights.stat().st_size
    raw_read = statistics.median(raw_reads)  # the same file every time: one median over all reads
    for dtype in ("float32", "bfloat16"):
        med = results[dtype]
        med["raw_read"] = raw_read
        med["ratio_local"] = med["register_local"] / raw_read
        med["ratio_cold_hub"] = med["register_cold_hub"] / raw_read
    print(f"rank-{args.rank} adapter, all 7 projections, bench base, {args.repeats} repeats, medians")
    print(
        f"{'serving dtype':14} {'raw read':>9} {'register local':>15} {'ratio':>6} {'cold via hub':>13} {'ratio':>6} "
        f"{'(download':>10} {'prepare)':>9}"
    )
    for dtype in ("float32", "bfloat16"):
        m = results[dtype]
        print(
            f"{dtype:14} {m['raw_read'] * 1e3:7.2f}ms {m['register_local'] * 1e3:13.2f}ms {m['ratio_local']:5.1f}x "
            f"{m['register_cold_hub'] * 1e3:11.2f}ms {m['ratio_cold_hub']:5.1f}x {m['download'] * 1e3:8.2f}ms "
            f"{m['prepare'] * 1e3:7.2f}ms"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
