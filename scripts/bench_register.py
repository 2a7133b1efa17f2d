#!/usr/bin/env python3
"""Cold register time vs raw file read time for a rank-16 adapter on the bench base (hidden 1024, 8 layers), and what
registering many adapters by hub ID costs per adapter.

Side by side in one run, medians over --repeats: (a) reading adapter_model.safetensors into memory (page cache
warm), (b) registering from a local directory (read, validate, fold scale, pad: disk -> host), (c) a cold register
by hub ID from the local hub on loopback into an empty HF cache (download + prepare). Then (d) --adapters distinct
repos (the same files) registered by hub ID one after another into one registry and one HF cache, as a manager
registers its adapters: the median per adapter beside its 30 ms target, the HTTP requests one registration makes
(from the hub's log), and the time from each request's start to the next one's (the last one's to the end of the
download; client work included), beside the floor of writing the weights' bytes to a new file where the HF caches
are (--cache-root; default the run's temp folder). The hub's files are dated an hour back and read once before
timing, as a real hub's are old and known: the local hub re-hashes a file younger than 2 s on every request.
Prints two tables and writes out/bench_register.json.
Usage: .venv/bin/python -m scripts.bench_register [--repeats 15] [--rank 16] [--adapters 32] [--cache-root DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from huggingface_hub import HfApi
from huggingface_hub.utils import get_session

from adapter_manager import (
    AdapterRegistry,
    BaseModelSpec,
    HubConfig,
    RegistryConfig,
    RowOptions,
    write_synthetic_adapter,
)
from adapter_manager.sources.local_hub import LocalHub
from adapter_manager.sources.peft_format import CONFIG_NAME, WEIGHTS_NAME
from scripts.harness import write_json

TARGET_PER_ADAPTER_S = 0.030  # (d): register by hub ID, per adapter


def request_kind(method: str, path: str) -> str:
    """A hub request as the breakdown names it: "info", "tree", or its method and file, e.g. "HEAD config"."""
    if "/resolve/" in path:
        name = path.rsplit("/", 1)[-1]
        return f"{method} {'config' if name == CONFIG_NAME else 'weights' if name == WEIGHTS_NAME else name}"
    return "tree" if "/tree/" in path else "info"


class RequestClock:
    """When each huggingface_hub request starts, from a hook on its shared session; `split` turns them into times."""

    def __init__(self) -> None:
        self.starts: list[tuple[float, str]] = []  # (perf_counter, request_kind)

    def _hook(self, request) -> None:
        self.starts.append((time.perf_counter(), request_kind(request.method, request.url.path)))

    def __enter__(self) -> RequestClock:
        get_session().event_hooks["request"].append(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        get_session().event_hooks["request"].remove(self._hook)

    def split(self, end: float) -> dict[str, float]:
        """Seconds from each request's start to the next one's (the last one's to `end`), summed by kind; clears."""
        times: dict[str, float] = defaultdict(float)
        for (start, kind), (after, _) in zip(self.starts, [*self.starts[1:], (end, "")], strict=True):
            times[kind] += after - start
        self.starts.clear()
        return dict(times)


def publish(folder: Path, hub_root: Path, count: int) -> list[str]:
    """`count` hub repos bench/a0 .. holding `folder`'s files (hard links where possible), dated an hour back."""
    repo_ids = []
    for i in range(count):
        repo = hub_root / "bench" / f"a{i}"
        repo.mkdir(parents=True)
        for file in folder.iterdir():
            try:
                os.link(file, repo / file.name)
            except OSError:
                shutil.copy2(file, repo / file.name)
        repo_ids.append(f"bench/a{i}")
    an_hour_ago = time.time() - 3600
    for file in hub_root.rglob("*"):
        if file.is_file():
            os.utime(file, (an_hour_ago, an_hour_ago))
    return repo_ids


def cold_registers(spec, folder: Path, hub: LocalHub, caches: Path, dtype: torch.dtype, args) -> dict[str, list]:
    """(a) raw read, (b) local register, (c) cold register by hub ID into an empty HF cache, and the disk floor."""
    runs: dict[str, list] = defaultdict(list)
    weights = folder / WEIGHTS_NAME
    for i in range(args.repeats):
        start = time.perf_counter()
        data = weights.read_bytes()
        runs["raw_read"].append(time.perf_counter() - start)
        start = time.perf_counter()
        (caches / f"write-{dtype}-{i}").write_bytes(data)
        runs["raw_write"].append(time.perf_counter() - start)
        del data  # freed before the next read, as (a) always measured it
        config = RegistryConfig(rows=RowOptions(max_rank=args.rank), dtype=dtype, host_cache_bytes=1 << 30)
        registry = AdapterRegistry(spec, config)
        start = time.perf_counter()
        registry.register(str(folder), adapter_id="local")
        runs["register_local"].append(time.perf_counter() - start)
        config.hub = HubConfig(endpoint=hub.endpoint, cache_dir=caches / f"cache-{dtype}-{i}", progress_bars=False)
        registry = AdapterRegistry(spec, config)
        hub.clear_requests()
        start = time.perf_counter()
        result = registry.register("bench/r16")
        runs["register_cold_hub"].append(time.perf_counter() - start)
        runs["download"].append(result.download_s)
        runs["prepare"].append(result.prepare_s)
        runs["requests_cold_hub"].append(len(hub.requests))
    return runs


def many_registers(spec, repo_ids: list[str], hub: LocalHub, clock: RequestClock, cache: Path, dtype, args) -> dict:
    """(d) `repo_ids` registered by hub ID one after another into one registry and one HF cache `cache`."""
    hub_config = HubConfig(endpoint=hub.endpoint, cache_dir=cache, progress_bars=False)
    registry = AdapterRegistry(
        spec, RegistryConfig(rows=RowOptions(max_rank=args.rank), dtype=dtype, host_cache_bytes=1 << 30, hub=hub_config)
    )
    runs: dict[str, list] = defaultdict(list)
    sequences, request_s = [], defaultdict(list)
    for repo_id in repo_ids:
        hub.clear_requests()
        clock.starts.clear()
        start = time.perf_counter()
        result = registry.register(repo_id)
        runs["register_hub_per_adapter"].append(time.perf_counter() - start)
        runs["download_per_adapter"].append(result.download_s)
        sequences.append([request_kind(r.method, r.path) for r in hub.requests])
        runs["requests_per_register"].append(len(sequences[-1]))
        for kind, seconds in clock.split(start + result.download_s).items():
            request_s[kind].append(seconds)
    med = {k: statistics.median(v) for k, v in runs.items()}
    med["requests"] = max(sequences, key=sequences.count)  # the usual sequence, in the hub's answer order
    med["request_ms"] = {kind: statistics.median(v) * 1e3 for kind, v in request_s.items()}
    return med


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}ms"


