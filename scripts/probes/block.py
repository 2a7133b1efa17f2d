#!/usr/bin/env python3
"""One transformer block's LoRA overhead with the fused shrink of q/k/v and gate/up, against one shrink per part.

The block's seven projections (wqkv, wo, w13, w2) as LoRALinear runs them on a real SlotPool of the bench
model, 8 rank-16 adapters with the batch ordered by adapter, at T = 16, 512, 2048: LoRA % of the base matmul, fused
vs per-part, beside the floor = max(LoRA FLOPs / base FLOPs, LoRA weight bytes of the distinct adapters / base weight
bytes); target fused <= 1.5 x floor. wo and w2 run the same code in both columns: their gap is the noise. Prints a
table and writes out/bench_block.json.

    .venv/bin/python -m scripts.probes.block [--quick]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from adapter_manager import ModuleKey, RowOptions
from adapter_manager.base_model import BaseModelSpec
from adapter_manager.kernels import LinearStep, LoRAKernelMeta, layer_kernels, select_backend
from adapter_manager.runtime.model.projection import LoRALinear
from adapter_manager.tiers.slot_pool import SlotPool, SlotPoolConfig
from scripts.harness import samples_ms, write_json

BLOCK_LINEARS = {
    "wqkv": ("q_proj", "k_proj", "v_proj"),
    "wo": ("o_proj",),
    "w13": ("gate_proj", "up_proj"),
    "w2": ("down_proj",),
}
BLOCK_COLUMNS = {
    "base_ms": " base ms",
    "unfused_pct": "unfused %",
    "fused_pct": " fused %",
    "flops_pct": "flops %",
    "bytes_pct": "bytes %",
    "floor_pct": "floor %",
    "fused_over_floor": "fused/floor",
}
BLOCK_LIMIT = 1.5
"""Target: a layer's LoRA cost <= this many times its floor."""


def _call(linear: LoRALinear, x: torch.Tensor, meta: LoRAKernelMeta | None, fuse: bool) -> Callable[[], object]:
    """``linear(x, step)`` as the model calls it, with the fused shrink allowed or not."""
    step = LinearStep.make(meta, layer_kernels(x.device), fast=False)

    def call() -> object:
        linear.fuse_shrink = fuse
        return linear(x, step)

    return call


