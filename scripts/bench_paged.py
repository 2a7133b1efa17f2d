"""What paging the KV cache costs a decode step: the bench model's eager decode step (``--seqs`` sequences, one token
each at ``--context``) with each sequence's blocks contiguous and in order (a fresh pool's layout, as dense rows:
row r owns blocks r·MB ..) against the same step through shuffled block tables of 16-token blocks (the
layout a long-running server's pool ends up in), side by side in one run, medians of round-robin repeats. Also the
engine's per-step host cost of building the tables. The floor of the ratio is 1.0 (the same bytes are read).

    .venv/bin/python -m scripts.bench_paged [--seqs 8] [--context 768] [--repeats 30] [--out out/bench_paged.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from adapter_manager.runtime.engine.kv_blocks import BlockPool
from adapter_manager.runtime.engine.kv_space import KVSpace
from adapter_manager.runtime.engine.request import Request
from adapter_manager.runtime.engine.sampling import SamplingParams
from adapter_manager.runtime.model.batch import ForwardBatch, SequenceChunk
from adapter_manager.runtime.model.config import LlamaConfig
from adapter_manager.runtime.model.llama import Llama
from scripts.harness import cpu_model, write_json

BLOCK = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--context", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default="out/bench_paged.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Llama(LlamaConfig.bench()).eval()
    with torch.no_grad():
        for param in model.parameters():  # random weights (uninitialised ones can hold denormals: slow)
            param.normal_(0, 0.02)
    model.pack_weights()
    max_len = args.context + 64
    model.setup_caches(args.seqs, max_len, block_size=BLOCK)
    width = -(-max_len // BLOCK)
    for cache in model.kv_caches:
        cache.k.normal_()
        cache.v.normal_()
    chunks = [SequenceChunk(i, args.context, (i + 1,)) for i in range(args.seqs)]
    shuffled = torch.randperm(args.seqs * width).view(args.seqs, width)
    dense = ForwardBatch.from_chunks(chunks)  # the model's dense tables: each row's blocks contiguous
    paged = ForwardBatch.from_chunks(chunks, block_tables=shuffled)
    times: dict[str, list[float]] = {"dense": [], "paged": []}
    with torch.inference_mode():
        for _ in range(3):
            model(dense), model(paged)
        for _ in range(args.repeats):
            for name, batch in (("dense", dense), ("paged", paged)):
                start = time.perf_counter()
                model(batch)
                times[name].append(time.perf_counter() - start)
    kv = KVSpace(BlockPool(args.seqs * width), BLOCK, args.seqs, lambda adapter_id: "sha")
    requests = []
    for i in range(args.seqs):
        request = Request(i, tuple(range(args.context)), None, SamplingParams(), 0)
        kv.admit(request)
        kv.grow(request, args.context)
        requests.append(request)
    start = time.perf_counter()
    for _ in range(200):
        kv.tables(requests)
    tables_ms = (time.perf_counter() - start) / 200 * 1e3
    dense_ms, paged_ms = (statistics.median(times[k]) * 1e3 for k in ("dense", "paged"))
    print(f"CPU: {cpu_model()}; torch threads {torch.get_num_threads()}")
    print(f"decode step, {args.seqs} sequences at context {args.context}, blocks of {BLOCK} (ms, medians)")
    print(f"  dense (contiguous blocks) {dense_ms:8.2f}   paged (shuffled blocks) {paged_ms:8.2f}   "
          f"ratio {paged_ms / dense_ms:.3f} (floor 1.000)")  # fmt: skip
    print(f"  engine host cost of the step's block tables: {tables_ms:.3f} ms ({tables_ms / dense_ms:.2%} of the step)")
    write_json(
        args.out,
        {
            "cpu": cpu_model(),
            "seqs": args.seqs,
            "context": args.context,
            "block_size": BLOCK,
            "dense_ms": dense_ms,
            "paged_ms": paged_ms,
            "ratio": paged_ms / dense_ms,
            "tables_ms": tables_ms,
        },
    )


if __name__ == "__main__":
    main()
