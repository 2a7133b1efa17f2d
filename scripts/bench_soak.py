#!/usr/bin/env python3
"""Soak: our server over a 10,000-adapter population for --minutes at 1.5x its saturated throughput, with admin
churn, cancelled streams and malformed requests mixed in; every answer checked.

Population (written once into --cache/population, hard links for the shared weights; its write time printed): N
(--adapters) rank-8 adapters on q_proj / v_proj (K weight files x lora_alpha variants: every one distinct) plus 64
rank-16 adapters on all seven projections, served by the local hub on loopback (HF_ENDPOINT). The server: the bench
checkpoint, a --pool-mib row pool, a --host-mib host tier, --state-dir, a disk bound of --disk-fraction of the
population's bytes, --max-pending.

1. Registration: every adapter through ``POST /v1/adapters`` (--in-flight at a time), timed; the RSS it cost per
   adapter; /v1/models and /v1/adapters latency with every entry; a restart on the same state directory, timed
   beside the first start (empty state).
2. Saturation, --rounds times (each on a server just restarted, so cold; each round's Zipf ranking its own): one
   burst (--burst requests at once) on the population, then the same draws mapped onto adapters pinned in the pool
   (all-resident): throughput ratio, the median round's against the target >= 95 %. The soak: Poisson arrivals at
   --load x the population's burst throughput (the rounds' median); prompts 16-128 random tokens, 8-32 output
   tokens (greedy, ignore_eos), Zipf(1) over the population ranked at random, 10 % base model, 20 % non-streamed,
   5 % streams closed after two chunks; beside it the admin churn (scripts/harness/soak_churn.py), a malformed
   request a second, the server's RSS and threads every 2 s.
3. Checks (PASS / FAIL with counts): every request answered (result, typed 4xx or 503; never a connection error,
   5xx or hang); no stale 'not registered'; a sample of greedy answers (--sample; every churn probe, every answer
   sent after a refresh of its adapter returned or overlapping a change of it, then random ones) equal to their
   replay on an idle server with --no-prefix-caching, text and logprobs (an answer that overlapped a change of its
   adapter may equal either version); KV blocks all free and registrations exactly as the churn left them once the
   load stopped; RSS and threads flat within 5 % after warm-up (the later of 20 % of the run, at most 2 min, and the
   host tier full); saturated throughput >= 95 % of all-resident. Reported beside them: TTFT p99 of admitted
   requests. The run's state directory, HF caches and logs are removed at the end; the population and the model too
   unless --keep-population.

  .venv/bin/python -m scripts.bench_soak --quick                    # 500 adapters, 1 minute
  .venv/bin/python -m scripts.bench_soak [--minutes 10] [--adapters 10000] [--keep-population]
  .venv/bin/python -m scripts.bench_soak --profile-heap ...     # + the soak server's heap: what grows after warm-up

With --profile-heap the soak's server traces its allocations (tracemalloc, --heap-frames frames) and reports its
malloc arenas and tensors at the soak's start, every --heap-every seconds and once the load stopped
(scripts/harness/soak_heap.py); the snapshots stay in <--out without .json>-heap/, the diff goes into the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from adapter_manager import LocalHub
from adapter_manager.runtime.model.config import LlamaConfig
from adapter_manager.runtime.model.tokenizer import write_byte_level_tokenizer
from scripts.harness import cpu_model, write_checkpoint, write_json
from scripts.harness.serving import Server
from scripts.harness.soak_checks import (
    Check,
    admin_json,
    drained,
    proc_status,
    prometheus,
    replay,
    replay_checks,
    sample,
)
from scripts.harness.soak_churn import Churn
from scripts.harness.soak_client import Malformed, open_loop
from scripts.harness.soak_heap import HeapProbe, heap_env, print_heap
from scripts.harness.soak_population import Population
from scripts.harness.soak_registrations import Registrations, Version
from scripts.harness.soak_report import print_table, soak_summary
from scripts.harness.soak_server import (
    BASE,
    RssLimitError,
    mem_total,
    options,
    register_all,
    registered,
    route_ms,
    rss_guard,
    server_env,
    start,
)
from scripts.harness.soak_trace import TraceShape, draw, poisson, requests, zipf_order

VOCAB = LlamaConfig.bench().vocab_size
HOST_TIER = "adapter_manager_host_tier_used_bytes"
_MIB = 1 << 20


def warm(url: str) -> None:
    """Two base-model requests, so a process measured next has served once."""
    burst(url, draw(2, 1, TraceShape(base_share=1.0), 0), lambda p: BASE, "warm", 60)


def burst(url: str, draws, model_of, salt: str, hang_s: float) -> dict:
    """The draws sent all at once (nothing cancelled): requests/s answered whole."""
    answers = requests(draws, model_of, VOCAB, salt, [0.0] * len(draws), cancel=False)
    span = open_loop(url, answers, hang_s)
    ok = sum(a.outcome == "ok" for a in answers)
    return {"requests": len(answers), "ok": ok, "span_s": span, "req_per_s": ok / span, "failed": len(answers) - ok}


def resident_burst(url: str, draws, order: list[str], population: Population, salt: str, hang_s: float) -> dict:
    """The same draws mapped onto adapters pinned in the pool: the used ones, rank 16 first then by popularity,
    pinned until the pool is full; a pick not pinned goes to a pinned adapter of its rank. Unpinned after."""
    used = sorted({int(p) for p in draws.pick if p >= 0}, key=lambda p: (-population.rank(order[p]), p))
    pinned: list[int] = []
    for p in used:
        if asyncio.run(admin_json(url, "POST", f"/v1/adapters/{order[p]}/pin")).status != 200:
            break
        pinned.append(p)
    by_rank = {r: [p for p in pinned if population.rank(order[p]) == r] for r in (8, 16)}

    def model_of(p: int) -> str:
        if p < 0:
            return BASE
        if p in pinned:
            return order[p]
        same = by_rank[population.rank(order[p])] or pinned
        return order[same[p % len(same)]]

    try:
        row = burst(url, draws, model_of, salt, hang_s)
    finally:
        for p in pinned:
            asyncio.run(admin_json(url, "POST", f"/v1/adapters/{order[p]}/unpin"))
    row.update(pinned=len(pinned), used=len(used))
    return row


def saturation_round(url: str, ids: list[str], population: Population, args, k: int) -> dict:
    """Round k of the saturation pair on a server just (re)started: --burst requests at once over the population
    (cold: every adapter it uses comes up the tiers, those past the disk bound from the hub), then the same draws on
    pinned adapters. Round k ranks the population with its own seed, so its adapters are mostly not round 0's (which
    later rounds would otherwise find on disk); round 0 is the soak's own ranking."""
    order = zipf_order(ids, args.seed + 1000 * k)
    sat = draw(args.burst, len(ids), TraceShape(), args.seed + 1 + 1000 * k)
    cold = burst(url, sat, lambda p: BASE if p < 0 else order[p], f"saturation-{k}", args.hang_s)
    resident = resident_burst(url, sat, order, population, f"saturation-resident-{k}", args.hang_s)
    ratio = cold["req_per_s"] / resident["req_per_s"]
    print(
        f"saturation round {k + 1}/{args.rounds}: {cold['req_per_s']:.2f} req/s (population), "
        f"{resident['req_per_s']:.2f} (all-resident, {resident['pinned']} of {resident['used']} used pinned): "
        f"{100 * ratio:.1f} %",
        flush=True,
    )
    return {"population": cold, "resident": resident, "ratio": ratio}


