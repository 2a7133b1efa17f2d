"""Shrink+expand microbenchmark on the eager torch backend: LoRA time as a percentage of the base matmul.

    python scripts/bench_kernels.py [--quick] [--shapes bench,llama8b] [--write-table] [--out out/bench_kernels.json]

Base and LoRA are timed side by side in one run (median of interleaved repeats). ``lora %`` is the in-layer cost: the
layer as runtime.LoRALinear runs it (shrink, expand writing the LoRA term, then one ``addmm_`` adding the base matmul)
minus the base matmul alone;
``alone %`` times shrink+expand by themselves, both over the base matmul. The metadata is prepared once per
step and shared by every layer, so its cost is reported separately (``meta %``), not inside the LoRA figure.
``--write-table`` also times the grouped and the laned forms per (S, R) and rewrites kernels/torch_dispatch.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import (  # noqa: E402
    DispatchEntry,
    KernelConfig,
    LoRAForm,
    LoRAKernelMeta,
    TorchDispatchTable,
    expand,
    select_backend,
    shrink,
)

SHAPES = {"bench": [(1024, 2816), (2816, 1024)], "llama8b": [(4096, 14336), (14336, 4096)]}
TARGET = {"tokens": 512, "slots": 8, "rank": 16, "in": 1024, "out": 2816}
TARGET_LIMITS = {"uniform": 8.0, "sorted": 8.0, "single": 4.0, "none": 0.5}
GROUPED = KernelConfig(torch_form=LoRAForm.GROUPED)
LANED = KernelConfig(torch_form=LoRAForm.LANED)


def slot_indices(mix: str, num_tokens: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    if mix == "none":
        slots = torch.full((num_tokens,), -1)
    elif mix == "single":
        slots = torch.zeros(num_tokens, dtype=torch.int64)
    elif mix == "uniform":
        slots = torch.randint(0, num_slots, (num_tokens,), generator=gen)
    elif mix == "sorted":  # uniform, with the batch ordered by adapter as the engine orders it
        slots = torch.randint(0, num_slots, (num_tokens,), generator=gen).sort().values
    elif mix == "zipf":
        weights = 1.0 / torch.arange(1, num_slots + 1, dtype=torch.float64)
        slots = torch.multinomial(weights, num_tokens, replacement=True, generator=gen)
    else:
        raise ValueError(f"unknown mix {mix!r}")
    return slots.to(torch.int32)


def median_ms(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Interleaved repeats of each fn; medians in ms."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


def measure(backend, tokens: int, slots: int, rank: int, in_f: int, out_f: int, mix: str, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, in_f, generator=gen)
    weight = torch.randn(out_f, in_f, generator=gen)
    a = torch.randn(slots, rank, in_f, generator=gen) * 0.01
    bt = torch.randn(slots, rank, out_f, generator=gen) * 0.01
    y = torch.empty(tokens, out_f)
    indices = slot_indices(mix, tokens, slots, gen)
    meta = LoRAKernelMeta.make(backend, slots, rank, tokens, "cpu")
    meta.prepare(indices)

    def layer() -> None:  # as runtime.LoRALinear: LoRA terms written first, the base matmul added by one addmm_
        if meta.no_adapter:
            torch.mm(x, weight.t(), out=y)
            return
        expand(y, shrink(x, a, meta), bt, meta, accumulate=False)
        y.addmm_(x, weight.t())

    base_ms, layer_ms, alone_ms, meta_ms = median_ms(
        [
            lambda: torch.mm(x, weight.t(), out=y),
            layer,
            lambda: expand(y, shrink(x, a, meta), bt, meta),
            lambda: meta.prepare(indices),
        ],
        repeats,
    )
    lora_ms = max(layer_ms - base_ms, 0.0)
    return {
        "tokens": tokens,
        "slots": slots,
        "rank": rank,
        "in": in_f,
        "out": out_f,
        "mix": mix,
        "base_ms": round(base_ms, 4),
        "lora_ms": round(lora_ms, 4),
        "lora_alone_ms": round(alone_ms, 4),
        "meta_ms": round(meta_ms, 4),
        "lora_pct": round(100 * lora_ms / base_ms, 2),
        "lora_alone_pct": round(100 * alone_ms / base_ms, 2),
        "meta_pct": round(100 * meta_ms / base_ms, 2),
    }


def repeats_for(tokens: int, in_f: int, out_f: int, quick: bool) -> int:
    flops = tokens * in_f * out_f
    budget = 15 if quick else 30
    return max(budget, min(200, int(4e9 / max(flops, 1))))


def write_table(args: argparse.Namespace) -> None:
    in_f, out_f = SHAPES["bench"][0]
    token_list = (1, 16, 64, 128, 512)
    entries = []
    for slots in (4, 8, 16):
        for rank in (8, 16, 64):
            laned_max = 0
            for tokens in token_list:
                reps = repeats_for(tokens, in_f, out_f, args.quick)
                grouped = measure(select_backend("cpu", GROUPED), tokens, slots, rank, in_f, out_f, "uniform", reps)
                laned = measure(select_backend("cpu", LANED), tokens, slots, rank, in_f, out_f, "uniform", reps)
                print(
                    f"table S={slots:2d} R={rank:2d} T={tokens:4d} grouped {grouped['lora_pct']:7.2f}% "
                    f"laned {laned['lora_pct']:7.2f}%"
                )
                if laned["lora_ms"] < grouped["lora_ms"] and laned_max == tokens_before(token_list, tokens):
                    laned_max = tokens
            entries.append(DispatchEntry(slots, rank, laned_max))
    table = TorchDispatchTable(tuple(entries))
    path = Path(args.table_out)
    path.write_text(table.to_json(f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}"))
    print(f"wrote {path}")


def tokens_before(token_list: tuple[int, ...], tokens: int) -> int:
    index = token_list.index(tokens)
    return 0 if index == 0 else token_list[index - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the target point and a few neighbours only")
    parser.add_argument("--shapes", default="bench", help="comma list of: " + ", ".join(SHAPES))
    parser.add_argument("--out", default="out/bench_kernels.json")
    parser.add_argument("--write-table", action="store_true", help="measure grouped vs laned, rewrite the table")
    parser.add_argument("--table-out", default=str(Path(__file__).resolve().parents[1] / "kernels/torch_dispatch.json"))
    args = parser.parse_args()
    if args.write_table:
        write_table(args)
    backend = select_backend("cpu")
    if args.quick:
        grid = [
            (t, s, r, TARGET["in"], TARGET["out"], m)
            for t in (16, 512)
            for s, r in ((8, 16),)
            for m in ("none", "single", "uniform", "sorted", "zipf")
        ]
    else:
        shapes = [shape for name in args.shapes.split(",") for shape in SHAPES[name]]
        grid = [
            (t, s, r, i, o, m)
            for (i, o) in shapes
            for t in (1, 16, 128, 512, 2048)
            for r in (8, 16, 64)
            for s in (1, 4, 8, 16)
            for m in ("none", "single", "uniform", "sorted", "zipf")
        ]
    rows = []
    print(
        f"{'T':>5} {'S':>3} {'R':>3} {'in':>6} {'out':>6} {'mix':>8} {'base ms':>9} {'lora ms':>9} "
        f"{'lora %':>7} {'alone %':>7} {'meta %':>7}"
    )
    for tokens, slots, rank, in_f, out_f, mix in grid:
        row = measure(backend, tokens, slots, rank, in_f, out_f, mix, repeats_for(tokens, in_f, out_f, args.quick))
        rows.append(row)
        print(
            f"{tokens:5d} {slots:3d} {rank:3d} {in_f:6d} {out_f:6d} {mix:>8} {row['base_ms']:9.3f} "
            f"{row['lora_ms']:9.3f} {row['lora_pct']:7.2f} {row['lora_alone_pct']:7.2f} {row['meta_pct']:7.2f}",
            flush=True,
        )
    targets = {}
    for mix, limit in TARGET_LIMITS.items():
        point = [r for r in rows if r["mix"] == mix and all(r[k] == v for k, v in TARGET.items())]
        if point:
            row = point[0]
            targets[mix] = {
                "lora_pct": row["lora_pct"],
                "lora_alone_pct": row["lora_alone_pct"],
                "limit_pct": limit,
                "met": row["lora_pct"] <= limit,
            }
            print(
                f"target T=512 S=8 R=16 1024->2816 {mix:>8}: in-layer {row['lora_pct']:.2f} %, "
                f"alone {row['lora_alone_pct']:.2f} % (limit {limit} %)"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows, "targets": targets}, indent=1
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
