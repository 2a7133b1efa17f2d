#!/usr/bin/env python3
"""LoRA variants on the bench model: DoRA, LoRA-bias, embedding + lm_head LoRA and trainable-token mixes beside the
plain LoRA mix, each against its floor.

Measured side by side in one run (medians over --rounds, the mixes' order rotating each round), on the real engine:
- the decode step (``--seqs`` sequences, one token each, ``--context`` tokens of context): base (no adapter), then
  1 and 8 distinct rank-16 adapters of each variant (plain ``lora``, ``dora``, ``lora_bias``; ``vocab``: LoRA on
  embed_tokens and lm_head too; ``tokens``: plain LoRA and 8 trainable tokens), on all seven projections; cost =
  step / base step - 1, against the decode floor: the active adapters' weight bytes, with a variant's vector rows
  (one value per output feature of every projection) and what the vocabulary modules must read (the token's column
  of the embedding A, the Bt rows, the head's A and Bt; the replaced rows), ÷ the base weight bytes;
- prefill (``--seqs`` prompts of ``--prompt`` tokens, one generated token): cost = base time / mix time - 1, against
  the prefill floor (LoRA FLOPs, with the epilogue's one multiply-add per output feature and the vocabulary modules'
  FLOPs, ÷ base FLOPs);
- the vector epilogue alone: one decode batch of 8 distinct adapters of the variant run through the engine's step
  runner with its vector rows named and without (the plain LoRA it is, minus the epilogue), alternating, same batch:
  the epilogue's share of the step beside the floor of the vectors' bytes alone.
Costs are each round's ratio to the base measured in that round, the median over rounds.

The vocab and tokens mixes need the pool's vocabulary columns (every row wider, every mix's pool); ``--no-vocab``
leaves them out, for the pool a server without them has. Target (issue 51, reported, never asserted): a DoRA decode
step <= 1.25x its floor. Writes out/bench_variants.json.

  .venv/bin/python -m scripts.bench_variants [--rounds 5] [--seqs 8] [--context 144] [--steps 24] [--prompt 256]
      [--dtype float32|bfloat16] [--no-vocab]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from adapter_manager.runtime.engine.sampling import SamplingParams
from scripts.harness import RANK, cpu_model, decode_floor, engine_step_ms, engine_workload, prefill_floor, write_json

VARIANTS = {"lora": "a", "dora": "d", "lora_bias": "b", "vocab": "v", "tokens": "t"}  # -> the id prefix of its 8
VECTORS = ("dora", "lora_bias")  # the variants with a vector row; "vocab" and "tokens" use the vocabulary columns


def adapters_of(mix: str, seqs: int) -> list[str | None]:
    """Each sequence's adapter: none for base; k distinct adapters of the variant spread evenly otherwise."""
    if mix == "base":
        return [None] * seqs
    variant, k = mix.rsplit("_", 1)
    return [f"{VARIANTS[variant]}{i % int(k)}" for i in range(seqs)]


