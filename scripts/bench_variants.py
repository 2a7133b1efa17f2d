#!/usr/bin/env python3
"""LoRA variants on the bench model: DoRA and LoRA-bias mixes beside the plain LoRA mix, each against its floor.

Measured side by side in one run (medians over --rounds, the mixes' order rotating each round), on the real engine:
- the decode step (``--seqs`` sequences, one token each, ``--context`` tokens of context): base (no adapter), then
  1 and 8 distinct rank-16 adapters of each variant (plain ``lora``, ``dora``, ``lora_bias``), on all seven
  projections; cost = step / base step - 1, against the decode floor: the active adapters' weight bytes, with a
  variant's vector rows (one value per output feature of every projection), ÷ the base weight bytes;
- prefill (``--seqs`` prompts of ``--prompt`` tokens, one generated token): cost = base time / mix time - 1, against
  the prefill floor (LoRA FLOPs, with the epilogue's one multiply-add per output feature, ÷ base FLOPs);
- each variant over plain LoRA at the same mix: what its vector epilogue adds, beside the floor of the vectors alone.

Target (issue 51, reported, never asserted): a DoRA decode step <= 1.25x its floor. Writes out/bench_variants.json.

  .venv/bin/python -m scripts.bench_variants [--rounds 5] [--seqs 8] [--context 144] [--steps 24] [--prompt 256]
      [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from adapter_manager.runtime.engine.sampling import SamplingParams
from scripts.harness import RANK, cpu_model, decode_floor, engine_step_ms, engine_workload, prefill_floor, write_json

VARIANTS = {"lora": "a", "dora": "d", "lora_bias": "b"}  # variant -> the id prefix of its 8 adapters
MIXES = ("base",) + tuple(f"{variant}_{k}" for variant in VARIANTS for k in (1, 8))


def adapters_of(mix: str, seqs: int) -> list[str | None]:
    """Each sequence's adapter: none for base; k distinct adapters of the variant spread evenly otherwise."""
    if mix == "base":
        return [None] * seqs
    variant, k = mix.rsplit("_", 1)
    return [f"{VARIANTS[variant]}{i % int(k)}" for i in range(seqs)]


def prefill_s(work, adapters: list[str | None], prompt: int, gen: torch.Generator) -> float:  # noqa: ANN001
    """Seconds to prefill one ``prompt``-token prompt per adapter entry (one token generated each), in one engine."""
    engine = work.engine(len(adapters), prompt + 4)
    prompts = [torch.randint(0, work.config.vocab_size, (prompt,), generator=gen).tolist() for _ in adapters]
    engine.submit(prompts[0], adapters[0], SamplingParams(max_tokens=1))  # adapters loaded, kernels warm
    engine.run_until_idle(max_steps=1000)
    start = time.perf_counter()
    for tokens, adapter in zip(prompts, adapters, strict=True):
        engine.submit(tokens, adapter, SamplingParams(max_tokens=1, ignore_eos=True))
    engine.run_until_idle(max_steps=1000)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--context", type=int, default=144)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path, default=Path("out/bench_variants.json"))
    args = parser.parse_args()
    decode: dict[str, list[float]] = {mix: [] for mix in MIXES}
    prefill: dict[str, list[float]] = {mix: [] for mix in MIXES}
    variants = {prefix: variant for variant, prefix in VARIANTS.items() if variant != "lora"}
    with engine_workload(getattr(torch, args.dtype), "cpu", variants=variants) as work:
        config, gen = work.config, torch.Generator().manual_seed(0)
        for mix in MIXES:  # every adapter prepared (DoRA's scales from the model's weights) and loaded once
            engine_step_ms(work, adapters_of(mix, args.seqs), args.context, 2)
        for round_ in range(args.rounds):
            for mix in MIXES[round_ % len(MIXES) :] + MIXES[: round_ % len(MIXES)]:
                adapters = adapters_of(mix, args.seqs)
                decode[mix].append(engine_step_ms(work, adapters, args.context, args.steps)["step_ms"])
                prefill[mix].append(prefill_s(work, adapters, args.prompt, gen))
    step = {mix: statistics.median(v) for mix, v in decode.items()}
    fill = {mix: statistics.median(v) for mix, v in prefill.items()}
    print(f"CPU: {cpu_model()}; {args.dtype}; {args.seqs} sequences, context {args.context}, rank {RANK}, 7 modules")
    print(f"base: decode step {step['base']:.2f} ms, prefill {args.seqs} x {args.prompt} tokens {fill['base']:.3f} s")
    rows = {}
    for mix in MIXES[1:]:
        variant, k = mix.rsplit("_", 1)
        vectors = variant != "lora"
        floor = decode_floor(config, RANK, int(k), vectors)
        cost = step[mix] / step["base"] - 1
        p_floor = prefill_floor(config, RANK, args.prompt, vectors)
        p_cost = fill[mix] / fill["base"] - 1
        row = {
            "decode_step_ms": round(step[mix], 3),
            "decode_cost_pct": round(100 * cost, 2),
            "decode_floor_pct": round(100 * floor, 2),
            "decode_x_floor": round(cost / floor, 2),
            "prefill_cost_pct": round(100 * p_cost, 2),
            "prefill_floor_pct": round(100 * p_floor, 2),
            "prefill_x_floor": round(p_cost / p_floor, 2),
        }
        line = (
            f"{mix:12s} decode {step[mix]:7.2f} ms {100 * cost:+6.1f} % (floor {100 * floor:4.1f} %, "
            f"{cost / floor:.2f}x) | prefill {100 * p_cost:+6.1f} % (floor {100 * p_floor:4.1f} %, "
            f"{p_cost / p_floor:.2f}x)"
        )
        if vectors:  # what the epilogue adds over plain LoRA at the same mix, beside the vectors' own bytes
            plain = f"lora_{k}"
            extra, extra_floor = step[mix] / step[plain] - 1, floor - decode_floor(config, RANK, int(k))
            row["over_plain_decode_pct"] = round(100 * extra, 2)
            row["vector_floor_pct"] = round(100 * extra_floor, 3)
            line += f" | over {plain}: decode {100 * extra:+.2f} % (vectors' floor {100 * extra_floor:.2f} %)"
        rows[mix] = row
        print(line + ("  [target <= 1.25x floor]" if variant == "dora" else ""), flush=True)
    spread = {mix: round(100 * (max(v) - min(v)) / statistics.median(v), 1) for mix, v in decode.items()}
    result = {"cpu": cpu_model(), "dtype": args.dtype, "seqs": args.seqs, "context": args.context, "rank": RANK}
    result.update(prompt=args.prompt, rounds=args.rounds, base_step_ms=round(step["base"], 3), rows=rows)
    result["decode_spread_pct"] = spread
    write_json(args.out, result)


if __name__ == "__main__":
    main()
