"""Captured decode steps (CUDA graphs over the triton backend) on a CUDA device: a replay equals the eager static
step, across an adapter swap (the pool written in place under a graph that keeps reading it) and a step with no
adapter. Skipped without a CUDA device or triton."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kernels import KernelConfig, LoRAKernelMeta, select_backend
from runtime.model.batch import ForwardBatch, SequenceChunk
from runtime.model.cuda_graphs import DecodeGraphConfig, DecodeGraphs
from tests.runtime._oracle import FP32_TOL, MAX_RANK, ROWS, SLOTTED, max_diff, slots_of
from tests.runtime._steps import slotted_model, step

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
]


def test_a_replayed_decode_step_equals_the_eager_one_across_a_swap(written) -> None:
    model, registry, pool, rows = slotted_model(written, torch.float32, device="cuda")
    spare = len(ROWS)
    model.setup_caches(max_batch=spare + 1, max_seq_len=32)  # row `spare`: the padding tokens' row
    meta = LoRAKernelMeta.make(select_backend("cuda", KernelConfig()), pool.num_slots, MAX_RANK, 64, "cuda",
                               granule=pool.granule)  # fmt: skip
    graphs = DecodeGraphs(model, meta, DecodeGraphConfig(token_buckets=(4, 8), logits_rows=spare, spare_row=spare))
    prompts, adapters = [p for p, _ in ROWS], [a for _, a in ROWS]
    slots = slots_of(adapters, SLOTTED)
    chunks = [SequenceChunk(row, 0, tuple(p), s) for row, (p, s) in enumerate(zip(prompts, slots, strict=True))]
    next_ids = step(model, chunks, meta, slot_rows=rows).argmax(-1).tolist()  # eager prefill
    swapped = SLOTTED.index("patterns")
    for i in range(4):
        if i == 2:  # swap: "spare" into the slot of "patterns", written in place while the graph holds the pool
            pool.load(swapped, registry.prepared("spare"))
            rows[swapped] = registry.prepared("spare").rows
        if i == 3:
            slots = [-1] * len(slots)  # no adapter at all: the same graph, every token rank 0
        chunks = [
            SequenceChunk(row, len(p) + i, (next_ids[row],), s)
            for row, (p, s) in enumerate(zip(prompts, slots, strict=True))
        ]
        batch = ForwardBatch.from_chunks(chunks, device="cuda", padding=graphs.padding(len(chunks)))
        meta.prepare(batch.slot_indices, rows)
        with torch.no_grad():
            eager = model(batch, meta)[: len(chunks)].clone()  # writes the step's keys; the replay rewrites them
        replayed = graphs.run(batch, rows)[: len(chunks)]
        assert max_diff(replayed, eager) <= FP32_TOL, f"step {i}"
        next_ids = eager.argmax(-1).tolist()
    assert graphs.captured == (8,), "7 decode tokens: the bucket of 8, captured once for every step"
