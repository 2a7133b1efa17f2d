"""LoRA variants on the torch_xla CPU device (XLA lane): DoRA and LoRA-bias adapters beside plain LoRA and base rows,
more adapters than slots, every greedy generation equal to `PeftModel`'s, and no compile after warm-up (the vector
epilogue is in every step's graph, so a variant's arrival changes no shape)."""

from __future__ import annotations

import pytest
import torch

from adapter_manager import AdapterManager, AdapterManagerConfig, RowOptions
from adapter_manager.runtime.model.checkpoint import load_model
from tests.conftest import TINY_NAME
from tests.runtime._oracle import MAX_RANK, hf_greedy
from tests.runtime._variants import VARIANT_ROWS, VARIANTS
from tests.runtime.engine._xla_trace import BUCKETS, serve_trace

pytestmark = pytest.mark.xla
torch_xla = pytest.importorskip("torch_xla")
pytest.importorskip("peft")

NEW_TOKENS = 5


def test_variants_after_warm_up_compile_nothing_and_match_peft(written_variants):
    expected = {(tuple(p), name): hf_greedy(written_variants[name][1], p, NEW_TOKENS) for p, name in VARIANT_ROWS}
    device = torch_xla.device()
    model = load_model(written_variants[None][0], dtype=torch.float32, device=device)
    config = AdapterManagerConfig(max_slots=2, rows=RowOptions(max_rank=MAX_RANK), device=device, prefetch_workers=0)
    manager = AdapterManager(model.config.to_spec(TINY_NAME), config)
    for name in VARIANTS:
        manager.register(str(written_variants[name][0]), adapter_id=name)
    try:
        handles, graphs, compiled = serve_trace(model, manager, VARIANT_ROWS, ["plain", "bias"], NEW_TOKENS, 0)
        assert graphs == 2 * 2 * len(BUCKETS)
        assert compiled == 0, "a step after warm-up compiled"
        assert {name for _, _, name in handles} >= set(VARIANTS)
        for handle, prompt, name in handles:
            assert handle.result(timeout=0) == expected[(tuple(prompt), name)], (prompt, name)
        assert manager.metrics().evictions["slot"] > 0
    finally:
        manager.close()
