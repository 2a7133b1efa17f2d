#!/usr/bin/env python3
"""What this machine allows one adapter's decode rows: the decode step's bytes read with nothing computed.

The bench model (fp32, packed: our blocked layout) and one rank-16 adapter's rows in the real pool. A C++ loop (built
inline with torch's extension builder, -O3 -march=native, OpenMP on torch's thread count, as the kernels) reads:
- ``weights``: every linear's packed base weight in the step's order (lm_head last), each split evenly between the
  threads, 512-bit loads with a non-temporal prefetch 2 KB ahead (as ``lora_blocked``'s decode loop);
- ``rows_after``: the same, and after each linear that linear's rows of the adapter (its A and Bt runs in the pool's
  row layout: ``rank`` runs of 4–22 KB a row's width apart, rank rows dealt round-robin to the threads) in a second
  parallel region, where the kernels' LoRA runs;
- ``rows_same_region``: the rows read by each thread right after its share of the weight, no second region;
- ``rows_prefetched``: each thread first prefetches its rows (prefetcht0), then reads its weight share, then the rows;
- ``rows_interleaved``: each thread's weight share in as many slices as it has runs of rows, one run read after each
  slice (what the rows would cost if a kernel could read them inside the weight stream);
- ``contiguous_after``: as ``rows_after`` over a copy of each linear's rows made one contiguous run;
and, in the same repeats, the real decode step (``base`` and ``lora_1``, 8 sequences at context 144). Every closure
runs once per repeat in a fresh random order; each figure is the median over repeats of its paired difference with
``weights`` (or ``base``) in the same repeat, beside the floor: the rows' bytes at the rate ``weights`` read the base
weights (its median; DESIGN.md, Floors: the adapter's bytes / the base's bytes, times the weight stream's time).
The kernels' LoRA after each linear cannot cost less than its rows' read alone.

Writes out/bench_reads.json.

  .venv/bin/python -m scripts.probes.reads [--repeats 600]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from adapter_manager.runtime.model.projection import LoRALinear
from scripts.harness import RANK, StepSetup, engine_workload, write_json

MODES = ("weights", "rows_after", "rows_same_region", "rows_prefetched", "rows_interleaved", "contiguous_after")

_SOURCE = r"""
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
#include <torch/extension.h>

#include <algorithm>
#include <vector>

namespace {
volatile float sink;

// Sum floats [p, p + n) (n a multiple of 16) into acc; W-stream form: prefetchnta 2 KB ahead.
inline __m512 stream(const float* p, int64_t n, __m512 acc, bool nta) {
  for (int64_t i = 0; i < n; i += 16) {
    if (nta) _mm_prefetch(reinterpret_cast<const char*>(p + i + 512), _MM_HINT_NTA);
    acc = _mm512_add_ps(acc, _mm512_loadu_ps(p + i));
  }
  return acc;
}

// runs [M, 3]: (address, floats, thread); linear l's runs are rows [offsets[l], offsets[l + 1]).
inline __m512 rows(const int64_t* runs, int64_t begin, int64_t end, int thread, __m512 acc, bool prefetch) {
  for (int64_t r = begin; r < end; ++r) {
    if (runs[3 * r + 2] != thread) continue;
    const float* p = reinterpret_cast<const float*>(runs[3 * r]);
    if (prefetch) {
      for (int64_t i = 0; i < runs[3 * r + 1]; i += 16) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
    } else {
      acc = stream(p, runs[3 * r + 1], acc, false);
    }
  }
  return acc;
}
}  // namespace

