"""A weight-only int8 base (``load_model(quantize="int8")``: every projection and the untied lm_head): the oracle is
HF transformers (and PEFT, for adapters) on the same dequantized weights, ``W = q · s`` with one scale per output
row (tests/runtime/_oracle.py: computed independently of the quantizer); the int8 model must match it to fp32
precision, prefill and decode, with and without adapters, and keep the adapters' rows in the serving dtype."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from adapter_manager.kernels import WeightLayout
from adapter_manager.runtime.engine.sampling import SamplingParams
from adapter_manager.runtime.model.checkpoint import load_model
from adapter_manager.runtime.model.projection import LoRALinear
from tests.runtime._oracle import (
    BF16_ATOL,
    BF16_RTOL,
    ENGINE_NEW_TOKENS,
    ENGINE_REQUESTS,
    FP32_TOL,
    ROWS,
    int8_copy,
    int8_dequantized,
    int8_generate,
    max_diff,
)
from tests.runtime._steps import greedy, prefill_logits


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def hf_int8(written):
    return int8_copy(written[None][1])


def test_int8_model_equals_hf_on_the_dequantized_weights(written, hf_int8) -> None:
    model = load_model(written[None][0], dtype=torch.float32, quantize="int8")
    linears = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert len(linears) == 4 * len(model.layers) + 1  # every projection and the untied lm_head
    assert all(m.layout is WeightLayout.INT8 and m.weight is None for m in linears)
    assert model.weight_layout == "int8" and model.packed
    prompts = [p for p, _ in ROWS]
    model.setup_caches(max_batch=len(prompts), max_seq_len=32)
    plain = written[None][1]
    for ours, prompt in zip(prefill_logits(model, prompts), prompts, strict=True):
        assert max_diff(ours, _hf_logits(hf_int8, prompt)) <= FP32_TOL
        assert max_diff(ours, _hf_logits(plain, prompt)) > 10 * FP32_TOL  # it really is the int8 model
    generated, step_logits = greedy(model, prompts, new_tokens=5)
    for row, prompt in enumerate(prompts):
        full = _hf_logits(hf_int8, prompt + generated[row])
        for i, logits in enumerate(step_logits):
            assert max_diff(logits[row], full[len(prompt) - 1 + i]) <= FP32_TOL


def test_engine_serves_adapters_on_an_int8_base_matching_peft(written, make_engine) -> None:
    """Every (prompt, adapter) of the engine tests, batched with mixed adapters over 2 slots, greedy: the tokens PEFT
    generates on the dequantized base, one adapter at a time. The slots hold the adapters in fp32."""
    expected = int8_generate(written, ENGINE_REQUESTS)
    model = load_model(written[None][0], dtype=torch.float32, quantize="int8")
    engine, manager = make_engine(model=model)
    handles = [engine.submit(p, a, SamplingParams(max_tokens=ENGINE_NEW_TOKENS)) for p, a in ENGINE_REQUESTS]
    engine.run_until_idle(max_steps=500)
    for handle, (prompt, name) in zip(handles, ENGINE_REQUESTS, strict=True):
        assert handle.result(timeout=0) == expected[(tuple(prompt), name)], (prompt, name)
    assert manager.config.dtype == torch.float32
    manager.close()


def test_bf16_int8_model_is_within_bf16_of_the_dequantized_fp32_one(written, hf_int8) -> None:
    model = load_model(written[None][0], dtype=torch.bfloat16, quantize="int8")
    assert all(m.weight_dtype == torch.bfloat16 for m in model.layers.modules() if isinstance(m, LoRALinear))
    prompts = [p for p, _ in ROWS]
    model.setup_caches(max_batch=len(prompts), max_seq_len=32)
    for ours, prompt in zip(prefill_logits(model, prompts), prompts, strict=True):
        torch.testing.assert_close(ours.float(), _hf_logits(hf_int8, prompt), atol=BF16_ATOL, rtol=BF16_RTOL)


def test_an_int8_model_pickles_unpacks_and_refuses_bad_choices(written) -> None:
    model = load_model(written[None][0], dtype=torch.float32, quantize="int8")
    prompts = [p for p, _ in ROWS]
    copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
    for other in [model, *copies]:
        other.setup_caches(max_batch=len(prompts), max_seq_len=32)
    expected = prefill_logits(model, prompts)
    for other in copies:
        assert other.weight_layout == "int8"
        for ours, theirs in zip(prefill_logits(other, prompts), expected, strict=True):
            assert torch.equal(ours, theirs)
    state = model.state_dict()  # the dequantized weights, plain
    plain = load_model(written[None][0], dtype=torch.float32, pack_weights=False)
    for name, tensor in plain.state_dict().items():
        assert state[name].shape == tensor.shape and state[name].dtype == tensor.dtype, name
    for name in ("layers.0.attention.wqkv.weight", "layers.1.feed_forward.w2.weight"):
        torch.testing.assert_close(state[name], int8_dequantized(plain.state_dict()[name]), atol=0, rtol=1e-6)
    model.unpack_weights()
    assert not model.packed
    for ours, theirs in zip(prefill_logits(model, prompts), expected, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="quantize must be one of none, int8"):
        load_model(written[None][0], quantize="int4")


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_adapter_rows_on_an_int8_base_equal_peft_per_row(written, device: str) -> None:
    """A ragged batch of the oracle's rows, 4 adapters in slots beside base rows, prefilled then decoded greedily on an
    int8 base (CPU: q8_linear; CUDA: dequantized inside the matmul): every row's logits equal PEFT's with that row's
    adapter alone on the dequantized base."""
    from adapter_manager.kernels import KernelConfig, LoRAKernelMeta, select_backend
    from tests.runtime._oracle import MAX_RANK, SLOTTED, slots_of
    from tests.runtime._steps import slotted_model

    model, _, pool, rows = slotted_model(written, device=device, quantize="int8")
    meta = LoRAKernelMeta.make(select_backend(device, KernelConfig()), pool.num_slots, MAX_RANK, 64, device,
                               granule=pool.granule)  # fmt: skip
    prompts, names = [p for p, _ in ROWS], [a for _, a in ROWS]
    slots = slots_of(names, SLOTTED)
    oracles = {name: int8_copy(written[name][1]) for name in set(names)}
    for logits, prompt, name in zip(prefill_logits(model, prompts, slots, meta, slot_rows=rows), prompts, names,
                                    strict=True):  # fmt: skip
        assert max_diff(logits.cpu(), _hf_logits(oracles[name], prompt)) <= FP32_TOL, name
    generated, step_logits = greedy(model, prompts, 4, slots, meta, slot_rows=rows)
    for row, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        full = _hf_logits(oracles[name], prompt + generated[row])
        for i, logits in enumerate(step_logits):
            assert max_diff(logits[row].cpu(), full[len(prompt) - 1 + i]) <= FP32_TOL, (name, i)
