"""Captured decode steps (CUDA graphs over the triton backend) on a CUDA device: through the model's forward, a
replayed decode step equals the eager one, across an adapter swap (the pool written in place under a graph that keeps
reading it) and a step with no adapter; prefill steps stay eager. Skipped without a CUDA device or triton."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from adapter_manager.kernels import KernelConfig, LoRAKernelMeta, select_backend
from adapter_manager.runtime.engine.cuda_graphs import DecodeGraphConfig, DecodeGraphs, can_capture
from tests.runtime._oracle import FP32_TOL, MAX_RANK, ROWS
from tests.runtime._steps import decode_replays_vs_eager, slotted_model

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
]


def test_a_replayed_decode_step_equals_the_eager_one_across_a_swap(written) -> None:
    model, registry, pool, rows = slotted_model(written, torch.float32, device="cuda")
    meta = LoRAKernelMeta.make(select_backend("cuda", KernelConfig()), pool.num_slots, MAX_RANK, 64, "cuda",
                               granule=pool.granule)  # fmt: skip
    assert can_capture(meta)
    graphs = DecodeGraphs(model, meta, DecodeGraphConfig(token_buckets=(4, 8)))
    assert graphs.spare_row == len(ROWS) == model.max_batch  # padding writes through the spare row: the spare block
    diffs = decode_replays_vs_eager(model, registry, pool, meta, rows, graphs)
    assert max(diffs) <= FP32_TOL, diffs
    assert graphs.captured == (8,), "7 decode tokens: the bucket of 8, captured once for every step"
    assert all(c.graph is not None for c in graphs._captured.values())


def test_a_replayed_int8_decode_step_equals_the_eager_one(written) -> None:
    """An int8 base (dequantized inside each matmul) under captured decode steps: replays equal eager steps."""
    model, registry, pool, rows = slotted_model(written, torch.float32, device="cuda", quantize="int8")
    assert model.weight_layout == "int8"
    meta = LoRAKernelMeta.make(select_backend("cuda", KernelConfig()), pool.num_slots, MAX_RANK, 64, "cuda",
                               granule=pool.granule)  # fmt: skip
    graphs = DecodeGraphs(model, meta, DecodeGraphConfig(token_buckets=(4, 8)))
    diffs = decode_replays_vs_eager(model, registry, pool, meta, rows, graphs)
    assert max(diffs) <= FP32_TOL, diffs


def test_warm_up_captures_every_bucket(written) -> None:
    model, _, pool, _ = slotted_model(written, torch.float32, device="cuda")
    meta = LoRAKernelMeta.make(select_backend("cuda", KernelConfig()), pool.num_slots, MAX_RANK, 64, "cuda",
                               granule=pool.granule)  # fmt: skip
    graphs = DecodeGraphs(model, meta)
    graphs.warm_up()
    assert graphs.captured == (1, 2, 4, len(ROWS)), "up to the cache's rows (7)"
