"""The deterministic mode on the real model (SmolLM2-135M-Instruct, 3 query heads per KV head: the attention op's
other form) with its trained adapter on half the requests: the issue's case, where the default gave the same bf16
tokens alone and in company for 5 of 8 requests. In the mode every request's tokens and logprobs are the same bits."""

from __future__ import annotations

import random

import pytest
import torch

from adapter_manager import AdapterManager, AdapterManagerConfig, RowOptions
from adapter_manager.kernels.cpu import load, unavailable_reason
from adapter_manager.runtime.engine.engine import Engine, EngineConfig
from adapter_manager.runtime.engine.sampling import SamplingParams
from adapter_manager.runtime.model.checkpoint import load_model

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(not load(), reason=f"no CPU kernels: {unavailable_reason()}"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_alone_and_in_company_the_same_bits(real_model, dtype) -> None:
    model_dir, adapter_dir = real_model
    model = load_model(model_dir, dtype=dtype, pack_weights=False)
    spec = model.config.to_spec("smol")
    manager = AdapterManager(
        spec, AdapterManagerConfig(max_slots=1, rows=RowOptions(max_rank=8), dtype=dtype, prefetch_workers=0)
    )
    manager.register(str(adapter_dir), adapter_id="secret")
    rng = random.Random(0)
    requests = [
        ([rng.randrange(3, model.config.vocab_size) for _ in range(rng.randrange(16, 65))], "secret" if i % 2 else None)
        for i in range(16)
    ]
    params = SamplingParams(max_tokens=32, logprobs=1, ignore_eos=True)

    def serve(chosen: list) -> list:
        engine = Engine(model, manager, EngineConfig(max_batch=16, max_seq_len=128, deterministic=True))
        try:
            handles = [engine.submit(prompt, adapter, params) for prompt, adapter in chosen]
            engine.run_until_idle()
            return [(h.result(timeout=0), h.logprobs) for h in handles]
        finally:
            engine.close()

    try:
        alone = [serve([request])[0] for request in requests[:8]]
        assert serve(requests)[:8] == alone
    finally:
        manager.close()
