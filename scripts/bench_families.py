#!/usr/bin/env python3
"""The served families' decode step against the Llama bench model's, with the same weight bytes, side by side.

Each family's bench-shaped checkpoint (hidden 1024, 8 layers, intermediate 2816, vocab 32000, 16 heads, 4 KV heads,
an untied head: the same weight bytes as the Llama bench model, plus Qwen2's q/k/v biases) is written by transformers,
loaded packed as ``serve`` loads it, and serves the workload's 8 rank-16 synthetic adapters. Decode steps of
``--seqs`` sequences at context ``--context`` (base, and lora_8: 8 distinct adapters) run round-robin across the
families in one run, with the read pass over the Llama weights (the bandwidth floor) and the fastest weight-matmul
chain (the reference); medians of ``--rounds`` rounds of ``--repeats`` steps.

Target (reported, never asserted): each family's step ≤ 1.10× the Llama step in the same configuration.
Writes out/bench_families.json.

  .venv/bin/python -m scripts.bench_families [--families qwen2,gemma] [--rounds 3] [--repeats 15]
"""

from __future__ import annotations

import json
import statistics
from contextlib import ExitStack
from pathlib import Path

import torch

from scripts.harness import References, StepSetup, cpu_features, engine_workload, interleaved_ms, write_json
from scripts.harness.workload import decode_step_parser

CONFIGS = ("base", "lora_8")
TARGET = 1.10


def main() -> None:
    parser = decode_step_parser(__doc__, "out/bench_families.json", repeats=15)
    parser.add_argument("--families", default="qwen2,gemma", help="compared with llama (comma-separated)")
    args = parser.parse_args()
    families = ["llama", *args.families.split(",")]
    results: dict[str, object] = {"args": {k: str(v) for k, v in vars(args).items()}, "cpu": cpu_features()}
    print(f"cpu: {results['cpu']}", flush=True)
    with ExitStack() as stack:
        works = {family: stack.enter_context(engine_workload(family=family)) for family in families}
        refs = References(works["llama"].load_model(pack_weights=False), args.seqs)
        setups = {f: StepSetup(w, w.model, args.seqs, args.context, args.seqs) for f, w in works.items()}
        fns = {f"{f}/{c}": setup.step_fn(c, None) for f, setup in setups.items() for c in CONFIGS}
        rounds = [interleaved_ms({**fns, **refs.decode}, args.repeats) for _ in range(args.rounds)]
        for setup in setups.values():
            setup.close()
    ms = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    matmul_ref = min(v for k, v in ms.items() if k.startswith("ref/") and k != "ref/read")
    results.update(decode_ms=ms, matmul_ref_ms=matmul_ref, read_pass_ms=ms["ref/read"])
    print(f"\ndecode step, {args.seqs} sequences at context {args.context} (ms, medians of {args.rounds} rounds)")
    print(f"  Llama's floors: read pass {ms['ref/read']:.1f} ms, fastest weight-matmul chain {matmul_ref:.1f} ms")
    ratios: dict[str, dict[str, float]] = {}
    for family in families:
        ratios[family] = {c: ms[f"{family}/{c}"] / ms[f"llama/{c}"] for c in CONFIGS}
        cells = "  ".join(
            f"{c} {ms[f'{family}/{c}']:6.1f} ms = {ratios[family][c]:.3f}x Llama's" for c in CONFIGS
        )
        base_vs_ref = ms[f"{family}/base"] / matmul_ref
        print(f"  {family:8s} {cells}  (base {base_vs_ref:.2f}x the matmul chain; target <= {TARGET:.2f}x Llama)")
    results["vs_llama"] = ratios
    write_json(Path(args.out), results)
    print(json.dumps({"vs_llama": ratios}))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
