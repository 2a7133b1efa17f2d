"""Shrink+expand microbenchmark on row pools: LoRA time as a percentage of the base matmul, and pool-size independence.

    .venv/bin/python -m scripts.bench_kernels [--quick] [--shapes bench,llama8b] [--write-table] [--out PATH]
    PJRT_DEVICE=CPU .venv-xla/bin/python -m scripts.bench_kernels --quick   # adds the torch_xla CPU device
    .venv/bin/python -m scripts.bench_kernels --device cuda [--quick] [--tune]   # the Triton kernels (bench_triton)

Base and LoRA are timed side by side in one run (median of interleaved repeats). ``lora %`` is the in-layer cost: the
layer as LoRALinear runs it (shrink, expand writing the LoRA term, then one ``addmm_`` adding the base matmul)
minus the base matmul alone; ``alone %`` times shrink+expand by themselves, both over the base matmul. The metadata
is prepared once per step and shared by every layer, so its cost is reported separately (``meta %``).

The pool figure: one LoRA layer (1024 -> 2816, rank 16, base matmul included) with 8 active adapters in a pool of 8
and of 256 slots; ``ratio`` = time with 256 / time with 8 (target ≤ 1.25: no cost may grow with the pool). Eager
CPU always; the torch_xla CPU device when torch_xla is importable. ``A`` is the traced compact table's width.
``--write-table`` also times the grouped and the laned forms per (k, R) and rewrites
adapter_manager/kernels/torch_dispatch.json.

The block figure (fused shrink of q/k/v and gate/up vs one shrink per part, beside its floor) is the probe
``python -m scripts.probes.block``.
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from adapter_manager.kernels import (
    DispatchEntry,
    KernelConfig,
    LoRAForm,
    LoRAKernelMeta,
    TorchDispatchTable,
    expand,
    select_backend,
    shrink,
)
from scripts.harness import medians_ms, write_json

SHAPES = {"bench": [(1024, 2816), (2816, 1024)], "llama8b": [(4096, 14336), (14336, 4096)]}
TARGET = {"tokens": 512, "slots": 8, "rank": 16, "in": 1024, "out": 2816}
TARGET_LIMITS = {"uniform": 8.0, "sorted": 8.0, "single": 4.0, "none": 0.5}
POOL_LIMIT = 1.25
GROUPED = KernelConfig(torch_form=LoRAForm.GROUPED)
LANED = KernelConfig(torch_form=LoRAForm.LANED)
HAS_XLA = importlib.util.find_spec("torch_xla") is not None


def slot_indices(mix: str, num_tokens: int, active: list[int], gen: torch.Generator) -> torch.Tensor:
    """[T] int32 slot indices of a mix over the ``active`` slot ids."""
    count = len(active)
    if mix == "none":
        picks = torch.full((num_tokens,), -1)
    elif mix == "single":
        picks = torch.zeros(num_tokens, dtype=torch.int64)
    elif mix == "uniform":
        picks = torch.randint(0, count, (num_tokens,), generator=gen)
    elif mix == "sorted":  # uniform, with the batch ordered by adapter as the engine orders it
        picks = torch.randint(0, count, (num_tokens,), generator=gen).sort().values
    elif mix == "zipf":
        weights = 1.0 / torch.arange(1, count + 1, dtype=torch.float64)
        picks = torch.multinomial(weights, num_tokens, replacement=True, generator=gen)
    else:
        raise ValueError(f"unknown mix {mix!r}")
    ids = torch.tensor(active)
    return torch.where(picks >= 0, ids[picks.clamp(min=0)], -1).to(torch.int32)


@dataclass
class Layer:
    """One LoRA linear on a device: base weight, row pools with every slot at rank R (G = R), and its step."""

    x: torch.Tensor
    weight: torch.Tensor
    a_rows: torch.Tensor
    bt_rows: torch.Tensor
    y: torch.Tensor
    meta: LoRAKernelMeta
    indices: torch.Tensor
    slot_rows: dict[int, int]
    traced: bool

    @classmethod
    def make(cls, backend, device, tokens, pool_slots, active, rank, in_f, out_f, mix, buckets=None) -> Layer:
        gen = torch.Generator().manual_seed(0)
        rows = pool_slots * rank + 1
        a = torch.randn(rows, in_f, generator=gen) * 0.01
        bt = torch.randn(rows, out_f, generator=gen) * 0.01
        a[-1], bt[-1] = 0, 0
        x, weight = torch.randn(tokens, in_f, generator=gen), torch.randn(out_f, in_f, generator=gen)
        indices = slot_indices(mix, tokens, active, gen)
        slot_rows = dict.fromkeys(range(pool_slots), rank)
        meta = LoRAKernelMeta.make(backend, pool_slots, rank, tokens, device, active_buckets=buckets)
        meta.prepare(indices, slot_rows)
        to = lambda t: t.to(device)
        y = torch.empty(tokens, out_f, device=device)
        return cls(to(x), to(weight), to(a), to(bt), y, meta, indices, slot_rows, backend.traced)

    def layer(self) -> torch.Tensor:
        """As LoRALinear: the LoRA term written first, the base matmul added by one addmm_."""
        if self.traced:
            h = shrink(self.x, self.a_rows, self.meta)
            return expand(self.y, h, self.bt_rows, self.meta, accumulate=False) + self.x @ self.weight.t()
        if self.meta.no_adapter:
            return torch.mm(self.x, self.weight.t(), out=self.y)
        expand(self.y, shrink(self.x, self.a_rows, self.meta), self.bt_rows, self.meta, accumulate=False)
        return self.y.addmm_(self.x, self.weight.t())

    def lora(self) -> torch.Tensor:
        return expand(self.y, shrink(self.x, self.a_rows, self.meta), self.bt_rows, self.meta)

    def base(self) -> torch.Tensor:
        return self.x @ self.weight.t() if self.traced else torch.mm(self.x, self.weight.t(), out=self.y)


def timed(fn: Callable[[], torch.Tensor], traced: bool) -> Callable[[], None]:
    """``fn`` made synchronous: on torch_xla, cut the graph and wait for the device."""
    if not traced:
        return fn
    import torch_xla
    import torch_xla.core.xla_model as xm

    def run() -> None:
        out = fn()
        torch_xla.sync()
        xm.wait_device_ops()
        del out

    return run


def measure(backend, tokens: int, slots: int, rank: int, in_f: int, out_f: int, mix: str, repeats: int) -> dict:
    layer = Layer.make(backend, "cpu", tokens, slots, list(range(slots)), rank, in_f, out_f, mix)
    base_ms, layer_ms, alone_ms, meta_ms = medians_ms(
        [layer.base, layer.layer, layer.lora, lambda: layer.meta.prepare(layer.indices, layer.slot_rows)], repeats
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


def pool_figure(quick: bool) -> list[dict]:
    """Layer time with 8 active adapters in a pool of 256 slots over a pool of 8, per device and token count.

    Traced devices pad the compact table to an active bucket: 8 active slots take A = 8 in the pool of 8 (buckets
    1, 4, 8) and A = 16 in the pool of 256 (1, 4, 16, 64, 256). ``A=8 ratio`` repeats the 256-slot pool with a bucket
    of 8 added, separating the bucket padding from the pool size.
    """
    devices = [("eager-cpu", "cpu")]
    if HAS_XLA:
        import torch_xla

        devices.append(("xla-cpu", torch_xla.device()))
    in_f, out_f, rank, active = 1024, 2816, 16, 8
    spread = list(range(0, 256, 256 // active))  # the active adapters scattered over the big pool
    rows = []
    print(f"\npool figure: 1024->2816 R=16, {active} active adapters (uniform mix); ratio = pool 256 / pool 8")
    header = f"{'device':>9} {'T':>4} {'A8':>3} {'A256':>4} {'pool8 ms':>9} {'pool256 ms':>10} {'ratio':>6}"
    print(f"{header} {'lora ratio':>10} {'A=8 ratio':>9}")
    for name, device in devices:
        backend = select_backend(device)
        for tokens in (16, 512):
            pools = [(8, list(range(8)), None), (256, spread, None)]
            if backend.traced:
                pools.append((256, spread, (1, 4, 8, 16, 64, 256)))
            layers = [
                Layer.make(backend, device, tokens, slots, ids, rank, in_f, out_f, "uniform", buckets)
                for slots, ids, buckets in pools
            ]
            repeats = (15 if quick else 40) if tokens > 16 else (40 if quick else 100)
            fns = [timed(f, backend.traced) for f in [lay.layer for lay in layers] + [lay.lora for lay in layers[:2]]]
            times = medians_ms(fns, repeats)
            small_ms, big_ms = times[0], times[1]
            small_lora, big_lora = times[-2], times[-1]
            row = {
                "device": name,
                "tokens": tokens,
                "active": active,
                "active_width_8": layers[0].meta.active_width if backend.traced else None,
                "active_width_256": layers[1].meta.active_width if backend.traced else None,
                "pool8_ms": round(small_ms, 4),
                "pool256_ms": round(big_ms, 4),
                "ratio": round(big_ms / small_ms, 3),
                "lora_pool8_ms": round(small_lora, 4),
                "lora_pool256_ms": round(big_lora, 4),
                "lora_ratio": round(big_lora / small_lora, 3),
                "ratio_a8": round(times[2] / small_ms, 3) if backend.traced else None,
                "limit": POOL_LIMIT,
                "met": big_ms / small_ms <= POOL_LIMIT,
            }
            rows.append(row)
            widths = (row["active_width_8"], row["active_width_256"])
            a8, a256 = ("-", "-") if widths[0] is None else widths
            a8_ratio = "-" if row["ratio_a8"] is None else f"{row['ratio_a8']:.3f}"
            print(
                f"{name:>9} {tokens:4d} {a8:>3} {a256:>4} {small_ms:9.3f} {big_ms:10.3f} {row['ratio']:6.3f} "
                f"{row['lora_ratio']:10.3f} {a8_ratio:>9}",
                flush=True,
            )
    print(f"target: ratio <= {POOL_LIMIT} ({'met' if all(r['met'] for r in rows) else 'NOT met'})")
    return rows


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
                    f"table k={slots:2d} R={rank:2d} T={tokens:4d} grouped {grouped['lora_pct']:7.2f}% "
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
    default_out = "out/bench_kernels_xla.json" if HAS_XLA else "out/bench_kernels.json"
    parser.add_argument("--out", default=default_out)
    parser.add_argument("--write-table", action="store_true", help="measure grouped vs laned, rewrite the table")
    parser.add_argument(
        "--table-out", default=str(Path(__file__).resolve().parents[1] / "adapter_manager/kernels/torch_dispatch.json")
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: the triton backend's kernels beside their byte floor (scripts/bench_triton.py takes the rest)",
    )
    args, rest = parser.parse_known_args()
    if args.device == "cuda":  # the triton backend's benchmark, in its own process: no benchmark imports another
        out = [] if args.out == default_out else ["--out", args.out]
        triton = [*rest, "--shapes", args.shapes, *(["--quick"] if args.quick else []), *out]
        raise SystemExit(subprocess.call([sys.executable, "-m", "scripts.bench_triton", *triton]))
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
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
    print(f"eager torch {torch.__version__}, {torch.get_num_threads()} threads; pool of S slots, all active")
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
    pool = pool_figure(args.quick)
    if not HAS_XLA:
        print("torch_xla not importable: xla-cpu rows skipped (run with .venv-xla and PJRT_DEVICE=CPU)")
    result = {"threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows, "targets": targets}
    write_json(args.out, {**result, "pool_figure": pool}, indent=1)


if __name__ == "__main__":
    main()
