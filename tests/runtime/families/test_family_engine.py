"""Every served family through the engine (mixed batches, more adapters than slots, hot swaps) equals HF
transformers + PEFT run one adapter at a time: greedy tokens and prompt logprobs (fp32, ≤ 1e-4), with the C++ decode
glue, the torch forms and the deterministic mode (which refuses Gemma 2's attention soft-cap by name)."""

from __future__ import annotations

import pytest
import torch

from adapter_manager import AdapterManager, AdapterManagerConfig, RowOptions
from adapter_manager.runtime.engine.engine import Engine, EngineConfig, SamplingParams
from adapter_manager.runtime.engine.scheduler import SchedulerConfig
from adapter_manager.runtime.model.checkpoint import load_model
from adapter_manager.runtime.model.families import UnsupportedModelError
from tests.runtime.families._oracle import NEW_TOKENS, greedy, prompt_logprobs, requests

TOL = 1e-4


def serve(
    family, cpu_ops: bool = True, lora_vocab: bool = False, limit: int | None = None, **engine_kwargs
) -> list[tuple[list[int], list[float]]]:
    model = load_model(family.folder, dtype=torch.float32)
    model.cpu_ops = cpu_ops
    pool = AdapterManagerConfig(max_slots=2, rows=RowOptions(max_rank=8, lora_vocab=lora_vocab))
    manager = AdapterManager(model.config.to_spec("base"), pool)
    try:
        for name, (folder, _) in family.adapters.items():
            manager.register(str(folder), adapter_id=name)
        config = EngineConfig(
            max_batch=4, max_seq_len=64, scheduler=SchedulerConfig(token_budget=12), eos_ids=(), **engine_kwargs
        )
        engine = Engine(model, manager, config)
        try:
            params = SamplingParams(max_tokens=NEW_TOKENS, prompt_logprobs=0)
            handles = [engine.submit(prompt, adapter, params) for prompt, adapter in requests(family)[:limit]]
            engine.run_until_idle()
            return [(h.result(timeout=0), [lp.logprob for lp in h.prompt_logprobs[1:]]) for h in handles]
        finally:
            engine.close()
    finally:
        manager.close()


@pytest.mark.parametrize("mode", ["cpp-glue", "torch-forms", "deterministic"])
def test_family_equals_transformers_and_peft(family, mode) -> None:
    deterministic = mode == "deterministic"
    if deterministic and family.name == "gemma2":
        with pytest.raises(UnsupportedModelError, match="attn_logit_softcapping"):
            serve(family, deterministic=True)
        return
    served = serve(family, cpu_ops=mode != "torch-forms", deterministic=deterministic)
    for (prompt, adapter), (tokens, logprobs) in zip(requests(family), served, strict=True):
        assert tokens == greedy(family, prompt, adapter), (family.name, prompt, adapter)
        expected = torch.tensor(prompt_logprobs(family, prompt, adapter))
        assert torch.allclose(torch.tensor(logprobs), expected, atol=TOL, rtol=0), (family.name, prompt, adapter)


@pytest.mark.parametrize("name", ["gemma", "qwen2"])
def test_embedding_lora_on_a_family_equals_peft(name, tmp_path) -> None:
    """Gemma scales its embedding inside the module PEFT wraps (PEFT scales the LoRA delta alike); Qwen2 ties its
    head: an adapter on embed_tokens and the projections, served with the pool's vocabulary columns."""
    from tests.runtime.families._models import write_family

    vocab = {"emb": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj", "down_proj"])}
    family = write_family(tmp_path, name, vocab)
    served = serve(family, lora_vocab=True)
    for (prompt, adapter), (tokens, logprobs) in zip(requests(family), served, strict=True):
        assert tokens == greedy(family, prompt, adapter), (name, prompt, adapter)
        expected = torch.tensor(prompt_logprobs(family, prompt, adapter))
        assert torch.allclose(torch.tensor(logprobs), expected, atol=TOL, rtol=0), (name, prompt, adapter)


@pytest.mark.usefixtures("triton_interpret")
@pytest.mark.parametrize("name", ["qwen2", "phi3"])
def test_family_on_the_triton_backend_equals_peft(name, tmp_path) -> None:
    """The triton backend's executor (its kernels interpreted on CPU tensors) under a family's terms: Qwen2's bias
    after its one-call form, Phi-3's fused adapters; four requests (interpret mode runs each kernel program in
    Python)."""
    from adapter_manager.kernels import BackendKind, KernelConfig
    from tests.runtime.families._models import write_family

    family = write_family(tmp_path, name)
    served = serve(family, limit=4, kernels=KernelConfig(backend=BackendKind.TRITON))
    for (prompt, adapter), (tokens, logprobs) in zip(requests(family)[:4], served, strict=True):
        assert tokens == greedy(family, prompt, adapter), (name, prompt, adapter)
        expected = torch.tensor(prompt_logprobs(family, prompt, adapter))
        assert torch.allclose(torch.tensor(logprobs), expected, atol=TOL, rtol=0), (name, prompt, adapter)
