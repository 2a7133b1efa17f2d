#!/usr/bin/env python3
"""Many adapters at full speed: the real engine serving a Poisson trace over N registered adapters, against the
same trace on adapters that all stay resident.

Bench model (hidden 1024, 8 layers, fp32), a --pool-gib row pool (max rank 64), a --host-gib host tier. The
population: N synthetic PEFT adapters (real safetensors + adapter_config.json, all 7 projections) of ranks 8/16/32/64
at 40/30/20/10 %, written once into out/bench_many/population/ (reused by later runs) and served by the local hub;
the first manager of each N registers them through huggingface_hub from the hub (HF cache under out/bench_many/), the
others from the same files as local directories (the registration times of both are printed).

One trace (seeded, printed): Poisson arrivals, mixed prompt and output lengths, and one uniform draw per request that
picks its adapter by Zipf(alpha) over N (so every N and alpha sees the same arrivals and lengths). The arrival rate is
--load (0.8) x the all-resident engine's closed-loop capacity, measured first. Per (N, alpha): the all-resident
baseline (every request mapped onto an adapter of the same rank from a set that fits the pool, preloaded), then N
adapters with prefetch, then without. Reported: throughput / all-resident throughput, TTFT and end-to-end p50/p99,
stall p99 (prefetch / no prefetch), hits and moves per tier, evictions per 1000 requests, host and disk bytes.
Targets: >= 95 % of all-resident throughput at N = 1000, alpha = 1, a 1 GiB pool (S-LoRA: 94.5 %); stall p99
with prefetch <= 0.1x without; preparations per host-tier miss <= 1.05. The engine steps in its own thread (as in a
server) while this one submits on schedule. Writes out/bench_many.json.

  .venv/bin/python -m scripts.bench_many --quick          # N = 1000, alpha = 1, 160 requests, local dirs
  .venv/bin/python -m scripts.bench_many                  # the grid: N in {8, 100, 1000} x alpha in {0.5, 1, 1.5}
  PJRT_DEVICE=CPU .venv-xla/bin/python -m scripts.bench_many --device xla   # compiles after warm-up (target 0)
"""

from __future__ import annotations

import argparse
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from huggingface_hub.utils import disable_progress_bars

from adapter_manager import AdapterManager, AdapterManagerConfig, HubConfig, LocalHub, RowOptions
from adapter_manager.kernels import BackendKind, KernelConfig
from adapter_manager.runtime.engine.engine import Engine
from adapter_manager.runtime.model.checkpoint import load_model
from adapter_manager.runtime.model.config import LlamaConfig
from scripts.harness import (
    RANKS,
    SHARES,
    Trace,
    build_engine,
    population_ranks,
    replay,
    write_adapters,
    write_checkpoint,
    write_json,
)

ORG = "many"


def adapter_id(i: int) -> str:
    return f"{ORG}/a{i:04d}"


def write_population(root: Path, spec, ranks: list[int]) -> float:
    """Write the adapters missing from ``root`` (ranks[i] for adapter i). Returns seconds."""
    start = time.perf_counter()
    write_adapters(root, spec, [adapter_id(i) for i in range(len(ranks))], ranks, reuse=True)
    return time.perf_counter() - start


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())


def register_all(manager: AdapterManager, refs: dict[str, str], workers: int = 4) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda item: manager.register(item[1], item[0]), refs.items()))
    return time.perf_counter() - start


def counters(snapshot: dict) -> dict:
    moves = {m: {"count": s["count"], "bytes": s["total_bytes"]} for m, s in snapshot["moves"].items()}
    keys = ("hits", "misses", "evictions", "prefetch", "rejections")
    return {"moves": moves, **{k: dict(snapshot[k]) for k in keys}}


def delta(after: dict, before: dict) -> dict:
    out = {"moves": {}}
    for move, stats in after["moves"].items():
        old = before["moves"].get(move, {"count": 0, "bytes": 0})
        out["moves"][move] = {k: stats[k] - old[k] for k in ("count", "bytes")}
    for key in ("hits", "misses", "evictions", "prefetch", "rejections"):
        out[key] = {t: n - before[key].get(t, 0) for t, n in after[key].items()}
    return out


