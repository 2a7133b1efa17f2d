"""DecodeGraphs without a GPU: its buckets, what it refuses, and a replay without the graph (cuda_graph=False) against
the eager step. Capture and graph replay run in tests/runtime/engine/test_cuda_graphs_gpu.py (skipped without a CUDA
device)."""

from __future__ import annotations

import warnings

import pytest
import torch

from adapter_manager.kernels import BackendKind, KernelConfig, LoRAKernelMeta, select_backend
from adapter_manager.runtime.engine.cuda_graphs import DecodeGraphConfig, DecodeGraphs, can_capture, use_decode_graphs
from adapter_manager.runtime.model.config import LlamaConfig
from adapter_manager.runtime.model.llama import Llama
from tests.conftest import TINY
from tests.runtime._oracle import FP32_TOL, MAX_RANK, ROWS
from tests.runtime._steps import decode_replays_vs_eager, slotted_model


def test_the_config_is_checked_and_a_step_takes_the_smallest_bucket():
    with pytest.raises(ValueError, match="distinct, ascending"):
        DecodeGraphConfig(token_buckets=(4, 2))
    with pytest.raises(ValueError, match="warmup_steps"):
        DecodeGraphConfig(warmup_steps=0)
    config = DecodeGraphConfig(token_buckets=(1, 4, 8))
    assert [config.bucket_for(n) for n in (1, 2, 4, 5, 8)] == [1, 4, 4, 8, 8]
    assert config.bucket_for(9) is None, "more tokens than the largest bucket: an eager step"
    assert DecodeGraphConfig.up_to(6).token_buckets == (1, 2, 4, 6)
    assert DecodeGraphConfig.up_to(64).token_buckets == (1, 2, 4, 8, 16, 32, 64)


@pytest.mark.usefixtures("triton_interpret")
def test_capture_needs_the_triton_backend_and_a_cuda_model():
    model = Llama(LlamaConfig.from_hf(TINY))
    model.setup_caches(max_batch=3, max_seq_len=16)
    torch_meta = LoRAKernelMeta.make(select_backend("cpu", KernelConfig(backend=BackendKind.TORCH)), 4, 8, 64, "cpu")
    with pytest.raises(ValueError, match="need the triton backend"):
        DecodeGraphs(model, torch_meta)
    triton_meta = LoRAKernelMeta.make(select_backend("cpu", KernelConfig(backend=BackendKind.TRITON)), 4, 8, 64, "cpu")
    with pytest.raises(ValueError, match="need a cuda model"):
        DecodeGraphs(model, triton_meta)
    cache = model.layers[0].attention.kv_cache
    assert model.max_batch == 3 and cache.num_blocks == 3 + 1, (
        "a refusal changes nothing (3 rows of one 16-token block, and the spare)"
    )
    assert not can_capture(triton_meta) and not can_capture(torch_meta), "the engine's test: cuda and triton only"


@pytest.mark.usefixtures("triton_interpret")
def test_a_replay_without_a_graph_equals_the_eager_step_across_a_swap(written):
    """Everything a replay does but the capture (static buffers, padding into the spare row, the token table copied
    into the static one, logits rows) on CPU, the kernels in Triton's interpreter; the graph itself: test_cuda.py."""
    model, registry, pool, rows = slotted_model(written, torch.float32)
    backend = select_backend("cpu", KernelConfig(backend=BackendKind.TRITON, bgmv_max_tokens=8))  # prefill: SGMV
    meta = LoRAKernelMeta.make(backend, pool.num_slots, MAX_RANK, 64, "cpu", granule=pool.granule)
    graphs = DecodeGraphs(model, meta, DecodeGraphConfig(token_buckets=(4, 8), cuda_graph=False))
    diffs = decode_replays_vs_eager(model, registry, pool, meta, rows, graphs)
    assert max(diffs) <= FP32_TOL, diffs
    assert graphs.captured == (8,) and graphs.spare_row == len(ROWS)


def _graphed(written):
    model, _, pool, _ = slotted_model(written, torch.float32)
    backend = select_backend("cpu", KernelConfig(backend=BackendKind.TRITON, bgmv_max_tokens=8))
    return model, LoRAKernelMeta.make(backend, pool.num_slots, MAX_RANK, 64, "cpu", granule=pool.granule)


NO_GRAPH = DecodeGraphConfig(token_buckets=(2, 4), cuda_graph=False)  # every step of a replay but the capture


@pytest.mark.usefixtures("triton_interpret")
def test_first_contact_keeps_graphs_whose_replay_equals_the_eager_step(written):
    model, meta = _graphed(written)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning on the good path
        graphs = use_decode_graphs(model, meta, NO_GRAPH)
    assert graphs is not None and graphs.captured == (2, 4)


@pytest.mark.usefixtures("triton_interpret")
def test_a_capture_that_raises_leaves_eager_decode_with_one_warning(written, monkeypatch):
    model, meta = _graphed(written)

    def broken(self, bucket):  # noqa: ANN001, ANN202
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeGraphs, "capture", broken)
    with pytest.warns(RuntimeWarning, match="CUDA graphs off.*capturing the decode steps failed.*not permitted"):
        assert use_decode_graphs(model, meta, NO_GRAPH) is None


@pytest.mark.usefixtures("triton_interpret")
def test_a_replay_that_differs_leaves_eager_decode_with_one_warning(written, monkeypatch):
    model, meta = _graphed(written)
    run_static = DecodeGraphs._run_static
    monkeypatch.setattr(DecodeGraphs, "_run_static", lambda self, captured: run_static(self, captured) + 0.5)
    with pytest.warns(RuntimeWarning, match="CUDA graphs off.*replayed decode step differs from the eager one by 0.5 "):
        assert use_decode_graphs(model, meta, NO_GRAPH) is None
