"""The triton backend's kernels on a GPU, each beside its byte floor (``bench_kernels --device cuda`` runs this).

    .venv/bin/python -m scripts.bench_kernels --device cuda [--quick] [--shapes bench,llama8b] [--dtype bf16] [--tune]
    .venv/bin/python -m scripts.bench_triton --interpret   # the same code on CPU tensors in Triton's interpreter,
                                                           # tiny shapes: checks the script; its times are not figures

For each fused-linear group of a shape (q/k/v, o, gate/up, down), token count T, rank R and k distinct adapters (the
batch sorted by adapter, as the engine orders it): the shrink kernel, the expand kernel and the whole apply_parts,
each timed on the device (a CUDA graph of ``--inner`` calls replayed between two events: no host launch overhead;
median of ``--repeats``) beside its byte floor: the bytes it must move (shrink: x, the k adapters' A rows, h; expand:
h, the k adapters' Bt rows, y read and written; apply: x, A, Bt, y read and written) at the bandwidth of one copy_
moving as many bytes (reading half, writing half), timed the same way in the same run. Target: <= 1.5x the floor.

``--tune`` times candidate block sizes per (op, T, rank, features) and writes the fastest as a block-size table
(``--table-out``; load it with ``KernelConfig(triton_block_size_table=...)`` or copy it over
adapter_manager/kernels/triton/block_sizes.json).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from scripts.harness import write_json

SHAPES = {  # (hidden, q out, kv out, intermediate)
    "bench": (1024, 1024, 256, 2816),
    "llama8b": (4096, 4096, 1024, 14336),
    "tiny": (64, 64, 16, 96),  # --interpret only
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TARGET = 1.5


def groups(shape: str) -> list[tuple[str, int, tuple[int, ...]]]:
    """(name, in features, parts' out features) of each fused linear the model calls apply_parts on."""
    hidden, q_out, kv_out, inter = SHAPES[shape]
    return [
        ("qkv", hidden, (q_out, kv_out, kv_out)),
        ("o", q_out, (hidden,)),
        ("gate_up", hidden, (inter, inter)),
        ("down", inter, (hidden,)),
    ]


@dataclass(frozen=True)
class Case:
    group: str
    in_f: int
    outs: tuple[int, ...]
    tokens: int
    rank: int
    adapters: int

    def bytes(self, element: int) -> dict[str, int]:
        """The bytes each op must move at least."""
        parts, out = len(self.outs), sum(self.outs)
        x, y, h = self.tokens * self.in_f * element, self.tokens * out * element, parts * self.tokens * self.rank * 4
        a, bt = self.adapters * self.rank * parts * self.in_f * element, self.adapters * self.rank * out * element
        return {"shrink": x + a + h, "expand": h + bt + 2 * y, "apply": x + a + bt + 2 * y}


class Operands:
    """One case's pool (A parts and Bt parts adjacent in one row buffer, as the row layout puts them), x, y, meta."""

    def __init__(self, case: Case, backend, dtype: torch.dtype, device: str, gen: torch.Generator) -> None:
        from adapter_manager.kernels import LoRAKernelMeta

        parts, k, rank = len(case.outs), case.adapters, case.rank
        num_rows, width = k * rank + 1, parts * case.in_f + sum(case.outs)
        rows = (torch.randn(num_rows, width, generator=gen) * 0.02).to(dtype=dtype, device=device)
        rows[-1] = 0
        self.a_parts = rows.as_strided((num_rows, parts, case.in_f), (width, case.in_f, 1))
        starts = list(itertools.accumulate(case.outs, initial=parts * case.in_f))
        self.bt_parts = [rows[:, s : s + o] for s, o in zip(starts, case.outs, strict=False)]
        self.x = torch.randn(case.tokens, case.in_f, generator=gen).to(dtype=dtype, device=device)
        self.y = torch.randn(case.tokens, sum(case.outs), generator=gen).to(dtype=dtype, device=device)
        self.meta = LoRAKernelMeta.make(backend, k, rank, case.tokens, device, granule=rank)
        slots = torch.randint(0, k, (case.tokens,), generator=gen).sort().values.to(torch.int32)
        self.meta.prepare(slots, dict.fromkeys(range(k), rank))
        self.backend = backend
        self.h = backend.shrink_all(self.x, self.a_parts, self.meta)

    def ops(self) -> dict[str, Callable[[], object]]:
        b, m = self.backend, self.meta
        return {
            "shrink": lambda: b.shrink_all(self.x, self.a_parts, m),
            "expand": lambda: b.expand_all(self.y, self.h, self.bt_parts, m),
            "apply": lambda: b.apply_parts(self.y, self.x, self.a_parts, self.bt_parts, m),
        }


def device_ms(fn: Callable[[], object], device: str, inner: int, repeats: int) -> float:
    """Median ms of one call: on cuda a graph of ``inner`` calls replayed between events; on cpu (interpret) the
    wall clock of the calls."""
    fn()  # compile / warm up
    if device != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / inner)
    return statistics.median(times)


