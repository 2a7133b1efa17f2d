"""The engine's CUDA path (pinned host tier, one async copy per slot load) against the same oracle as on CPU.

Skipped where no CUDA device is present (CI); run on a GPU machine with ``pytest tests/runtime/test_cuda.py``
(the kernels' CUDA tests are in tests/kernels/test_cuda.py).
"""

from __future__ import annotations

import pytest
import torch

from adapter_manager import AdapterManager, AdapterManagerConfig
from runtime.engine import Engine, EngineConfig, SamplingParams, SchedulerConfig
from runtime.model import load_model
from tests.conftest import TINY_NAME
from tests.runtime._oracle import ADAPTERS, ROWS
from tests.runtime._oracle import ENGINE_NEW_TOKENS as NEW_TOKENS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


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
