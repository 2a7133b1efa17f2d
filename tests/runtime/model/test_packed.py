"""Packed base weights (oneDNN's reordered layout on CPU) and batched decode attention: same model, same answers."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from adapter_manager.kernels.cpu import weights as packing
from adapter_manager.runtime.engine.sampling import SamplingParams
from adapter_manager.runtime.model.checkpoint import load_model
from adapter_manager.runtime.model.hf_map import hf_target
from adapter_manager.runtime.model.projection import LoRALinear
from tests.runtime._oracle import ENGINE_NEW_TOKENS, ENGINE_REQUESTS, FP32_TOL, ROWS, max_diff, oracle_logits
from tests.runtime._steps import greedy, prefill_logits

needs_onednn = pytest.mark.skipif(
    not packing.can_pack(torch.zeros(2, 2)), reason="oneDNN linear is not available in this torch build"
)


@needs_onednn
def test_packed_model_equals_plain_and_hf(written) -> None:
    plain = load_model(written[None][0], pack_weights=False)
    packed = load_model(written[None][0], pack_weights=True)
    assert not plain.packed and packed.packed
    linears = [m for m in packed.modules() if isinstance(m, LoRALinear)]
    assert len(linears) == 4 * len(packed.layers) + 1  # every projection and the untied lm_head
    assert all(m.packed and m.weight is None for m in linears)  # one copy: the plain weight is gone
    assert {k: v.shape for k, v in packed.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in packed.state_dict().items())
    prompts = [p for p, _ in ROWS]
    for model in (plain, packed):
        model.setup_caches(max_batch=len(ROWS), max_seq_len=32)
    both = zip(prefill_logits(packed, prompts), prefill_logits(plain, prompts), prompts, strict=True)
    for ours, theirs, prompt in both:
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        assert max_diff(ours, oracle_logits(written, None, prompt)) <= FP32_TOL
    (packed_ids, packed_logits), (plain_ids, plain_logits) = greedy(packed, prompts, 4), greedy(plain, prompts, 4)
    assert packed_ids == plain_ids
    for ours, theirs in zip(packed_logits, plain_logits, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@needs_onednn
def test_unpack_restores_the_plain_weights_and_loading_needs_it(written) -> None:
    plain = load_model(written[None][0], pack_weights=False)
    model = load_model(written[None][0], pack_weights=True)
    with pytest.raises(ValueError, match="packed"):
        hf_target(model, "model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(RuntimeError, match="unpack"):
        model.load_state_dict(plain.state_dict())
    model.unpack_weights()
    assert not model.packed
    for (name, ours), theirs in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(ours, theirs), name
    model.load_state_dict(plain.state_dict())


@needs_onednn
def test_a_packed_model_pickles_and_deep_copies(written) -> None:
    model = load_model(written[None][0], pack_weights=True)
    prompts = [p for p, _ in ROWS]
    copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
    for other in [model, *copies]:
        other.setup_caches(max_batch=len(ROWS), max_seq_len=32)
    expected = prefill_logits(model, prompts)
    for other in copies:
        assert other.packed and all(m.weight is None for m in other.modules() if isinstance(m, LoRALinear))
        for ours, theirs in zip(prefill_logits(other, prompts), expected, strict=True):
            assert torch.equal(ours, theirs)


def test_nothing_is_packed_where_onednn_does_not_apply(written, monkeypatch) -> None:
    assert not packing.can_pack(torch.zeros(2, 2, dtype=torch.float16))
    assert not packing.can_pack(torch.zeros(2, 2, device="meta"))
    monkeypatch.setenv(packing.PACK_ENV, "0")
    assert not load_model(written[None][0]).packed


@pytest.mark.parametrize("pack_weights", [True, False], ids=["packed", "plain"])
def test_engine_serves_adapters_on_a_packed_model_matching_peft(
    written, expected, make_engine, pack_weights: bool
) -> None:
    model = load_model(written[None][0], pack_weights=pack_weights)
    assert model.packed == (pack_weights and packing.can_pack(torch.zeros(2, 2)))
    engine, manager = make_engine(model=model)
    handles = [engine.submit(p, a, SamplingParams(max_tokens=ENGINE_NEW_TOKENS)) for p, a in ENGINE_REQUESTS]
    engine.run_until_idle(max_steps=500)
    for handle, (prompt, name) in zip(handles, ENGINE_REQUESTS, strict=True):
        assert handle.result(timeout=0) == expected[(tuple(prompt), name)], (prompt, name)
    manager.close()


@pytest.mark.parametrize(
    ("dtype", "pack_weights"),
    [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True)],
    ids=["fp32", "fp32-plain", "bf16"],
)
def test_cpu_decode_ops_equal_the_torch_forms_step_by_step(written, dtype, pack_weights) -> None:
    """The C++ glue ops (kernels.cpu.decode_ops: decode attention, add + RMSNorm, SiLU·mul; with plain fp32 weights also
    every decode linear's base matmul and LoRA in one kernels.cpu.lora_linear call) against the torch forms
    on the same slotted model: a ragged prefill with mixed adapters, decode steps with rows out of order and one row
    idle, and a mixed step (a new prompt's prefill beside decodes). fp32: every step's logits and every cache equal;
    bf16: both forms' distance from the fp32 model, and ours is no larger than the torch forms' (rounding apart: one
    bf16 ulp of the entry's largest value, a KV cache value rounded the other way after the prefill's attention)."""
    from adapter_manager.kernels import KernelConfig, LoRAKernelMeta, cpu, select_backend
    from adapter_manager.runtime.model.batch import SequenceChunk
    from tests.runtime._oracle import SLOTTED, slots_of
    from tests.runtime._steps import slotted_model, step

    if not cpu.load():
        pytest.skip(f"no CPU kernels: {cpu.unavailable_reason()}")
    runs = [(dtype, True), (dtype, False)] + ([(torch.float32, False)] if dtype != torch.float32 else [])
    models = []
    for run_dtype, cpu_ops in runs:  # ours, the torch forms, and for bf16 the fp32 torch forms as the truth
        model, _, pool, rows = slotted_model(written, dtype=run_dtype, pack_weights=pack_weights and cpu_ops)
        model.cpu_ops = cpu_ops
        backend = select_backend("cpu", KernelConfig())
        meta = LoRAKernelMeta.make(backend, pool.num_slots, 8, 64, "cpu", granule=pool.granule)
        models.append((model, meta, rows))
    prompts, slots = [p for p, _ in ROWS], slots_of([a for _, a in ROWS], SLOTTED)
    rows_slots = list(enumerate(zip(prompts, slots, strict=True)))
    steps = [[SequenceChunk(row, 0, tuple(p), s) for row, (p, s) in rows_slots]]
    for i in range(3):  # decode, rows in reverse order, the last row idle at step 2
        chunks = [SequenceChunk(row, len(p) + i, (7 + row + i,), s) for row, (p, s) in rows_slots]
        steps.append(chunks[::-1][: len(chunks) - (i == 2)])
    last = len(ROWS) - 1
    steps.append(
        [SequenceChunk(0, len(prompts[0]) + 3, (5,), slots[0]), SequenceChunk(last, len(prompts[last]) + 2, (9, 4), -1)]
    )
    outs = [[step(m, chunks, meta, slot_rows=rows).float() for chunks in steps] for m, meta, rows in models]
    caches = [
        [c.float() for layer in m.layers for c in (layer.attention.kv_cache.k, layer.attention.kv_cache.v)]
        for m, _, _ in models
    ]
    if dtype == torch.float32:
        for ours, theirs in zip(outs[0] + caches[0], outs[1] + caches[1], strict=True):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        return
    for ours, theirs, truth in zip(outs[0] + caches[0], outs[1] + caches[1], outs[2] + caches[2], strict=True):
        ours_err, theirs_err = (ours - truth).abs().max().item(), (theirs - truth).abs().max().item()
        ulp = 2**-7 * truth.abs().max().item()  # one bf16 rounding apart at the entry's largest magnitude
        assert ours_err <= 1.5 * theirs_err + 1e-2 + ulp, (ours_err, theirs_err, ulp)