def register_phase(server: Server, ids: list[str], in_flight: int, rss_limit: int, result: dict) -> Registrations:
    """Every adapter registered through the admin API: time, RSS per adapter, the list routes' latency."""
    warm(server.url)
    rss_empty = proc_status(server.proc.pid)[0]
    calls, result["register_s"] = register_all(server.url, ids, in_flight, rss_guard(server, rss_limit))
    rss_registered = proc_status(server.proc.pid)[0]
    host_used = prometheus(server.url).get(HOST_TIER, 0.0)
    result["register_failed"] = {a: str(c.data)[:200] for a, c in calls.items() if c.status != 201}
    result["models_ms"], result["models_entries"] = route_ms(server.url, "/v1/models")
    result["adapters_ms"], result["adapters_entries"] = route_ms(server.url, "/v1/adapters")
    result["rss"] = {"empty": rss_empty, "registered": rss_registered, "host_tier_used": host_used}
    result["rss_per_adapter"] = (rss_registered - rss_empty) / len(ids)
    result["rss_per_adapter_less_host_tier"] = (rss_registered - rss_empty - host_used) / len(ids)
    model = Registrations()
    for adapter, (sha, digest) in registered(calls).items():
        model.register(adapter, Version(adapter, 0, sha), digest)
    print(
        f"registered {len(model.current)}/{len(ids)} in {result['register_s']:.1f} s "
        f"({1000 * result['register_s'] / len(ids):.1f} ms each, {in_flight} in flight)",
        flush=True,
    )
    return model


