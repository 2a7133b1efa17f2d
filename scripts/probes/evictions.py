#!/usr/bin/env python3
"""What does a download's eviction cost as the disk tier's owned repos grow? (the 10,000-adapter soak's O(N))

N small repos in an HF cache layout (a snapshot symlinked to its blob, as huggingface_hub writes them), all owned by a
`DiskTier` whose bound is one repo short and all needed by a registration; then 50 downloads, each of which must
evict one: the median and p90 of `DiskTier.downloading`'s time per N. Floor: the eviction's own work (one repo's
revision deleted through huggingface_hub's cache API, that repo read again), which does not grow with N, measured
as the same with 10 repos; the pick of the least recently used revision (`tiers/disk_order.py`) should not grow
either. Prints a line per N and writes out/probe_evictions.json.

  .venv/bin/python -m scripts.probes.evictions [--repos 1000,4000,10000]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from adapter_manager.metrics import SwapMetrics
from adapter_manager.tiers.disk import DiskTier
from scripts.harness import cpu_model, write_json

SIZE = 4096  # bytes of each repo's one file


def make_repo(cache: Path, name: str) -> tuple[str, str]:
    """``org/<name>`` at one revision in the HF cache layout; returns (repo id, commit sha)."""
    folder, sha = cache / f"models--org--{name}", hashlib.sha1(name.encode()).hexdigest()
    blob = hashlib.sha256(name.encode()).hexdigest()
    (folder / "blobs").mkdir(parents=True)
    (folder / "blobs" / blob).write_bytes(os.urandom(SIZE))
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(sha)
    (folder / "snapshots" / sha).mkdir(parents=True)
    os.symlink(f"../../blobs/{blob}", folder / "snapshots" / sha / "adapter_model.safetensors")
    return f"org/{name}", sha


def measure(repos: int, downloads: int) -> dict:
    cache = Path(tempfile.mkdtemp(prefix="probe-evictions-"))
    try:
        owned = {make_repo(cache, f"r{i}") for i in range(repos)}
        tier = DiskTier(cache, (repos - 1) * SIZE + SIZE // 2, SwapMetrics(), needed=lambda: owned)
        for repo_id, _ in owned:
            tier.own(repo_id)
        times = []
        for i in range(downloads):
            repo_id, _ = make_repo(cache, f"new{i}")
            start = time.perf_counter()
            with tier.downloading(repo_id, SIZE, repo_id):
                pass
            times.append(1e3 * (time.perf_counter() - start))
        return {"repos": repos, "median_ms": statistics.median(times), "p90_ms": sorted(times)[int(0.9 * len(times))]}
    finally:
        shutil.rmtree(cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--repos", default="1000,4000,10000")
    parser.add_argument("--downloads", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("out/probe_evictions.json"))
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}", flush=True)
    floor = measure(10, args.downloads)  # the eviction's own work, with almost nothing else owned
    print(f"floor (10 owned repos): {floor['median_ms']:.2f} ms", flush=True)
    rows = []
    for repos in (int(n) for n in args.repos.split(",")):
        row = measure(repos, args.downloads)
        rows.append(row)
        print(
            f"{repos:>6} owned repos: a download's eviction {row['median_ms']:.2f} ms (p90 {row['p90_ms']:.2f}), "
            f"{row['median_ms'] / floor['median_ms']:.1f}x the floor",
            flush=True,
        )
    write_json(args.out, {"cpu": cpu_model(), "floor": floor, "rows": rows})


if __name__ == "__main__":
    main()
