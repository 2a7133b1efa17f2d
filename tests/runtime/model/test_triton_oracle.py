"""Oracle (adapters) for the triton backend, its kernels in Triton's interpreter on the tiny Llama: each row of a
mixed batch equals `PeftModel` with that row's adapter alone, prefill through SGMV, and greedy decoding (BGMV steps)
equals HF generate. Kept short: each kernel program is a Python call in interpret mode."""

from __future__ import annotations

import pytest
import torch

from kernels import BackendKind, KernelConfig, LoRAKernelMeta, select_backend
from tests.runtime._oracle import FP32_TOL, MAX_RANK, ROWS, SLOTTED, max_diff, oracle_logits, slots_of
from tests.runtime._steps import greedy, prefill_logits, slotted_model

pytestmark = pytest.mark.usefixtures("triton_interpret")
NEW_TOKENS = 4
"""Half the torch oracle's: three BGMV decode steps after the prefill."""


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


def test_greedy_generations_equal_hf_generate(written) -> None:
    model, meta, rows = triton_setup(written, 16)  # the 33-token prefill through SGMV, the decode steps through BGMV
    prompts, adapters = [p for p, _ in ROWS], [a for _, a in ROWS]
    generated, _ = greedy(model, prompts, NEW_TOKENS, slots_of(adapters, SLOTTED), meta, slot_rows=rows)
    for ids, prompt, name in zip(generated, prompts, adapters, strict=True):
        hf = written[name][1]
        hf.generation_config.eos_token_id = None
        with torch.no_grad():
            out = hf.generate(
                input_ids=torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )
        assert ids == out[0, len(prompt) :].tolist(), name