def copy_ms(nbytes: int, device: str, inner: int, repeats: int) -> float:
    """One copy_ moving ``nbytes`` (reading nbytes/2, writing nbytes/2): the floor of a kernel of that many bytes."""
    half = max(nbytes // 2, 1)
    src, dst = torch.empty(half, dtype=torch.uint8, device=device), torch.empty(half, dtype=torch.uint8, device=device)
    return device_ms(lambda: dst.copy_(src), device, inner, repeats)


def candidates(op: str, rank: int) -> list:
    """Block sizes --tune tries for ``op`` at padded rank ``rank``."""
    from adapter_manager.kernels.triton.block_sizes import TritonBlocks

    ranks = [r for r in (16, 32, 64) if r <= max(16, rank)]
    if op == "bgmv_shrink":
        grid = itertools.product([1], ranks, (64, 128, 256, 512), (1, 2, 4, 8), (2, 4, 8))
    elif op == "bgmv_expand":
        grid = itertools.product([1], ranks, (64, 128, 256, 512, 1024), [1], (2, 4, 8))
    elif op == "sgmv_shrink":
        grid = itertools.product((16, 32, 64, 128), ranks, (32, 64, 128), [1], (4, 8))
    else:
        grid = itertools.product((16, 32, 64), ranks, (64, 128, 256), [1], (4, 8))
    return [TritonBlocks(*values) for values in grid]


def tune(case: Case, operands: Operands, device: str, inner: int, repeats: int, limit: int | None = None) -> list:
    """The fastest candidate (of the first ``limit``; None: all) of the case's shrink and expand ops, as table
    entries for (T, rank, features)."""
    from adapter_manager.kernels.triton.block_sizes import TritonBlockEntry, TritonBlockTable

    backend, shipped = operands.backend, operands.backend.blocks
    kind = "bgmv" if operands.meta.num_tokens <= backend.bgmv_max_tokens else "sgmv"
    entries = []
    for op, features in ((f"{kind}_shrink", case.in_f), (f"{kind}_expand", max(case.outs))):
        best = None
        for blocks in candidates(op, case.rank)[:limit]:
            entry = TritonBlockEntry(op, case.tokens, None, None, blocks)
            backend.blocks = TritonBlockTable((*(e for e in shipped.entries if e.op != op), entry))
            try:
                ms = device_ms(operands.ops()[op.split("_")[1]], device, inner, repeats)
            except Exception as err:  # noqa: BLE001 - a candidate the compiler refuses (shared memory) is skipped
                print(f"  {op} {blocks}: refused ({type(err).__name__})")
                continue
            if best is None or ms < best[0]:
                best = (ms, blocks)
        backend.blocks = shipped
        assert best is not None, f"no {op} candidate ran"
        entries.append(TritonBlockEntry(op, case.tokens, case.rank, features, best[1]))
        print(f"  tuned {op} T={case.tokens} R={case.rank} F={features}: {best[1]} {best[0] * 1e3:.1f} us")
    return entries


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="T 1/16/512, rank 16, 8 adapters")
    parser.add_argument("--shapes", default="bench", help="comma list of: " + ", ".join(SHAPES))
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--inner", type=int, default=20, help="calls per timed graph replay")
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--tune", action="store_true", help="time candidate block sizes, write the fastest")
    parser.add_argument("--table-out", default="out/triton_block_sizes.json")
    parser.add_argument("--out", default="out/bench_kernels_cuda.json")
    parser.add_argument("--interpret", action="store_true", help="CPU tensors in Triton's interpreter (tiny shapes)")
    args = parser.parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
        device, args.shapes, args.inner, args.repeats = "cpu", "tiny", 1, 1
    elif not torch.cuda.is_available():
        sys.exit(
            "bench_kernels --device cuda needs a CUDA GPU: torch.cuda.is_available() is False here (torch "
            f"{torch.__version__}). The kernels' CPU check is `python -m scripts.bench_triton --interpret`."
        )
    else:
        device = "cuda"
    from adapter_manager.kernels import BackendKind, KernelConfig, select_backend
    from adapter_manager.kernels.backend import triton_unavailable_reason

    if (reason := triton_unavailable_reason()) is not None:
        sys.exit(f"bench_kernels --device cuda: {reason}")
    backend = select_backend(device, KernelConfig(backend=BackendKind.TRITON))
    dtype, gen = DTYPES[args.dtype], torch.Generator().manual_seed(0)
    tokens = (1, 16, 512) if args.quick or args.interpret else (1, 8, 16, 64, 128, 512, 2048)
    ranks = (16,) if args.quick or args.interpret else (8, 16, 64)
    adapters = (8,) if args.quick or args.interpret else (1, 8)
    rows, tuned = [], []
    print(f"triton backend on {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (interpreter)'}, {dtype}")
    print(f"{'group':>8} {'T':>5} {'R':>3} {'k':>2} {'op':>7} {'us':>9} {'floor us':>9} {'x floor':>8}")
    for shape in args.shapes.split(","):
        for (group, in_f, outs), t, r, k in itertools.product(groups(shape), tokens, ranks, adapters):
            case = Case(group, in_f, outs, t, r, k)
            operands = Operands(case, backend, dtype, device, gen)
            sizes = case.bytes(operands.x.element_size())
            for op, fn in operands.ops().items():
                ms, floor = (
                    device_ms(fn, device, args.inner, args.repeats),
                    copy_ms(sizes[op], device, args.inner, args.repeats),
                )
                rows.append(
                    {**case.__dict__, "shape": shape, "op": op, "ms": ms, "floor_ms": floor, "bytes": sizes[op]}
                )
                print(f"{group:>8} {t:5d} {r:3d} {k:2d} {op:>7} {ms * 1e3:9.1f} {floor * 1e3:9.1f} {ms / floor:8.2f}")
            if args.tune:
                tuned += tune(case, operands, device, args.inner, args.repeats, 2 if args.interpret else None)
    met = [r for r in rows if r["ms"] <= TARGET * r["floor_ms"]]
    print(f"{len(met)} of {len(rows)} kernel times within {TARGET}x their byte floor")
    write_json(args.out, {"device": device, "dtype": args.dtype, "rows": rows}, indent=1)
    if args.tune:
        from adapter_manager.kernels.triton.block_sizes import TritonBlockTable

        shipped = [e for e in backend.blocks.entries if e.rank is None and e.features is None]
        unique = {(e.op, e.max_tokens, e.rank, e.features): e for e in reversed(tuned)}  # the first tuned per key
        table = TritonBlockTable((*shipped, *unique.values()))
        Path(args.table_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.table_out).write_text(table.to_json(f"tuned by scripts/bench_triton.py on {device}, {args.dtype}"))
        print(f"wrote {args.table_out}")


if __name__ == "__main__":
    main()