// Seconds to read every weight (and, by mode, each linear's rows after it): 0 weights, 1 rows after in a second
// region, 2 rows after in the same region, 3 rows prefetched first, read after, 4 rows interleaved (the thread's
// weight share in as many slices as it has runs, one run read after each slice).
double read_step(std::vector<at::Tensor> weights, at::Tensor runs_t, at::Tensor offsets_t, int64_t mode) {
  const int threads = at::get_num_threads();
  const int64_t* runs = runs_t.data_ptr<int64_t>();
  const int64_t* offsets = offsets_t.data_ptr<int64_t>();
  const double start = omp_get_wtime();
  for (size_t l = 0; l < weights.size(); ++l) {
    const float* w = weights[l].data_ptr<float>();
    const int64_t share = weights[l].numel() / threads / 16 * 16;
    const int64_t begin = offsets[l], end = offsets[l + 1];
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num();
      __m512 acc = _mm512_setzero_ps();
      if (mode == 3) acc = rows(runs, begin, end, t, acc, true);
      if (mode == 4) {
        std::vector<int64_t> mine;
        for (int64_t r = begin; r < end; ++r)
          if (runs[3 * r + 2] == t) mine.push_back(r);
        const int64_t slices = std::max<int64_t>(1, mine.size());
        for (int64_t i = 0; i < slices; ++i) {
          const int64_t lo = share * i / slices / 16 * 16, hi = share * (i + 1) / slices / 16 * 16;
          acc = stream(w + t * share + lo, (i + 1 == slices ? share : hi) - lo, acc, true);
          if (i < static_cast<int64_t>(mine.size())) acc = rows(runs, mine[i], mine[i] + 1, t, acc, false);
        }
      } else {
        acc = stream(w + t * share, share, acc, true);
      }
      if (mode == 2 || mode == 3) acc = rows(runs, begin, end, t, acc, false);
      sink = _mm512_reduce_add_ps(acc);
    }
    if (mode == 1) {
#pragma omp parallel num_threads(threads)
      {
        __m512 acc = rows(runs, begin, end, omp_get_thread_num(), _mm512_setzero_ps(), false);
        sink = _mm512_reduce_add_ps(acc);
      }
    }
  }
  return omp_get_wtime() - start;
}
"""


def build(folder: Path):  # noqa: ANN201 - a loaded extension module
    return cpp_extension.load_inline(
        "bench_reads_cpu",
        cpp_sources=[_SOURCE],
        functions=["read_step"],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
    )


def _merged(pieces: list[torch.Tensor]) -> list[tuple[int, int]]:
    """(address, floats) runs of contiguous 1-D views, adjacent ones merged."""
    runs: list[list[int]] = []
    for piece in pieces:
        address, floats = piece.data_ptr(), piece.numel()
        if runs and runs[-1][0] + 4 * runs[-1][1] == address:
            runs[-1][1] += floats
        else:
            runs.append([address, floats])
    return [(a, n) for a, n in runs]


def linear_rows(layer: LoRALinear, first: int, rank: int) -> list[list[torch.Tensor]]:
    """Per rank row, that row's A and Bt pieces of ``layer`` (views of the pool, in address order)."""
    groups = layer._kernel_groups  # noqa: SLF001 - bench: the pool views the kernel reads
    per_row = []
    for i in range(first, first + rank):
        pieces = [part for a in groups.a_groups for part in a[i]] + [bt[i] for bt in groups.bts]
        per_row.append(sorted(pieces, key=torch.Tensor.data_ptr))
    return per_row


