"""DecodeGraphs' rules, checked without a GPU: what it refuses and how it pads. Capture and replay themselves run in
tests/runtime/model/test_cuda.py (skipped without a CUDA device)."""

from __future__ import annotations

import pytest

from kernels import BackendKind, KernelConfig, LoRAKernelMeta, select_backend
from runtime.model.batch import StaticPadding
from runtime.model.config import LlamaConfig
from runtime.model.cuda_graphs import DecodeGraphConfig, DecodeGraphs
from runtime.model.llama import Llama
from tests.conftest import TINY


def test_the_config_is_checked_and_pads_to_the_smallest_bucket():
    with pytest.raises(ValueError, match="distinct, ascending"):
        DecodeGraphConfig(token_buckets=(4, 2))
    with pytest.raises(ValueError, match="warmup_steps"):
        DecodeGraphConfig(warmup_steps=0)
    config = DecodeGraphConfig(token_buckets=(1, 4, 8), logits_rows=2, spare_row=2)
    assert config.padding(3) == StaticPadding(4, 2, 2) and config.padding(8) == StaticPadding(8, 2, 2)
    assert config.padding(9) is None, "more tokens than the largest bucket: an eager step"


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
