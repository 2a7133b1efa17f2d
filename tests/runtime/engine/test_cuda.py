"""The engine's CUDA path (pinned host tier, one async copy per slot load) against the same oracle as on CPU.

Skipped where no CUDA device is present (CI); run on a GPU machine with ``pytest tests/runtime/engine/test_cuda.py``
(the kernels' CUDA tests are in tests/kernels/test_cuda.py).
"""

from __future__ import annotations

import pytest
import torch

from adapter_manager.runtime.engine import SamplingParams
from adapter_manager.runtime.model import load_model
from tests.runtime._oracle import ADAPTERS, ENGINE_REQUESTS
from tests.runtime._oracle import ENGINE_NEW_TOKENS as NEW_TOKENS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_engine_on_cuda_matches_peft(written, expected, make_engine):
    """5 PEFT adapters through 2 CUDA slots (pinned host tier, async copies): every row equals HF + PEFT greedy."""
    engine, manager = make_engine(model=load_model(written[None][0], dtype=torch.float32, device="cuda"), device="cuda")
    handles = [engine.submit(p, a, SamplingParams(max_tokens=NEW_TOKENS)) for p, a in ENGINE_REQUESTS]
    engine.run_until_idle(max_steps=500)
    try:
        for handle, (prompt, name) in zip(handles, ENGINE_REQUESTS, strict=True):
            assert handle.result(timeout=0) == expected[(tuple(prompt), name)], (prompt, name)
        assert manager.metrics().moves["host_to_slot"].count >= len(ADAPTERS)
        assert all(s.a.is_cuda and s.bt.is_cuda for s in manager.stacks.values())
    finally:
        manager.close()


def test_sampling_options_on_cuda_equal_cpu(written, make_engine):
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
        engine, manager = make_engine(model=model, adapters=("qv",), token_budget=32, device=device)
        handles = [engine.submit([4, 60, 4, 33, 4, 17], "qv" if i % 2 else None, p) for i, p in enumerate(options)]
        engine.run_until_idle(max_steps=100)
        runs.append([(h.result(timeout=0), h.logprobs, h.prompt_logprobs) for h in handles])
        manager.close()
    for (tokens, logprobs, prompt), (cuda_tokens, cuda_logprobs, cuda_prompt) in zip(*runs, strict=True):
        assert cuda_tokens == tokens
        for ours, theirs in zip(cuda_logprobs + cuda_prompt[1:], logprobs + prompt[1:], strict=True):
            assert ours.token == theirs.token and abs(ours.logprob - theirs.logprob) < 1e-4
            assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]
