"""The demo: a random bench-size Llama and synthetic PEFT adapters served by the local hub, registered by hub id
through the running server's admin API (huggingface_hub downloads underneath), then Zipf traffic from concurrent
clients through the OpenAI-compatible API, and a table of what it cost: throughput, hit rates, swap latency.

Each long step is said as it starts; where it has a count, a progress bar (on stderr, where it is a terminal) counts
it and is gone once done."""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

import numpy as np
from huggingface_hub.utils import disable_progress_bars
from tqdm import tqdm

from adapter_manager import PROJECTIONS, HubConfig, RowOptions, TensorParallel, write_synthetic_adapter
from adapter_manager.sources.local_hub import LocalHub

from .client import ServerClient, ServerError
from .model.checkpoint import write_random_checkpoint
from .model.config import LlamaConfig
from .model.tokenizer import write_byte_level_tokenizer
from .options import ServeOptions
from .server.app import BackgroundServer
from .server.launch import build_serving

_MB = 1e6
_T = TypeVar("_T")
_RANKS = (8, 16, 32, 64)
_TARGETS = (PROJECTIONS, ("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj"))
_TOPICS = ("tea", "rain", "maps", "owls", "jazz", "salt", "ice", "kites", "moss", "tides", "bells", "ferns")


@dataclass
class DemoConfig:
    """Size of one demo run."""

    adapters: int = 64  # synthetic adapters, ranks cycling through 8/16/32/64 and four target sets
    requests: int = 512  # completions sent through the server
    clients: int = 16  # concurrent client threads
    slots: int = 8  # device adapter slots
    model: Literal["bench", "tiny"] = "bench"  # random base model: LlamaConfig.bench() or .tiny()
    max_tokens: int = 4  # tokens generated per request
    zipf_alpha: float = 1.0  # adapter popularity: P(i) ~ 1 / (i + 1)^alpha
    host_cache_adapters: int = 16  # host tier bound, in adapters targeting every module at rank 64
    seed: int = 0  # traffic and weights
    tensor_parallel_size: int = 1  # the model and the pool sharded over N processes (cpu: one per shard, gloo)

    def __post_init__(self) -> None:
        if min(self.adapters, self.requests, self.clients, self.slots, self.max_tokens, self.host_cache_adapters) < 1:
            raise ValueError(
                f"adapters ({self.adapters}), requests ({self.requests}), clients ({self.clients}), slots "
                f"({self.slots}), max_tokens ({self.max_tokens}) and host_cache_adapters must all be >= 1"
            )
        if self.model not in ("bench", "tiny") or self.zipf_alpha < 0:
            raise ValueError(f"model must be 'bench' or 'tiny' (got {self.model!r}), zipf_alpha >= 0")


def run_demo(config: DemoConfig | None = None, workdir: Path | None = None) -> int:
    config = config or DemoConfig()
    disable_progress_bars()  # concurrent registrations would interleave huggingface_hub's download bars
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="adapter-manager-demo-") as tmp:
        root = Path(workdir or tmp)
        llama = getattr(LlamaConfig, config.model)()
        name = f"random-llama-{config.model}"
        print(f"writing {name}: random weights and a tokenizer of its own...", flush=True)
        write_random_checkpoint(llama, root / "model", seed=config.seed)
        write_byte_level_tokenizer(root / "model", llama)
        spec = llama.to_spec(name)
        print(
            f"base model {name}: hidden {llama.hidden_size}, {llama.num_layers} layers, vocab {llama.vocab_size} "
            f"(random weights, written in {time.perf_counter() - start:.1f}s)"
        )
        ids = [f"demo/adapter-{i:02d}" for i in range(config.adapters)]
        print(f"writing {config.adapters} synthetic PEFT adapters (ranks {', '.join(map(str, _RANKS))})...", flush=True)
        for i, adapter_id in enumerate(_bar(ids, "adapters written")):
            r = _RANKS[i % len(_RANKS)]
            write_synthetic_adapter(
                root / "hub" / adapter_id, spec, r=r, lora_alpha=2 * r, target_modules=_TARGETS[i % 4], seed=i
            )
        one = spec.max_adapter_bytes(max(_RANKS), 4)
        configs = ServeOptions(
            name,
            max_slots=config.slots,
            rows=RowOptions(max_rank=max(_RANKS), tensor_parallel=TensorParallel(config.tensor_parallel_size)),
            host_cache_bytes=config.host_cache_adapters * one,
            max_seq_len=128,
            port=0,
            max_pending=max(256, 2 * config.clients),
        ).configs(root / "model")
        with LocalHub(root / "hub") as hub:
            configs.manager.hub = HubConfig(endpoint=hub.endpoint, cache_dir=root / "hf-cache", progress_bars=False)
            print(f"loading {name} and starting the server...", flush=True)
            serving = build_serving(root / "model", configs.manager, configs.engine, configs.server, configs.dtype)
            try:
                model = serving.engine.model
                print(
                    f"serving in {str(model.dtype).removeprefix('torch.')} (--dtype auto: the checkpoint's), "
                    f"{model.weight_layout} weight layout"
                )
                with BackgroundServer(serving.app) as server:
                    print(f"{config.adapters} adapters on the local hub {hub.endpoint}; server at {server.url}")
                    code = _drive(config, server.url, ids)
            finally:
                serving.close()
    print(f"\ndemo wall time {time.perf_counter() - start:.1f}s")
    return code