def print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    """`title`, then `columns` over `rows`: the first column left-aligned, the others right-aligned."""
    widths = [max(len(line[i]) for line in [columns, *rows]) for i in range(len(columns))]
    print(title)
    for line in [columns, *rows]:
        print(" ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(line, widths, strict=True))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=32, help="distinct repos registered into one cache in (d)")
    parser.add_argument("--cache-root", type=Path, default=None, help="where the HF caches go; default: temp folder")
    parser.add_argument("--out", type=Path, default=Path("out/bench_register.json"))
    args = parser.parse_args()
    spec = BaseModelSpec.bench()
    results, raw_reads, raw_writes = {}, [], []
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir=args.cache_root) as cache_tmp:
        root, caches = Path(tmp), Path(cache_tmp)
        folder = write_synthetic_adapter(root / "hub" / "bench" / "r16", spec, r=args.rank, lora_alpha=2 * args.rank)
        repo_ids = publish(folder, root / "hub", args.adapters)
        with LocalHub(root / "hub") as hub, RequestClock() as clock:
            api = HfApi(endpoint=hub.endpoint)
            for repo_id in ["bench/r16", *repo_ids]:
                api.model_info(repo_id)  # the hub hashes the files now, once
            for dtype in (torch.float32, torch.bfloat16):
                runs = cold_registers(spec, folder, hub, caches, dtype, args)
                raw_reads += runs["raw_read"]
                raw_writes += runs["raw_write"]
                med = {k: statistics.median(v) for k, v in runs.items()}
                med |= many_registers(spec, repo_ids, hub, clock, caches / f"cache-{dtype}-all", dtype, args)
                results[str(dtype).removeprefix("torch.")] = med
        results["file_bytes"] = (folder / WEIGHTS_NAME).stat().st_size
        results["adapters"] = args.adapters
        results["target_per_adapter"] = TARGET_PER_ADAPTER_S
    raw_read = statistics.median(raw_reads)  # the same file every time: one median over all reads
    raw_write = statistics.median(raw_writes)  # ... and over all writes
    for dtype in ("float32", "bfloat16"):
        med = results[dtype]
        med["raw_read"], med["raw_write"] = raw_read, raw_write
        med["ratio_local"] = med["register_local"] / raw_read
        med["ratio_cold_hub"] = med["register_cold_hub"] / raw_read
    dtypes = ("float32", "bfloat16")
    print_table(
        f"rank-{args.rank} adapter, all 7 projections, bench base, {args.repeats} repeats, medians",
        ["serving dtype", "raw read", "register local", "ratio", "cold via hub", "ratio", "(download", "prepare)"]
        + ["requests"],
        [
            [d, ms(m["raw_read"]), ms(m["register_local"]), f"{m['ratio_local']:.1f}x", ms(m["register_cold_hub"])]
            + [f"{m['ratio_cold_hub']:.1f}x", ms(m["download"]), ms(m["prepare"]), f"{m['requests_cold_hub']:g}"]
            for d, m in ((d, results[d]) for d in dtypes)
        ],
    )
    print_table(
        f"{args.adapters} repos registered by hub ID into one registry and HF cache, per adapter, medians",
        ["serving dtype", "register", "target", "", "download", "disk write", "requests"],
        [
            [d, ms(m["register_hub_per_adapter"]), ms(TARGET_PER_ADAPTER_S)]
            + ["met" if m["register_hub_per_adapter"] <= TARGET_PER_ADAPTER_S else "MISSED"]
            + [ms(m["download_per_adapter"]), ms(m["raw_write"]), f"{m['requests_per_register']:g}"]
            for d, m in ((d, results[d]) for d in dtypes)
        ],
    )
    for d in dtypes:
        print(f"{d} per request: " + ", ".join(f"{kind} {ms(t / 1e3)}" for kind, t in results[d]["request_ms"].items()))
    write_json(args.out, results)


if __name__ == "__main__":
    main()