class Bench:
    def __init__(self, args: argparse.Namespace, model, spec, cache: Path) -> None:
        self.args, self.model, self.spec, self.cache = args, model, spec, cache
        self.hub_registered: set[int] = set()

    def manager(self, prefetch: bool) -> AdapterManager:
        config = AdapterManagerConfig(
            max_slots="auto",
            slot_memory_bytes=int(self.args.pool_gib * (1 << 30)),
            rows=RowOptions(max_rank=64),
            host_cache_bytes=int(self.args.host_gib * (1 << 30)),
            device=self.args.device_obj,
            prefetch_workers=2 if prefetch else 0,
            hub=HubConfig(endpoint=self.args.endpoint, cache_dir=self.cache / "hf-cache", progress_bars=False),
        )
        return AdapterManager(self.spec, config)

    def engine(self, manager: AdapterManager) -> Engine:
        longest = self.args.prompt_max + self.args.output_max
        kernels = KernelConfig(backend=BackendKind(self.args.kernels))
        engine = build_engine(self.model, manager, self.args.max_batch, longest + 1, self.args.token_budget, kernels)
        engine.warm_up()
        return engine

    def resident_set(self, manager: AdapterManager, ranks: list[int]) -> dict[int, list[int]]:
        """Per rank, the first adapters of that rank such that the rank mix fits the pool exactly."""
        units = {r: manager.pool.units_for(r) for r in RANKS}
        mean = sum(s * units[r] for r, s in zip(RANKS, SHARES, strict=True))
        total = manager.num_units // mean
        chosen = {}
        for r, share in zip(RANKS, SHARES, strict=True):
            of_rank = [i for i, rank in enumerate(ranks) if rank == r]
            chosen[r] = of_rank[: max(1, math.floor(share * total))]
        assert sum(units[r] * len(v) for r, v in chosen.items()) <= manager.num_units
        return chosen

    def run(self, kind: str, n: int, alpha: float, trace: Trace, ranks: list[int], closed: bool = False) -> dict:
        """kind: resident (the baseline), prefetch, no_prefetch."""
        manager = self.manager(prefetch=kind == "prefetch")
        try:
            picks = trace.adapters(n, alpha)
            info: dict = {"kind": kind, "adapters": n, "alpha": alpha}
            if kind == "resident":
                chosen = self.resident_set(manager, ranks)
                position = {i: k for r in RANKS for k, i in enumerate(i for i, rank in enumerate(ranks) if rank == r)}
                mapped = [chosen[ranks[p]][position[p] % len(chosen[ranks[p]])] for p in picks]
                used = sorted({i for v in chosen.values() for i in v}, key=lambda i: -ranks[i])
                info["register_s"] = register_all(
                    manager, {adapter_id(i): str(self.cache / "population" / adapter_id(i)) for i in used}
                )
                for i in used:  # largest first: the buddy space packs without holes
                    manager.allocator.preload(adapter_id(i))
                assert all(manager.allocator.slot_of(adapter_id(i)) is not None for i in used), "baseline must fit"
                info["resident_adapters"] = len(used)
                adapters = [adapter_id(i) for i in mapped]
            else:
                via_hub = self.args.register == "hub" and n not in self.hub_registered
                refs = {
                    adapter_id(i): adapter_id(i) if via_hub else str(self.cache / "population" / adapter_id(i))
                    for i in range(n)
                }
                info["register_s"] = register_all(manager, refs)
                info["registered_via"] = "hub" if via_hub else "local"
                self.hub_registered.add(n)
                adapters = [adapter_id(i) for i in picks]
            engine = self.engine(manager)
            before = counters(manager.metrics().to_dict())
            compiles = _compile_count() if self.args.device == "xla" else None
            info.update(replay(engine, trace, adapters, closed))
            if compiles is not None:
                info["compiles_after_warm_up"] = _compile_count() - compiles
            snapshot = manager.metrics().to_dict()
            info["tiers"] = delta(counters(snapshot), before)
            wait = snapshot["stall"] or {}
            info["stall_p99_s"] = wait.get("p99_s")
            info["stall_p50_s"] = wait.get("p50_s")
            adapter_wait = snapshot["adapter_wait"] or {}
            info["adapter_wait_p50_s"] = adapter_wait.get("p50_s")
            info["adapter_wait_p99_s"] = adapter_wait.get("p99_s")
            prepare = snapshot["moves"].get("disk_to_host") or {}
            info["prepare_p50_s"], info["prepare_p99_s"] = prepare.get("p50_s"), prepare.get("p99_s")
            evictions = sum(info["tiers"]["evictions"].values())
            info["evictions_per_1000_requests"] = 1000 * evictions / len(trace.prompts)
            info["slot_evictions_per_1000_requests"] = (
                1000 * info["tiers"]["evictions"].get("slot", 0) / len(trace.prompts)
            )
            moves, misses = info["tiers"]["moves"], info["tiers"]["misses"]
            prepared = moves.get("disk_to_host", {}).get("count", 0)
            info["preparations_per_host_miss"] = prepared / misses["host"] if misses.get("host") else None
            downloads = moves.get("hub_to_disk", {}).get("count", 0)
            info["downloads_per_disk_miss"] = downloads / misses["disk"] if misses.get("disk") else None
            info["host_bytes"] = manager.registry.host.used_bytes
            info["disk_bytes"] = sum(folder_bytes(self.cache / "population" / adapter_id(i)) for i in set(picks))
            info["distinct_adapters_requested"] = len(set(adapters))
            return info
        finally:
            manager.close()