def soak(args, server: Server, population: Population, model: Registrations, order: list[str], rate: float, result):
    """The open loop at `rate` for --minutes with the churn, malformed requests and the process sampler beside it;
    then, the load stopped, the KV blocks and the registrations. Returns every answer (probes too) and the checks."""
    n = max(1, int(rate * args.minutes * 60))
    draws = draw(n, len(order), TraceShape(), args.seed + 2)
    answers = requests(draws, lambda p: BASE if p < 0 else order[p], VOCAB, "soak", poisson(n, rate, args.seed + 3))
    hot = [a for a in order if a.startswith("soak/s")][2:26]
    churn = Churn(server.url, population, model, hot, VOCAB, args.churn_every, args.hang_s, args.seed)
    malformed = Malformed(server.url, BASE, args.max_seq_len)
    series: list[tuple[float, int, int, float]] = []  # (seconds, RSS, threads, host tier bytes: every 10 s)
    began = time.perf_counter()

    def record(host: float) -> None:
        series.append((time.perf_counter() - began, *proc_status(server.proc.pid), host))

    guard = rss_guard(server, args.rss_limit)
    heap = HeapProbe(server.url, args.heap_every) if args.profile_heap else None
    sides = [churn.run, malformed.run]
    if heap is not None:
        heap.begin()
        sides.append(heap.run)

    async def sampler(session, stop: asyncio.Event) -> None:
        host = 0.0
        while not stop.is_set():
            await asyncio.to_thread(guard)  # past the limit: the server stops, the rest fails fast, this raises
            if len(series) % 5 == 0:
                host = (await asyncio.to_thread(prometheus, server.url)).get(HOST_TIER, 0.0)
            record(host)
            try:
                await asyncio.wait_for(stop.wait(), 2.0)
            except TimeoutError:
                pass

    span = open_loop(server.url, answers, args.hang_s, [*sides, sampler])
    kv = drained(server.url)
    record(prometheus(server.url).get(HOST_TIER, 0.0))
    if heap is not None:
        heap.take("end", trim=True)
    listing = asyncio.run(admin_json(server.url, "GET", "/v1/adapters")).data
    full = next((row[0] for row in series if row[3] >= 0.95 * args.host_mib * _MIB), 0.0)
    warm_s = min(max(min(120.0, args.minutes * 20), full), args.minutes * 30)  # the host tier full, at most half-way
    figures, checks = soak_summary(answers, churn, malformed, series, span, kv, listing, model, BASE, warm_s)
    result["soak"] = {**figures, "offered_req_s": n / answers[-1].at, "rate_req_s": rate}
    if heap is not None:
        result["heap"] = heap.report(warm_s)
        print_heap(result["heap"])
    return [*answers, *churn.probes], checks


