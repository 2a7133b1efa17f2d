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


def test_sampling_options_on_cuda_equal_cpu(written):
    """The batched sampler on the device (penalties, bias, min_tokens, seeded top-p, logprobs, prompt logprobs) gives
    the CPU engine's tokens, and logprobs within 1e-4."""
    options = [
        SamplingParams(max_tokens=6, repetition_penalty=1.5, frequency_penalty=0.5, logprobs=3, prompt_logprobs=3),
        SamplingParams(max_tokens=6, logit_bias={3: 4.0}, min_tokens=4, stop_ids=(5,), presence_penalty=1.0),
        SamplingParams(max_tokens=6, temperature=0.9, top_p=0.8, seed=4, logprobs=1),
        SamplingParams(max_tokens=6),
    ]
    runs = []
    for device in ("cpu", "cuda"):
        model = load_model(written[None][0], dtype=torch.float32, device=device)
        manager = AdapterManager(
            model.config.to_spec(TINY_NAME), AdapterManagerConfig(max_slots=2, max_rank=8, device=device)
        )
        manager.register(str(written["qv"][0]), adapter_id="qv")
        config = EngineConfig(max_batch=4, max_seq_len=64, scheduler=SchedulerConfig(token_budget=32), eos_ids=())
        engine = Engine(model, manager, config)
        handles = [engine.submit([4, 60, 4, 33, 4, 17], "qv" if i % 2 else None, p) for i, p in enumerate(options)]
        engine.run_until_idle(max_steps=100)
        runs.append([(h.result(timeout=0), h.logprobs, h.prompt_logprobs) for h in handles])
        manager.close()
    for (tokens, logprobs, prompt), (cuda_tokens, cuda_logprobs, cuda_prompt) in zip(*runs, strict=True):
        assert cuda_tokens == tokens
        for ours, theirs in zip(cuda_logprobs + cuda_prompt[1:], logprobs + prompt[1:], strict=True):
            assert ours.token == theirs.token and abs(ours.logprob - theirs.logprob) < 1e-4
            assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]