def _compile_count() -> int:
    import torch_xla.debug.metrics as metrics

    data = metrics.metric_data("CompileTime")
    return 0 if data is None else data[0]


def hit_rate(tiers: dict, tier: str) -> float:
    hits, misses = tiers["hits"].get(tier, 0), tiers["misses"].get(tier, 0)
    return hits / (hits + misses) if hits + misses else float("nan")


def print_row(row: dict, base: dict) -> None:
    t = row["tiers"]
    ratio = row["throughput_req_s"] / base["throughput_req_s"]
    row["throughput_ratio"] = ratio
    wait = row["stall_p99_s"] or 0.0
    print(
        f"N {row['adapters']:5d} a {row['alpha']:.1f} {row['kind']:>11s} {row['throughput_req_s']:6.2f} req/s "
        f"{100 * ratio:6.1f} % | ttft p50/p99 {row['ttft_p50_s'] * 1e3:7.0f}/{row['ttft_p99_s'] * 1e3:7.0f} ms "
        f"e2e {row['e2e_p50_s']:5.2f}/{row['e2e_p99_s']:5.2f} s | stall p99 {wait * 1e3:7.1f} ms | "
        f"slot hit {hit_rate(t, 'slot'):.3f} host hit {hit_rate(t, 'host'):.3f} | "
        f"evict/1k {row['evictions_per_1000_requests']:6.0f} | "
        f"prep/host miss {_ratio(row, 'preparations_per_host_miss')} | prepare p50/p99 {_ms(row, 'prepare_p50_s')}/"
        f"{_ms(row, 'prepare_p99_s')} ms | adapter wait p50/p99 {_ms(row, 'adapter_wait_p50_s')}/"
        f"{_ms(row, 'adapter_wait_p99_s')} ms | register {row['register_s']:.1f}s "
        f"({row.get('registered_via', 'local')}) | moves "
        + " ".join(f"{m} {v['count']}" for m, v in sorted(t["moves"].items())),
        flush=True,
    )


def _ms(row: dict, key: str) -> str:
    return "-" if row.get(key) is None else f"{row[key] * 1e3:.0f}"