def heap_folder(args) -> Path:
    """Where --profile-heap's snapshots go: beside --out, kept."""
    return args.out.with_name(f"{args.out.stem}-heap").resolve()


def run(args, cache: Path, work: Path, population: Population, result: dict) -> list[Check]:
    config = LlamaConfig.bench()
    result["population_write_s"] = population.write()
    checkpoint = write_checkpoint(cache / "model", config, reuse=True).resolve()
    write_byte_level_tokenizer(checkpoint, config)  # as serve --random does: ids decode to text
    ids = population.ids
    total = population.disk_bytes()
    result.update(adapters=len(ids), population_bytes=total, disk_bound_bytes=int(args.disk_fraction * total))
    print(
        f"CPU: {cpu_model()}; population {args.adapters} rank-8 (q,v) + 64 rank-16 (all 7) adapters, "
        f"{total / 2**30:.2f} GiB, written in {result['population_write_s']:.1f} s (what was missing)",
        flush=True,
    )
    with LocalHub(population.hub) as hub:
        env = server_env(hub.endpoint, work / "hf-cache")
        soak_options = options(args, state_dir=work / "state", disk_bytes=result["disk_bound_bytes"])
        server, result["start_empty_s"] = start("soak", checkpoint, soak_options, work / "soak-1.log", env)
        try:
            model = register_phase(server, ids, args.in_flight, args.rss_limit, result)
        finally:
            server.stop()
        hub.clear_requests()

        soak_env = heap_env(env, heap_folder(args), args.heap_frames) if args.profile_heap else env
        server, result["restart_s"] = start("soak", checkpoint, soak_options, work / "soak-2.log", soak_env)
        try:
            listing = asyncio.run(admin_json(server.url, "GET", "/v1/adapters")).data
            warm(server.url)
            result["restored"] = sum(a.get("status") != "unrestorable" for a in listing["data"])
            result["rss"]["restored"] = proc_status(server.proc.pid)[0]
            result["rss_per_adapter_restored"] = (result["rss"]["restored"] - result["rss"]["empty"]) / len(ids)
            print(f"restart: {result['restored']} restored, serving after {result['restart_s']:.1f} s", flush=True)
            rounds = []
            for k in range(args.rounds):
                if k:  # each round starts cold: a restart empties the pool and the host tier
                    server.stop()
                    server, _ = start("soak", checkpoint, soak_options, work / f"soak-2-round{k}.log", soak_env)
                    warm(server.url)
                rounds.append(saturation_round(server.url, ids, population, args, k))
            result["saturation_rounds"] = rounds
            middle = sorted(rounds, key=lambda r: r["ratio"])[len(rounds) // 2]  # the median round
            result["saturated"], result["resident"] = middle["population"], middle["resident"]
            result["saturated_ratio"] = middle["ratio"]
            population_rate = statistics.median(r["population"]["req_per_s"] for r in rounds)
            rate = result["soak_rate_req_s"] = args.load * population_rate
            print(f"soak at {rate:.2f} req/s for {args.minutes:g} min", flush=True)
            order = zipf_order(ids, args.seed)
            answers, checks = soak(args, server, population, model, order, rate, result)
        finally:
            server.stop()
        ratio = result["saturated_ratio"]
        checks.append(Check("saturated throughput >= 95 % of all-resident", ratio >= 0.95, f"{100 * ratio:.1f} %"))

        chosen = sample(answers, model, BASE, args.sample, args.seed)
        replay_env = server_env(hub.endpoint, work / "hf-replay")
        server, _ = start("replay", checkpoint, options(args, prefix=False), work / "replay.log", replay_env)
        try:
            replayed = replay(server.url, BASE, population, chosen, args.hang_s, args.logprob_tol)
        finally:
            server.stop()
    result["replay"], more = replay_checks(replayed)
    return checks + more


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="defaults for a smoke run: 500 adapters, 1 minute")
    parser.add_argument("--minutes", type=float, default=None, help="the soak (10; --quick 1)")
    parser.add_argument("--adapters", type=int, default=None, help="N rank-8 adapters, plus 64 rank-16 (10000; 500)")
    parser.add_argument("--load", type=float, default=1.5, help="soak arrival rate / the burst's throughput")
    parser.add_argument("--burst", type=int, default=None, help="requests of each saturation burst (128; 48)")
    parser.add_argument("--rounds", type=int, default=3, help="saturation pairs (restart, cold burst, pinned burst)")
    parser.add_argument("--in-flight", type=int, default=8, help="registration calls at once")
    parser.add_argument("--churn-every", type=float, default=2.0, help="seconds between admin operations")
    parser.add_argument("--sample", type=int, default=None, help="answers replayed on the idle server (300; 120)")
    parser.add_argument("--pool-mib", type=int, default=256)
    parser.add_argument("--host-mib", type=int, default=512)
    parser.add_argument("--disk-fraction", type=float, default=0.25, help="disk bound / the population's bytes")
    parser.add_argument("--max-pending", type=int, default=None, help="requests in flight before 503 (128; 48)")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--hang-s", type=float, default=300.0, help="an answer not ended by then is a hang")
    parser.add_argument("--logprob-tol", type=float, default=1e-3, help="an answer equals its replay within this")
    parser.add_argument("--rss-limit-gib", type=float, default=None, help="stop if the server passes (60 %% of RAM)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", type=Path, default=Path("out/bench_soak"), help="population and model (reused)")
    parser.add_argument("--keep-population", action="store_true", help="keep the population and model for next time")
    parser.add_argument("--out", type=Path, default=Path("out/bench_soak.json"))
    parser.add_argument("--profile-heap", action="store_true", help="the soak server's heap: what grows (see above)")
    parser.add_argument("--heap-every", type=float, default=60.0, help="seconds between heap shots")
    parser.add_argument("--heap-frames", type=int, default=1, help="frames kept per traced allocation")
    args = parser.parse_args()
    defaults = {"minutes": (10.0, 1.0), "adapters": (10_000, 500), "burst": (128, 48), "max_pending": (128, 48)}
    for name, (full, quick) in {**defaults, "sample": (300, 120)}.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.rss_limit = int(args.rss_limit_gib * 2**30) if args.rss_limit_gib else int(0.6 * mem_total())
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.burst > args.max_pending:
        parser.error(f"--burst ({args.burst}) must not exceed --max-pending ({args.max_pending}): a burst is admitted")
    started = time.perf_counter()
    cache = args.cache.resolve()
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=cache))  # state, HF caches, server logs
    population = Population(
        cache / "population", LlamaConfig.bench().to_spec("adapter-manager/bench-llama"), args.adapters
    )
    result: dict = {
        "cpu": cpu_model(),
        "command": " ".join([sys.executable, "-m", "scripts.bench_soak", *sys.argv[1:]]),
    }
    result["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    try:
        checks = run(args, cache, work, population, result)
    except BaseException as err:
        for log in sorted(work.glob("*.log")):
            print(f"--- {log.name} (last 3000 characters)\n{log.read_text()[-3000:]}", file=sys.stderr)
        if isinstance(err, RssLimitError):
            raise SystemExit(f"stopped: {err}") from None
        raise
    finally:
        population.revert()
        shutil.rmtree(work, ignore_errors=True)
        if not args.keep_population:
            shutil.rmtree(cache / "population", ignore_errors=True)
            shutil.rmtree(cache / "model", ignore_errors=True)
            if not any(cache.iterdir()):
                cache.rmdir()
    result["checks"] = [vars(c) for c in checks]
    print_table(result, checks)
    result["wall_s"] = time.perf_counter() - started
    write_json(args.out, result, default=float, prefix=f"wall {result['wall_s']:.0f}s; ")


if __name__ == "__main__":
    main()
