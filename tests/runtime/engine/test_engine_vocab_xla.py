"""The vocabulary modules on the torch_xla CPU device (XLA lane): embedding / lm_head LoRA and trainable tokens beside
plain LoRA and base rows, more adapters than slots, every greedy generation equal to `PeftModel`'s, and no compile
after warm-up (the vocabulary LoRA is laned in every step's graph, so a vocabulary adapter's arrival changes no
shape)."""

from __future__ import annotations

import pytest
import torch

from adapter_manager import AdapterManager, AdapterManagerConfig, RowOptions
from adapter_manager.runtime.model.checkpoint import load_model
from tests.conftest import TINY_NAME
from tests.runtime._oracle import MAX_RANK, hf_greedy
from tests.runtime._vocab import TIED_ROWS, UNTIED_ROWS
from tests.runtime.engine._xla_trace import serve_trace

pytestmark = pytest.mark.xla
torch_xla = pytest.importorskip("torch_xla")
pytest.importorskip("peft")

NEW_TOKENS = 5


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_vocab_adapters_after_warm_up_compile_nothing_and_match_peft(written_vocab, tied):
    base, rows = ("tied", TIED_ROWS) if tied else (None, UNTIED_ROWS)
    names = sorted({name for _, name in rows if name is not None})
    expected = {
        (tuple(p), name): hf_greedy(written_vocab[name if name else base][1], p, NEW_TOKENS) for p, name in rows
    }
    device = torch_xla.device()
    model = load_model(written_vocab[base][0], dtype=torch.float32, device=device)
    config = AdapterManagerConfig(
        max_slots=2, rows=RowOptions(max_rank=MAX_RANK, lora_vocab=True), device=device, prefetch_workers=0
    )
    manager = AdapterManager(model.config.to_spec(TINY_NAME), config)
    for name in names:
        manager.register(str(written_vocab[name][0]), adapter_id=name)
    try:
        handles, graphs, compiled = serve_trace(model, manager, rows, names[:2], NEW_TOKENS, 1)
        assert graphs > 0
        assert compiled == 0, "a step after warm-up compiled"
        assert {name for _, _, name in handles} >= set(names)
        for handle, prompt, name in handles:
            assert handle.result(timeout=0) == expected[(tuple(prompt), name)], (prompt, name)
        assert manager.metrics().evictions["slot"] > 0
    finally:
        manager.close()
