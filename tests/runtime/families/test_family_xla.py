"""The served families on the torch_xla CPU device (XLA lane): the engine's trace with swaps (3 adapters through 2
slots) and changing mixes compiles nothing after warm-up, and every greedy generation equals HF transformers + PEFT
one adapter at a time. The laned kernels for the families whose terms reach the traced graph differently (Qwen2's
bias, Gemma 2's soft-capped attention, Gemma 3's q/k norms and local RoPE, Phi-3's fused load; Gemma 1, Mistral and
Qwen3 add a subset of those), the Pallas kernels (interpreted as HLO) for Qwen3."""

from __future__ import annotations

import pytest
import torch

from adapter_manager import AdapterManager, AdapterManagerConfig, RowOptions
from adapter_manager.kernels import BackendKind, KernelConfig, PallasInterpret
from adapter_manager.runtime.model.checkpoint import load_model
from tests.runtime.engine._xla_trace import serve_trace
from tests.runtime.families._oracle import NEW_TOKENS, greedy, requests

pytestmark = pytest.mark.xla
torch_xla = pytest.importorskip("torch_xla")
pytest.importorskip("peft")

PALLAS = KernelConfig(xla_backend=BackendKind.PALLAS, pallas_interpret=PallasInterpret.HLO)
LANED_FAMILIES = ("qwen2", "gemma2", "gemma3", "phi3")


def _trace(family, kernels: KernelConfig | None) -> None:
    device = torch_xla.device()
    model = load_model(family.folder, dtype=torch.float32, device=device)
    config = AdapterManagerConfig(max_slots=2, rows=RowOptions(max_rank=8), device=device, prefetch_workers=0)
    manager = AdapterManager(model.config.to_spec("base"), config)
    try:
        for name, (folder, _) in family.adapters.items():
            manager.register(str(folder), adapter_id=name)
        handles, graphs, compiled = serve_trace(
            model, manager, requests(family), list(family.adapters)[:2], NEW_TOKENS, seed=3, kernels=kernels
        )
        assert graphs > 0 and compiled == 0, f"{family.name}: {compiled} compiles after warm-up"
        assert len(handles) > 10
        for handle, prompt, name in handles:
            assert handle.result(timeout=0) == greedy(family, prompt, name), (family.name, prompt, name)
    finally:
        manager.close()


def test_family_on_xla_equals_transformers_and_compiles_nothing_after_warm_up(family) -> None:
    if family.name not in LANED_FAMILIES:
        pytest.skip(f"the laned XLA trace runs {LANED_FAMILIES}: this family's terms are a subset of theirs")
    _trace(family, None)


def test_family_with_the_pallas_kernels_on_xla(family) -> None:
    if family.name != "qwen3":
        pytest.skip("the Pallas backend runs one family (qwen3: q/k norms, explicit head_dim): the LoRA is the same")
    _trace(family, PALLAS)