def _ratio(row: dict, key: str) -> str:
    return "-" if row.get(key) is None else f"{row[key]:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 1000, alpha = 1, 160 requests")
    parser.add_argument("--adapters", default="8,100,1000")
    parser.add_argument("--alphas", default="0.5,1.0,1.5")
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--calibrate", type=int, default=48, help="requests of the closed-loop capacity run")
    parser.add_argument("--load", type=float, default=0.8, help="arrival rate / all-resident capacity")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pool-gib", type=float, default=1.0)
    parser.add_argument("--kernels", default="auto", choices=["auto", "torch"], help="LoRA backend (torch: its forms)")
    parser.add_argument("--host-gib", type=float, default=2.0)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--token-budget", type=int, default=512)
    parser.add_argument("--prompt-len", default="16,128", help="prompt lengths: uniform in [lo, hi)")
    parser.add_argument("--output-len", default="4,48", help="generated tokens: uniform in [lo, hi)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda[:i] or xla")
    parser.add_argument(
        "--register",
        default=None,
        choices=["hub", "local"],
        help="first manager of each N: hub ids or local dirs (default hub; --quick: local)",
    )
    parser.add_argument("--cache", type=Path, default=Path("out/bench_many"), help="population + HF cache (reused)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.adapters, args.alphas, args.requests = "1000", "1.0", 160
    args.register = args.register or ("local" if args.quick else "hub")  # 1000 hub registrations take ~110 s here
    if args.device == "xla":
        import torch_xla

        args.adapters, args.alphas = args.adapters.split(",")[-1], "1.0"
        args.requests = min(args.requests, 48)
        args.token_budget, args.max_batch = 128, 8  # fewer token buckets to compile at warm-up
        args.prompt_len, args.output_len = "16,64", "4,16"
        args.device_obj = torch_xla.device()
    else:
        args.device_obj = torch.device(args.device)
    args.prompt_min, args.prompt_max = (int(v) for v in args.prompt_len.split(","))
    args.output_min, args.output_max = (int(v) for v in args.output_len.split(","))
    out = args.out or Path(f"out/bench_many{'_xla' if args.device == 'xla' else ''}.json")
    sizes = [int(v) for v in args.adapters.split(",")]
    alphas = [float(v) for v in args.alphas.split(",")]
    disable_progress_bars()  # concurrent registrations would interleave huggingface_hub's bars
    started = time.perf_counter()
    cache = args.cache.resolve()
    config = LlamaConfig.bench()
    spec = config.to_spec("adapter-manager/bench-llama")
    ranks = population_ranks(max(sizes), args.seed)
    written = write_population(cache / "population", spec, ranks)
    print(f"population: {max(sizes)} adapters in {cache / 'population'} ({written:.1f}s to write what was missing)")
    model = load_model(write_checkpoint(cache / "model", config, seed=args.seed, reuse=True), device=args.device_obj)
    trace = Trace.make(
        args.requests,
        args.seed,
        config.vocab_size,
        (args.prompt_min, args.prompt_max),
        (args.output_min, args.output_max),
    )
    print(f"trace: {args.requests} requests, seed {args.seed}, prompts {args.prompt_len}, outputs {args.output_len}")
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "seed": args.seed, "rows": []}
    with LocalHub(cache / "population") as hub:
        args.endpoint = hub.endpoint
        bench = Bench(args, model, spec, cache)
        calibration = bench.run("resident", max(sizes), 1.0, trace.head(args.calibrate), ranks, closed=True)
        rate = args.load * calibration["throughput_req_s"]
        results["capacity_req_s"], results["rate_req_s"] = calibration["throughput_req_s"], rate
        print(
            f"all-resident capacity {calibration['throughput_req_s']:.2f} req/s (closed loop); "
            f"arrivals at {rate:.2f} req/s"
        )
        timed = trace.scaled(rate)
        for n in sizes:
            for alpha in alphas:
                base = calibration if args.device == "xla" else bench.run("resident", n, alpha, timed, ranks)
                if base is not calibration:
                    print_row(base, base)
                    results["rows"].append(base)
                kinds = ("prefetch",) if args.device == "xla" else ("prefetch", "no_prefetch")
                rows = {}
                for kind in kinds:
                    rows[kind] = bench.run(kind, n, alpha, timed, ranks)
                    print_row(rows[kind], base)
                    results["rows"].append(rows[kind])
                    if "compiles_after_warm_up" in rows[kind]:
                        print(f"    compiles after warm-up: {rows[kind]['compiles_after_warm_up']} (target 0)")
                if "no_prefetch" in rows:
                    with_p, without = rows["prefetch"]["stall_p99_s"], rows["no_prefetch"]["stall_p99_s"]
                    ratio = with_p / without if with_p is not None and without else float("nan")
                    rows["prefetch"]["stall_p99_ratio"] = ratio
                    print(f"    stall p99 with / without prefetch: {ratio:.3f} (target <= 0.1)")
    results["wall_s"] = time.perf_counter() - started
    write_json(out, results, default=float, prefix=f"wall {results['wall_s']:.0f}s; ")


if __name__ == "__main__":
    main()
