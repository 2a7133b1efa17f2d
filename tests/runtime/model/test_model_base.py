"""Oracle (no adapter): the batched model's logits equal HF `LlamaForCausalLM` on the same checkpoint, fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from adapter_manager.runtime.model.batch import ForwardBatch, SequenceChunk
from adapter_manager.runtime.model.checkpoint import load_model
from adapter_manager.runtime.model.llama import Llama
from tests.conftest import TINY, make_tiny_llama
from tests.runtime._steps import greedy, prefill_logits, step

transformers = pytest.importorskip("transformers")

FP32_TOL = 1e-4
PROMPTS = [[1, 5, 9, 3, 7, 11, 2], [2, 8], [4, 60, 4, 33, 4, 17, 4, 4, 9, 12, 50], [7]]
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # [len, vocab]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="module", params=["default", "llama3"])
def hf_and_ours(request, tmp_path_factory) -> tuple[object, Llama]:
    folder = tmp_path_factory.mktemp(f"ckpt-{request.param}")
    if request.param == "default":
        hf = make_tiny_llama()
    else:
        config = transformers.LlamaConfig(**TINY, rope_scaling=LLAMA3_ROPE)
        torch.manual_seed(1)
        hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(folder)
    model = load_model(folder)
    model.setup_caches(max_batch=6, max_seq_len=40)
    return hf, model


@pytest.mark.parametrize("static", [False, True], ids=["spans", "static"])
def test_ragged_prefill_then_decode_equals_hf(hf_and_ours, static: bool) -> None:
    hf, model = hf_and_ours
    for ours, prompt in zip(prefill_logits(model, PROMPTS, static=static), PROMPTS, strict=True):
        assert max_diff(ours, hf_logits(hf, prompt)) <= FP32_TOL
    generated, step_logits = greedy(model, PROMPTS, new_tokens=6, static=static)
    for row, prompt in enumerate(PROMPTS):
        full = hf_logits(hf, prompt + generated[row])  # [len + 6, vocab]
        for i, logits in enumerate(step_logits):
            assert max_diff(logits[row], full[len(prompt) - 1 + i]) <= FP32_TOL


def test_llama3_scaling_reaches_the_model(hf_and_ours) -> None:
    hf, model = hf_and_ours
    scaled = hf.config.rope_parameters.get("rope_type") == "llama3"
    assert (model.config.rope_scaling.rope_type == "llama3") == scaled


def test_mixed_prefill_and_decode_in_one_step(hf_and_ours) -> None:
    """Continuous batching: a new prompt's prefill shares a step with other sequences' decode tokens."""
    hf, model = hf_and_ours
    a, b = PROMPTS[0], PROMPTS[2]
    step(model, [SequenceChunk(0, 0, tuple(a))])
    # row 0 decodes one token while row 3 prefills b in two chunks (chunked prefill), then both decode together
    first = step(model, [SequenceChunk(0, len(a), (13,)), SequenceChunk(3, 0, tuple(b[:5]))], logits="all")
    second = step(model, [SequenceChunk(3, 5, tuple(b[5:])), SequenceChunk(0, len(a) + 1, (21,))], logits="all")
    ref_a, ref_b = hf_logits(hf, [*a, 13, 21]), hf_logits(hf, b)
    assert max_diff(first[0], ref_a[len(a)]) <= FP32_TOL
    assert max_diff(first[1:], ref_b[:5]) <= FP32_TOL
    assert max_diff(second[: len(b) - 5], ref_b[5:]) <= FP32_TOL
    assert max_diff(second[-1], ref_a[len(a) + 1]) <= FP32_TOL


def test_forward_checks_its_inputs(hf_and_ours) -> None:
    _, model = hf_and_ours
    with pytest.raises(ValueError, match="max_seq_len 40"):
        step(model, [SequenceChunk(0, 38, (1, 2, 3))])
    with pytest.raises(ValueError, match="repeat"):
        ForwardBatch.from_chunks([SequenceChunk(0, 0, (1,)), SequenceChunk(0, 1, (2,))])
    with pytest.raises(ValueError, match="cache_row"):
        SequenceChunk(-1, 0, (1,))


def test_setup_caches_is_explicit(tmp_path: Path) -> None:
    make_tiny_llama().save_pretrained(tmp_path)
    model = load_model(tmp_path)
    with pytest.raises(ValueError, match="setup_caches"):
        step(model, [SequenceChunk(0, 0, (1,))])
    model.setup_caches(max_batch=2, max_seq_len=8)
    cache = model.layers[0].attention.kv_cache
    # 2 sequences of one 16-position block each (8 positions round up), and the spare block
    assert cache is not None and tuple(cache.k.shape) == (3, 16, TINY["num_key_value_heads"], 8)
    with torch.device("meta"):
        meta_model = Llama(model.config)
    with pytest.raises(ValueError, match="meta device"):
        meta_model.setup_caches(1, 8)