def epilogue_ms(work, adapters: list[str | None], context: int, repeats: int) -> tuple[float, float, float]:  # noqa: ANN001
    """One decode step's forward (the step runner: metadata + model) with the step's vector rows named and without,
    ``repeats`` times each, alternating, on the same batch: (median with, median without, median of the paired
    ratios - 1)."""
    engine = work.engine(len(adapters), context + 16)
    gen = torch.Generator().manual_seed(2)
    for adapter in adapters:
        prompt = torch.randint(0, work.config.vocab_size, (context,), generator=gen).tolist()
        engine.submit(prompt, adapter, SamplingParams(max_tokens=8, ignore_eos=True))
    while any(r.in_prefill for r in engine._running) or engine._waiting:  # noqa: SLF001 - bench: reach decode
        engine.step()
    runner, step = engine._runner, {}  # noqa: SLF001 - bench: the step runner on one captured decode batch
    run = runner.run

    def grab(batch, slot_rows, slot_vectors=None):  # noqa: ANN001, ANN202
        step.update(batch=batch, rows=slot_rows, vectors=slot_vectors)
        return run(batch, slot_rows, slot_vectors)

    runner.run = grab
    engine.step()
    runner.run = run
    assert step["vectors"], "the decode batch has no adapter with a vector row"
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(repeats):
        for named in (True, False) if i % 2 else (False, True):
            start = time.perf_counter()
            run(step["batch"], step["rows"], step["vectors"] if named else None)
            times[named].append(time.perf_counter() - start)
    while engine.has_work:
        engine.step()
    ratios = [w / o - 1 for w, o in zip(times[True], times[False], strict=True)]
    return 1e3 * statistics.median(times[True]), 1e3 * statistics.median(times[False]), statistics.median(ratios)


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
    parser.add_argument("--epilogue-repeats", type=int, default=60)
    parser.add_argument(
        "--no-vocab", action="store_true", help="no vocab and tokens mixes: the pool without vocabulary columns"
    )
    args = parser.parse_args()
    kinds = [v for v in VARIANTS if not (args.no_vocab and v in ("vocab", "tokens"))]
    mixes = ("base",) + tuple(f"{variant}_{k}" for variant in kinds for k in (1, 8))
    decode: dict[str, list[float]] = {mix: [] for mix in mixes}
    prefill: dict[str, list[float]] = {mix: [] for mix in mixes}
    epilogue = {}
    variants = {VARIANTS[variant]: variant for variant in kinds if variant != "lora"}
    with engine_workload(getattr(torch, args.dtype), "cpu", variants=variants) as work:
        config, gen = work.config, torch.Generator().manual_seed(0)
        for mix in mixes:  # every adapter prepared (DoRA's scales from the model's weights) and loaded once
            engine_step_ms(work, adapters_of(mix, args.seqs), args.context, 2)
        for round_ in range(args.rounds):
            for mix in mixes[round_ % len(mixes) :] + mixes[: round_ % len(mixes)]:
                adapters = adapters_of(mix, args.seqs)
                decode[mix].append(engine_step_ms(work, adapters, args.context, args.steps)["step_ms"])
                prefill[mix].append(prefill_s(work, adapters, args.prompt, gen))
        for variant in VECTORS:
            epilogue[variant] = epilogue_ms(work, adapters_of(f"{variant}_8", 8), args.context, args.epilogue_repeats)
    step = {mix: statistics.median(v) for mix, v in decode.items()}
    fill = {mix: statistics.median(v) for mix, v in prefill.items()}
    cost_of = {
        mix: statistics.median(v / b - 1 for v, b in zip(decode[mix], decode["base"], strict=True)) for mix in mixes
    }
    fill_cost = {
        mix: statistics.median(v / b - 1 for v, b in zip(prefill[mix], prefill["base"], strict=True)) for mix in mixes
    }
    print(f"CPU: {cpu_model()}; {args.dtype}; {args.seqs} sequences, context {args.context}, rank {RANK}, 7 modules")
    print(f"base: decode step {step['base']:.2f} ms, prefill {args.seqs} x {args.prompt} tokens {fill['base']:.3f} s")
    rows = {}
    for mix in mixes[1:]:
        variant, k = mix.rsplit("_", 1)
        vectors, vocab = variant in VECTORS, variant if variant in ("vocab", "tokens") else None
        floor = decode_floor(config, RANK, int(k), vectors, vocab)
        cost = cost_of[mix]
        p_floor = prefill_floor(config, RANK, args.prompt, vectors, vocab)
        p_cost = fill_cost[mix]
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
        if vectors and k == "8":  # the epilogue alone, beside the floor of the vectors' own bytes
            with_ms, without_ms, extra = epilogue[variant]
            extra_floor = floor - decode_floor(config, RANK, int(k))
            row.update(epilogue_with_ms=round(with_ms, 3), epilogue_without_ms=round(without_ms, 3))
            row.update(epilogue_pct=round(100 * extra, 2), vector_floor_pct=round(100 * extra_floor, 3))
            line += f" | epilogue {100 * extra:+.2f} % of the forward (vectors' floor {100 * extra_floor:.2f} %)"
        rows[mix] = row
        print(line + ("  [target <= 1.25x floor]" if variant == "dora" else ""), flush=True)
    spread = {mix: round(100 * (max(v) - min(v)) / statistics.median(v), 1) for mix, v in decode.items()}
    result = {"cpu": cpu_model(), "dtype": args.dtype, "seqs": args.seqs, "context": args.context, "rank": RANK}
    result.update(prompt=args.prompt, rounds=args.rounds, base_step_ms=round(step["base"], 3), rows=rows)
    result["decode_spread_pct"] = spread
    write_json(args.out, result)


if __name__ == "__main__":
    main()