def block_figure(quick: bool) -> list[dict]:
    """One block's seven projections as the model runs them: LoRALinear on a real SlotPool of the bench model
    (8 rank-16 adapters, T/8 tokens each, the batch ordered by adapter), the fused shrink (wqkv, w13) against the
    per-part one (``fuse_shrink=False``).

    ``lora %`` = (layer - base matmul) / base matmul: the median over interleaved repeats of each repeat's
    difference (the two timed back to back), over the median base. Floor = max(LoRA FLOPs / base
    FLOPs, LoRA weight bytes of the step's k distinct adapters / base weight bytes); per layer of P parts:
    FLOPs ratio = r·(P·in + Σout) / (in·Σout), bytes ratio = k × that. The block row sums the four layers.
    """
    spec, rank = BaseModelSpec.bench(), 16
    pool = SlotPool(spec, SlotPoolConfig(max_slots=8, rows=RowOptions(max_rank=rank)))
    gen = torch.Generator().manual_seed(0)
    pool.rows.copy_(torch.randn(pool.rows.shape, generator=gen) * 0.01)  # stale rows hold garbage too
    pool.rows[-1] = 0
    active = list(range(0, pool.num_slots, pool.units_for(rank)))  # 8 adapters of rank 16
    linears: dict[str, LoRALinear] = {}
    for name, projs in BLOCK_LINEARS.items():
        outs = tuple(spec.projection_shape(proj)[1] for proj in projs)
        linear = LoRALinear(spec.projection_shape(projs[0])[0], outs).requires_grad_(False)
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) * 0.02)
        for part, proj in enumerate(projs):
            linear.attach(part, pool.stacks[ModuleKey(0, proj)])
        linears[name] = linear
    print(
        f"\nblock figure: one block of the bench model ({spec.hidden_size} -> {spec.intermediate_size}, "
        f"{spec.num_heads} heads, {spec.num_kv_heads} KV), {len(active)} adapters R={rank}, sorted mix; LoRA % of the "
        f"base matmul, fused vs per-part shrink; floor = max(flops, bytes of the distinct adapters)"
    )
    print(f"{'T':>5} {'layer':>6} {'form':>8} " + " ".join(BLOCK_COLUMNS.values()))
    rows = []
    for tokens in (16, 512, 2048):
        meta = LoRAKernelMeta.make(select_backend("cpu"), pool.num_slots, rank, tokens, "cpu", granule=pool.granule)
        sorted_mix = torch.tensor(active, dtype=torch.int32)[torch.arange(tokens) * len(active) // tokens]
        meta.prepare(sorted_mix, dict.fromkeys(active, rank))  # T/8 tokens per adapter, ordered by adapter
        inputs = [torch.randn(tokens, linear.in_features, generator=gen) for linear in linears.values()]
        # every layer's base, then every layer's unfused, then fused: three other layers run between two calls of
        # one layer, so neither variant finds the other's LoRA rows in the caches
        calls = [
            _call(linear, x, step_meta, fuse)
            for step_meta, fuse in ((None, True), (meta, False), (meta, True))
            for linear, x in zip(linears.values(), inputs, strict=True)
        ]
        repeats = {16: 150, 512: 40, 2048: 16}[tokens] * (1 if quick else 3)
        with torch.no_grad():
            times = samples_ms(calls, repeats)
        sums = [0.0] * 5  # base ms, unfused ms, fused ms, LoRA and base multiply-adds per token
        for i, (name, linear) in enumerate(linears.items()):
            base_times, variants = times[i], (times[i + len(linears)], times[i + 2 * len(linears)])
            lora = [statistics.median(a - b for a, b in zip(v, base_times, strict=True)) for v in variants]
            base, unfused, fused = statistics.median(base_times), *lora
            lora_macs = rank * (len(linear.out_features) * linear.in_features + sum(linear.out_features))
            costs = (base, unfused, fused, lora_macs, linear.in_features * sum(linear.out_features))
            sums = [a + b for a, b in zip(sums, costs, strict=True)]
            rows.append(_block_row(tokens, name, meta, *costs))
        rows.append(_block_row(tokens, "block", meta, *sums))
    print(f"target: fused <= {BLOCK_LIMIT} x floor at every T ({'met' if all(r['met'] for r in rows) else 'NOT met'})")
    return rows


def _block_row(
    tokens: int, name: str, meta: LoRAKernelMeta, base: float, unfused: float, fused: float, lora: float, full: float
) -> dict:
    """Print and return one row. ``lora`` / ``full``: multiply-adds per token of one adapter / of the base (each
    weight element is read once: the same ratio for bytes, times the step's distinct adapters)."""
    flops_pct, bytes_pct = 100 * lora / full, 100 * lora * meta.num_active / full
    floor, fused_pct = max(flops_pct, bytes_pct), 100 * fused / base
    values = (base, 100 * unfused / base, fused_pct, flops_pct, bytes_pct, floor, fused_pct / floor)
    assert meta.form is not None
    row = {"tokens": tokens, "layer": name, "form": meta.form.value}
    row |= {key: round(value, 4) for key, value in zip(BLOCK_COLUMNS, values, strict=True)}
    cells = " ".join(f"{value:{len(title)}.3f}" for title, value in zip(BLOCK_COLUMNS.values(), values, strict=True))
    print(f"{tokens:5d} {name:>6} {row['form']:>8} {cells}", flush=True)
    return row | {"met": fused_pct <= BLOCK_LIMIT * floor}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--out", default="out/bench_block.json")
    args = parser.parse_args()
    rows = block_figure(args.quick)
    write_json(args.out, {"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}, indent=1)


if __name__ == "__main__":
    main()