def tables(model: torch.nn.Module, first: int, rank: int, threads: int) -> tuple[list, dict, list]:
    """The weights in step order, the runs tables (pool layout, contiguous copies), and the copies to keep alive."""
    linears = [m for m in model.modules() if isinstance(m, LoRALinear)]
    weights = [m._packed.tensor for m in linears]  # noqa: SLF001 - bench: the packed weight the kernel streams
    pool, contiguous, copies = [], [], []
    for index, layer in enumerate(linears):
        if not layer.has_lora:
            continue
        per_row = linear_rows(layer, first, rank)
        for i, pieces in enumerate(per_row):
            pool += [(a, n, i % threads, index) for a, n in _merged(pieces)]
        copy = torch.cat([p for pieces in per_row for p in pieces])
        copy = torch.cat([copy, copy.new_zeros(-copy.numel() % (16 * threads))])
        copies.append(copy)
        share = copy.numel() // threads
        contiguous += [(copy.data_ptr() + 4 * t * share, share, t, index) for t in range(threads)]

    def table(runs: list[tuple[int, int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        assert all(n % 16 == 0 for _, n, _, _ in runs), "runs of whole 64-byte vectors"
        offsets = [sum(1 for r in runs if r[3] < index) for index in range(len(weights) + 1)]
        return torch.tensor([r[:3] for r in runs], dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64)

    return weights, {"pool": table(pool), "contiguous": table(contiguous)}, copies


def paired(times: dict[str, list[float]], key: str, reference: str) -> dict[str, float]:
    diffs = sorted(a - b for a, b in zip(times[key], times[reference], strict=True))
    q = statistics.quantiles(diffs, n=4)
    return {"ms": 1e3 * statistics.median(diffs), "q1_ms": 1e3 * q[0], "q3_ms": 1e3 * q[2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=600)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--context", type=int, default=144)
    parser.add_argument("--out", type=Path, default=Path("out/bench_reads.json"))
    args = parser.parse_args()
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp, engine_workload() as work:
        start = time.perf_counter()
        ext = build(Path(tmp))
        print(f"built the read loop in {time.perf_counter() - start:.0f} s; {threads} threads")
        model = work.load_model(pack_weights=True)
        setup = StepSetup(work, model, args.seqs, args.context, args.seqs)
        lease = setup.leases[0]
        first = lease.slots[work.mix("lora_1", 1)[0]] * work.manager.granule
        weights, runs, copies = tables(model, first, RANK, threads)  # the runs point into the copies: keep them
        weight_bytes = sum(w.numel() * w.element_size() for w in weights)
        row_bytes = 4 * int(runs["pool"][0][:, 1].sum())
        modes = {
            "weights": (runs["pool"], 0),
            "rows_after": (runs["pool"], 1),
            "rows_same_region": (runs["pool"], 2),
            "rows_prefetched": (runs["pool"], 3),
            "rows_interleaved": (runs["pool"], 4),
            "contiguous_after": (runs["contiguous"], 1),
        }
        closures = {name: (lambda r=r, m=m: ext.read_step(weights, r[0], r[1], m)) for name, (r, m) in modes.items()}
        steps = {"base": setup.step_fn("base", None), "lora_1": setup.step_fn("lora_1", None)}
        times: dict[str, list[float]] = {name: [] for name in (*closures, *steps)}
        order = random.Random(0)
        for fn in (*closures.values(), *steps.values()):
            fn()
        for _ in range(args.repeats):
            for name in order.sample(list(times), len(times)):
                if name in closures:
                    times[name].append(closures[name]())
                else:
                    begin = time.perf_counter()
                    steps[name]()
                    times[name].append(time.perf_counter() - begin)
        setup.close()
    weights_ms = 1e3 * statistics.median(times["weights"])
    floor_ms = weights_ms * row_bytes / weight_bytes
    base_ms = 1e3 * statistics.median(times["base"])
    result = {
        "repeats": args.repeats,
        "threads": threads,
        "weight_bytes": weight_bytes,
        "row_bytes": row_bytes,
        "weights_ms": weights_ms,
        "weights_gb_s": weight_bytes / weights_ms / 1e6,
        "floor_ms": floor_ms,
        "reads": {name: paired(times, name, "weights") for name in MODES[1:]},
        "base_ms": base_ms,
        "lora_1": paired(times, "lora_1", "base"),
        "lora_1_floor_ms": base_ms * row_bytes / weight_bytes,
    }
    print(
        f"\none adapter's rows ({row_bytes / 1e6:.1f} MB) beside the step's base weights ({weight_bytes / 1e6:.0f} MB),"
        f" medians of {args.repeats} paired repeats (quartiles of the differences in brackets)"
    )
    print(f"weights read alone          {weights_ms:6.2f} ms ({result['weights_gb_s']:.1f} GB/s)")
    for name in MODES[1:]:
        r = result["reads"][name]
        print(
            f"+ {name:24s} {r['ms']:+6.3f} ms [{r['q1_ms']:+.3f}, {r['q3_ms']:+.3f}]  "
            f"{r['ms'] / floor_ms:4.2f}x the rows' floor {floor_ms:.3f} ms"
        )
    r = result["lora_1"]
    print(
        f"real decode step: base {base_ms:.2f} ms, lora_1 {r['ms']:+.3f} ms [{r['q1_ms']:+.3f}, {r['q3_ms']:+.3f}] "
        f"= {100 * r['ms'] / base_ms:+.2f} %, {r['ms'] / result['lora_1_floor_ms']:.2f}x its floor "
        f"{result['lora_1_floor_ms']:.3f} ms ({100 * row_bytes / weight_bytes:.2f} %)"
    )
    write_json(args.out, result)


if __name__ == "__main__":
    main()