def _drive(config: DemoConfig, url: str, ids: list[str]) -> int:
    client = ServerClient(url)
    start = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        registered = list(_bar(pool.map(client.register, ids), "adapters registered", total=len(ids)))
    downloaded = sum(a["bytes"] for a in registered)
    print(
        f"registered {len(registered)} adapters by hub id through POST /v1/adapters in "
        f"{time.perf_counter() - start:.1f}s ({downloaded / _MB:.0f} MB prepared on the host)"
    )

    rng = random.Random(config.seed)
    weights = 1.0 / np.arange(1, len(ids) + 1) ** config.zipf_alpha
    picks = rng.choices(ids, weights=weights.tolist(), k=config.requests)
    prompts = [f"Request {i}: a short note on {rng.choice(_TOPICS)}." for i in range(config.requests)]
    latencies: list[float] = []
    failures: list[str] = []
    generated = 0

    def one(i: int) -> None:
        nonlocal generated
        begin = time.perf_counter()
        try:
            answer = client.complete(picks[i], prompts[i], config.max_tokens, temperature=0.0, ignore_eos=True)
        except ServerError as err:
            failures.append(f"{picks[i]}: {err}")
            return
        latencies.append(time.perf_counter() - begin)
        generated += answer["usage"]["completion_tokens"]

    print(
        f"sending {config.requests} requests, Zipf({config.zipf_alpha}) over {len(ids)} adapters, "
        f"{config.clients} concurrent clients, {config.slots} slots, max_tokens {config.max_tokens} ...",
        flush=True,
    )
    start = time.perf_counter()
    with ThreadPoolExecutor(config.clients) as pool:
        sent = [pool.submit(one, i) for i in range(config.requests)]
        for done in _bar(as_completed(sent), "requests answered", total=len(sent)):
            done.result()
    wall = time.perf_counter() - start
    snapshot = client.swaps()
    _print_table(config, snapshot, wall, latencies, generated, len(set(picks)))
    for failure in failures[:5]:
        print(f"failed: {failure}")
    return 0 if not failures else 1


def _bar(items: Iterable[_T], what: str, total: int | None = None) -> Iterator[_T]:
    """``items``, counted by a progress bar on stderr where it is a terminal (none in a pipe or a log), gone once
    done."""
    return iter(tqdm(items, desc=what, total=total, unit="", leave=False, disable=None))


def _print_table(config: DemoConfig, snapshot: dict, wall: float, latencies: list[float], tokens: int, used: int):
    done = len(latencies)
    p50, p95, p99 = np.percentile(latencies, [50, 95, 99]).tolist() if latencies else (0.0, 0.0, 0.0)
    print()
    print(f"{'requests':22}{done:>10d} ok, {config.requests - done} failed, {used} distinct adapters used")
    print(f"{'throughput':22}{done / wall:>10.1f} req/s   {tokens / wall:8.1f} generated tok/s   ({wall:.1f}s)")
    print(f"{'request latency':22}{'':>10} p50 {p50 * 1e3:7.1f} ms   p95 {p95 * 1e3:7.1f} ms   p99 {p99 * 1e3:7.1f} ms")
    for tier in ("slot", "host"):
        hits, misses = snapshot["hits"].get(tier, 0), snapshot["misses"].get(tier, 0)
        rate = snapshot["hit_rates"].get(tier, 0.0)
        evictions = snapshot["evictions"].get(tier, 0)
        print(f"{tier + ' tier':22}{rate:>10.1%} hits   ({hits} hits, {misses} misses, {evictions} evictions)")
    wait = snapshot.get("stall")
    if wait:
        print(
            f"{'stall':22}{wait['total_seconds']:>9.2f}s total over {wait['count']} steps "
            f"({wait['total_seconds'] / wall:.1%} of wall, target <= 1%)   p50 {wait['p50_s'] * 1e3:.2f} ms   "
            f"p99 {wait['p99_s'] * 1e3:.2f} ms   max {wait['max_s'] * 1e3:.2f} ms"
        )
    wait = snapshot.get("adapter_wait")
    if wait:
        print(
            f"{'adapter wait':22}{wait['count']:>10d} requests   p50 {wait['p50_s'] * 1e3:.2f} ms   "
            f"p99 {wait['p99_s'] * 1e3:.2f} ms   max {wait['max_s'] * 1e3:.2f} ms   (submit -> adapter ready, alone)"
        )
    moves = snapshot["moves"]
    downloads = moves.get("hub_to_disk", {}).get("count", 0)
    preparations = moves.get("disk_to_host", {}).get("count", 0)
    per = max(done, 1)
    print(f"{'per request':22}{downloads / per:>10.3f} downloads   {preparations / per:.3f} preparations")
    print(
        f"\n{'swap latency by move':22}{'moves':>7} {'MB':>9} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'max ms':>8}"
    )
    for move in ("hub_to_disk", "disk_to_host", "host_to_slot"):
        s = snapshot["moves"].get(move)
        if s is None:
            continue
        ms = " ".join(f"{s[k] * 1e3:8.2f}" for k in ("p50_s", "p95_s", "p99_s", "max_s"))
        print(f"{move:22}{s['count']:>7d} {s['total_bytes'] / _MB:9.1f} {ms}")
