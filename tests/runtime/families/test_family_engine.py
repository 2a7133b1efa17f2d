"""Every served family through the engine (mixed batches, more adapters than slots, hot swaps) equals HF
transformers + PEFT run one adapter at a time: greedy tokens and prompt logprobs (fp32, ≤ 1e-4)."""

from __future__ import annotations

import pytest
import torch

from adapter_manager import AdapterManager, AdapterManagerConfig
from adapter_manager.runtime.engine.engine import Engine, EngineConfig, SamplingParams
from adapter_manager.runtime.engine.scheduler import SchedulerConfig
from adapter_manager.runtime.model.checkpoint import load_model
from tests.runtime.families._oracle import NEW_TOKENS, greedy, prompt_logprobs, requests

TOL = 1e-4


def serve(family, cpu_ops: bool = True, **engine_kwargs) -> list[tuple[list[int], list[float]]]:
    model = load_model(family.folder, dtype=torch.float32)
    model.cpu_ops = cpu_ops
    manager = AdapterManager(model.config.to_spec("base"), AdapterManagerConfig(max_slots=2, max_rank=8))
    for name, (folder, _) in family.adapters.items():
        manager.register(str(folder), adapter_id=name)
    config = EngineConfig(
        max_batch=4, max_seq_len=64, scheduler=SchedulerConfig(token_budget=12), eos_ids=(), **engine_kwargs
    )
    engine = Engine(model, manager, config)
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, prompt_logprobs=0)
        handles = [engine.submit(prompt, adapter, params) for prompt, adapter in requests(family)]
        engine.run_until_idle()
        return [(h.result(timeout=0), [lp.logprob for lp in h.prompt_logprobs[1:]]) for h in handles]
    finally:
        engine.close()
        manager.close()


@pytest.mark.parametrize("cpu_ops", [True, False], ids=["cpp-glue", "torch-forms"])
def test_family_equals_transformers_and_peft(family, cpu_ops) -> None:
    served = serve(family, cpu_ops=cpu_ops)
    for (prompt, adapter), (tokens, logprobs) in zip(requests(family), served, strict=True):
        assert tokens == greedy(family, prompt, adapter), (family.name, prompt, adapter)
        expected = torch.tensor(prompt_logprobs(family, prompt, adapter))
        assert torch.allclose(torch.tensor(logprobs), expected, atol=TOL, rtol=0), (family.name, prompt, adapter)
