#!/usr/bin/env python3
"""Slot swaps and throughput of the Ray Serve cluster under one Zipf trace, routed three ways, side by side.

One local Ray (loopback), `--replicas` engine replicas of the tiny (or bench) model, each with a pool of `--slots`
max-rank adapters; `--adapters` synthetic adapters (ranks 4/8) served from the local hub and registered through
the ingress; `--requests` completions whose adapter follows Zipf(`--alpha`) popularity (one trace, seed 0), sent
by `--clients` concurrent clients through Serve's HTTP proxy. For each routing mode a fresh application on the same
Ray: (a) `adapter` — the model id as Serve's multiplexed model id, routed by AdapterRouter (cold adapters to free or
coldest capacity, hot adapters spill); (b) `serve-mux` — the same model ids through Serve's own multiplexed router
(power of two choices); (c) `default` — no model id: Serve's default routing, each replica's pool LRU on its own.
Slot swaps = host -> slot loads summed over replicas, per 1000 requests, beside two floors: the distinct adapters of
the trace (each loaded once somewhere: reachable only if everything fits), and Belady's offline optimum for one pool
of replicas x slots adapters on the same trace (no routing of that many slots over any number of replicas can load
fewer). Throughput = requests / wall time. Prints a table, writes out/bench_cluster.json.
Usage: .venv/bin/python -m scripts.bench_cluster [--requests 1000] [--adapters 200] [--replicas 2] [--slots 8]
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from adapter_manager import AdapterManagerConfig, HubConfig, LocalHub, RowOptions
from adapter_manager.runtime.cluster import ClusterConfig, RayOptions, start_cluster, stop_cluster
from adapter_manager.runtime.engine.engine import EngineConfig
from adapter_manager.runtime.model.config import LlamaConfig
from adapter_manager.runtime.server.state import ServerConfig
from scripts.harness import write_adapters, write_checkpoint, write_json

MODES = {  # name -> (multiplexed, custom_router)
    "adapter": (True, True),
    "serve-mux": (True, False),
    "default": (False, False),
}


def _zipf_trace(adapters: int, requests: int, alpha: float, seed: int = 0) -> list[int]:
    weights = 1.0 / np.arange(1, adapters + 1) ** alpha
    rng = np.random.default_rng(seed)
    return rng.choice(adapters, size=requests, p=weights / weights.sum()).tolist()


def belady_loads(trace: list[int], capacity: int) -> int:
    """Loads of the offline-optimal cache (evict the adapter needed furthest in the future) of `capacity` entries."""
    next_use = [len(trace)] * len(trace)
    seen: dict[int, int] = {}
    for i in range(len(trace) - 1, -1, -1):
        next_use[i] = seen.get(trace[i], len(trace))
        seen[trace[i]] = i
    cache: dict[int, int] = {}  # adapter -> its next use
    loads = 0
    for i, adapter in enumerate(trace):
        if adapter not in cache:
            loads += 1
            if len(cache) >= capacity:
                del cache[max(cache, key=cache.__getitem__)]
        cache[adapter] = next_use[i]
    return loads


def lru_loads(trace: list[int], capacity: int) -> int:
    """Loads of one LRU cache of `capacity` entries: what a single pool of all the slots would do online."""
    cache: OrderedDict[int, None] = OrderedDict()
    loads = 0
    for adapter in trace:
        if adapter in cache:
            cache.move_to_end(adapter)
            continue
        loads += 1
        if len(cache) >= capacity:
            cache.popitem(last=False)
        cache[adapter] = None
    return loads


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_mode(name: str, args, root: Path, hub: LocalHub, ids: list[str], trace: list[int], port: int) -> dict:
    multiplexed, custom = MODES[name]
    config = ClusterConfig(
        root / "model",
        AdapterManagerConfig(
            max_slots=args.slots,
            rows=RowOptions(max_rank=8),
            hub=HubConfig(endpoint=hub.endpoint, cache_dir=root / "hf-cache"),
        ),
        EngineConfig(max_batch=16, max_seq_len=128),
        ServerConfig(model_name="base", port=0),
        replicas=args.replicas,
        replica_cpus=args.replica_cpus,
        multiplexed=multiplexed,
        custom_router=custom,
        app_name=f"bench-{name}",
        spare_slots=args.spare_slots,
        spill_queue=args.spill_queue,
    )
    url = start_cluster(config, RayOptions(num_cpus=args.num_cpus, port=port))
    with httpx.Client(base_url=url, timeout=300) as http:
        for adapter_id in ids:
            http.post("/v1/adapters", json={"ref": adapter_id}).raise_for_status()
        time.sleep(2 * config.stats_period_s)
        before = http.get("/v1/metrics/swaps").json()["moves"].get("host_to_slot", {}).get("count", 0)

        def send(i: int) -> int:
            body = {"model": ids[trace[i]], "prompt": f"request {i}", "max_tokens": args.max_tokens, "seed": i}
            return http.post("/v1/completions", json=body).status_code

        start = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            statuses = list(pool.map(send, range(len(trace))))
        wall = time.perf_counter() - start
        time.sleep(3 * config.stats_period_s)  # the replicas' last reports
        swaps = http.get("/v1/metrics/swaps").json()
        reports = http.get("/v1/cluster/replicas").json()["data"]
    stop_cluster(config, shutdown_ray=False)
    loads = swaps["moves"].get("host_to_slot", {}).get("count", 0) - before
    failed = sum(s != 200 for s in statuses)
    return {
        "mode": name,
        "requests": len(trace),
        "failed": failed,
        "wall_s": wall,
        "throughput_rps": len(trace) / wall,
        "slot_loads": loads,
        "swaps_per_1000": 1000 * loads / len(trace),
        "slot_hit_rate": swaps["hit_rates"].get("slot"),
        "per_replica_loads": {
            r["replica"]: r["metrics"]["moves"].get("host_to_slot", {}).get("count", 0) for r in reports
        },
        "per_replica_requests": {r["replica"]: sum(r["metrics"].get("requests", {}).values()) for r in reports},
        "loader": _summed(r.get("loader", {}) for r in reports),
        "prefetch": _summed(r["metrics"].get("prefetch", {}) for r in reports),
        "evictions": _summed(r["metrics"].get("evictions", {}) for r in reports),
    }


def _summed(counts) -> dict[str, int]:
    total: dict[str, int] = {}
    for c in counts:
        for key, n in c.items():
            total[key] = total.get(key, 0) + n
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--adapters", type=int, default=200)
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--slots", type=int, default=8, help="max-rank adapters per replica's pool")
    parser.add_argument("--spare-slots", type=int, default=1, help="slots per replica kept out of Serve's count")
    parser.add_argument(
        "--spill-queue", type=int, default=ClusterConfig.spill_queue, help="AdapterRouter's spread rule"
    )
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model", choices=("tiny", "bench"), default="tiny")
    parser.add_argument("--num-cpus", type=float, default=2)
    parser.add_argument("--replica-cpus", type=float, default=0.5)
    parser.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
    parser.add_argument("--out", type=Path, default=Path("out/bench_cluster.json"))
    args = parser.parse_args()

    trace = _zipf_trace(args.adapters, args.requests, args.alpha)
    distinct = len(set(trace))
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        root = Path(tmp)
        model = getattr(LlamaConfig, args.model)()
        write_checkpoint(root / "model", model)
        ids = [f"bench/lora-{i:03d}" for i in range(args.adapters)]
        ranks = [8 if i % 2 else 4 for i in range(args.adapters)]
        write_adapters(root / "hub", model.to_spec("base"), ids, ranks, lora_alpha=8)
        port = _free_port()
        with LocalHub(root / "hub") as hub:
            try:
                for name in args.modes:
                    results.append(_run_mode(name, args, root, hub, ids, trace, port))
                    print(f"{name}: done", flush=True)
            finally:
                from ray import serve

                serve.shutdown()
    floor = 1000 * distinct / args.requests
    optimum = 1000 * belady_loads(trace, args.replicas * args.slots) / args.requests
    one_lru = 1000 * lru_loads(trace, args.replicas * args.slots) / args.requests
    print(
        f"\n{args.requests} requests, {args.adapters} adapters Zipf({args.alpha}), {distinct} distinct; "
        f"{args.replicas} replicas x {args.slots} slots, {args.clients} clients, {args.model} model"
    )
    print(
        f"floors: {floor:.1f} swaps/1000 (distinct adapters), {optimum:.1f} (Belady, one pool of "
        f"{args.replicas * args.slots} slots); one LRU pool of as many slots: {one_lru:.1f}"
    )
    print(f"{'routing':10} {'swaps/1000':>10} {'x Belady':>8} {'slot hit':>8} {'req/s':>7} {'failed':>6}")
    for r in results:
        hit = r["slot_hit_rate"] or 0.0
        print(
            f"{r['mode']:10} {r['swaps_per_1000']:10.1f} {r['swaps_per_1000'] / optimum:8.2f} "
            f"{hit:8.1%} {r['throughput_rps']:7.2f} {r['failed']:6d}"
        )
    payload = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "distinct_adapters": distinct,
        "floor_swaps_per_1000": floor,
        "belady_swaps_per_1000": optimum,
        "one_lru_pool_swaps_per_1000": one_lru,
        "results": results,
    }
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
