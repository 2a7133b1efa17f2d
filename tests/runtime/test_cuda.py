"""The CUDA path (pinned host tier, async slot copies, every torch form on the GPU) against the same oracles as CPU.

Skipped where no CUDA device is present (CI); run on a GPU machine with ``pytest tests/runtime/test_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch

from adapter_manager import AdapterManager, AdapterManagerConfig
from kernels import KernelConfig, LoRAForm, LoRAKernelMeta, expand, select_backend, shrink
from runtime.engine import Engine, EngineConfig, SamplingParams, SchedulerConfig
from runtime.model import load_model
from tests.conftest import TINY_NAME
from tests.kernels._cases import MIXES, TOLERANCE, make_stacks, reference_forward, slot_mix
from tests.runtime._oracle import ADAPTERS, ROWS
from tests.runtime._oracle import ENGINE_NEW_TOKENS as NEW_TOKENS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("form", [LoRAForm.AUTO, LoRAForm.SEGMENTS, LoRAForm.GROUPED, LoRAForm.LANED])
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernels_on_cuda_match_the_reference(form, mix, dtype):
    gen = torch.Generator().manual_seed(1)
    a, bt = make_stacks(6, 8, 48, 80, gen)
    x, y = torch.randn(37, 48, generator=gen), torch.randn(37, 80, generator=gen)
    slots = slot_mix(mix, 37, 6, gen)
    x, y, a, bt = (t.to(dtype) for t in (x, y, a, bt))
    h_ref, y_ref = reference_forward(x, y, a, bt, slots)
    backend = select_backend("cuda", KernelConfig(torch_form=form))
    meta = LoRAKernelMeta.make(backend, 6, 8, 64, "cuda")
    meta.prepare(slots)  # host indices: the step's one sync is free
    h = shrink(x.cuda(), a.cuda(), meta)
    y_new = expand(y.cuda(), h, bt.cuda(), meta).cpu()
    torch.testing.assert_close(h.cpu().float(), h_ref, **TOLERANCE[dtype])
    torch.testing.assert_close(y_new.float(), y_ref, **TOLERANCE[dtype])
    none = slots < 0
    assert torch.equal(y_new[none], y[none]), "slot -1 rows of y must be unchanged bit for bit"


def test_engine_on_cuda_matches_peft(written, expected):
    """5 PEFT adapters through 2 CUDA slots (pinned host tier, async copies): every row equals HF + PEFT greedy."""
    model = load_model(written[None][0], dtype=torch.float32, device="cuda")
    config = AdapterManagerConfig(max_slots=2, max_rank=8, device="cuda")
    manager = AdapterManager(model.config.to_spec(TINY_NAME), config)
    for name in ADAPTERS:
        manager.register(str(written[name][0]), adapter_id=name)
    engine_config = EngineConfig(max_batch=4, max_seq_len=64, scheduler=SchedulerConfig(token_budget=12), eos_ids=())
    engine = Engine(model, manager, engine_config)
    requests = ROWS + [([3, 1, 4, 1, 5], name) for name in ADAPTERS]
    handles = [engine.submit(p, a, SamplingParams(max_tokens=NEW_TOKENS)) for p, a in requests]
    engine.run_until_idle(max_steps=500)
    try:
        for handle, (prompt, name) in zip(handles, requests, strict=True):
            assert handle.result(timeout=0) == expected[(tuple(prompt), name)], (prompt, name)
        assert manager.metrics().moves["host_to_slot"].count >= len(ADAPTERS)
        assert all(s.a.is_cuda and s.bt.is_cuda for s in manager.stacks.values())
    finally:
        manager.close()
