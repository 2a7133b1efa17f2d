"""Oracle (adapters) for the triton backend, its kernels in Triton's interpreter on the tiny Llama: each row of a
mixed batch equals `PeftModel` with that row's adapter alone, the prefill through SGMV. Greedy decoding through BGMV
against HF generate: tests/runtime/engine/test_engine_triton.py (through the engine); a replayed decode step against
the eager one: tests/runtime/engine/test_cuda_graphs.py."""

from __future__ import annotations

import pytest
import torch

from adapter_manager.kernels import BackendKind, KernelConfig, LoRAKernelMeta, select_backend
from tests.runtime._oracle import FP32_TOL, MAX_RANK, ROWS, SLOTTED, max_diff, oracle_logits, slots_of
from tests.runtime._steps import prefill_logits, slotted_model

pytestmark = pytest.mark.usefixtures("triton_interpret")


def triton_setup(written, bgmv_max_tokens: int):
    model, _, pool, rows = slotted_model(written, torch.float32)
    backend = select_backend("cpu", KernelConfig(backend=BackendKind.TRITON, bgmv_max_tokens=bgmv_max_tokens))
    meta = LoRAKernelMeta.make(backend, pool.num_slots, MAX_RANK, 256, "cpu", granule=pool.granule)
    return model, meta, rows


def test_mixed_batch_logits_equal_peft_per_row(written) -> None:
    """The 33-token prefill through SGMV (the BGMV pair runs the decode steps below)."""
    model, meta, rows = triton_setup(written, 0)
    prompts, adapters = [p for p, _ in ROWS], [a for _, a in ROWS]
    ours = prefill_logits(model, prompts, slots_of(adapters, SLOTTED), meta, slot_rows=rows)
    assert meta.fused
    tables = meta.backend.step_tables(meta)
    assert tables.tokens is None and tables.runs is not None, "SGMV: the runs table"
    for logits, prompt, name in zip(ours, prompts, adapters, strict=True):
        assert max_diff(logits, oracle_logits(written, name, prompt)) <= FP32_TOL, name
