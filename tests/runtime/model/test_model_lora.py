"""Oracle (adapters): each row of a mixed batch equals `PeftModel` with that row's adapter alone.

Adapters are written by real `peft`, registered through `AdapterRegistry` from their folders and loaded into slots
with `SlotPool.load`; the model reads the pool's rows by reference.

bf16 tolerance: a bf16 model + bf16 slot stacks is compared with the fp32 `PeftModel` logits; every logit lies within
``BF16_ATOL + BF16_RTOL · max|logit|`` of the fp32 reference (bf16 has an 8-bit mantissa: ~0.4 % per rounding, which
compounds over the layers; measured max-abs 0.002-0.011 on logits of magnitude <= 0.4 on this tiny model).
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from adapter_manager import ModuleKey
from adapter_manager.kernels import BackendKind, KernelConfig, LoRAKernelMeta, WeightLayout, executor, select_backend
from adapter_manager.kernels.cpu import backend as cpu_backend
from adapter_manager.runtime.model.checkpoint import load_model
from adapter_manager.runtime.model.llama import Llama
from adapter_manager.runtime.model.projection import LoRALinear
from tests.runtime._oracle import (
    BF16_ATOL,
    BF16_RTOL,
    FP32_TOL,
    MAX_RANK,
    NEW_TOKENS,
    ROWS,
    SLOTTED,
    max_diff,
    oracle_logits,
    slots_of,
)
from tests.runtime._steps import greedy, prefill_logits, slotted_model


def serving_setup(written, dtype: torch.dtype, backend: BackendKind = BackendKind.AUTO):
    """Model + registry + pool (slots 0..3 = SLOTTED) + meta + each slot's rank, all in ``dtype``."""
    model, registry, pool, rows = slotted_model(written, dtype)
    meta = LoRAKernelMeta.make(
        select_backend("cpu", KernelConfig(backend=backend)), pool.num_slots, MAX_RANK, 256, "cpu", granule=pool.granule
    )
    return model, registry, pool, meta, rows


@pytest.mark.parametrize(
    ("backend", "static"),
    [(BackendKind.TORCH, False), (BackendKind.REFERENCE, False), (BackendKind.TORCH, True), (BackendKind.CPU, False)],
    ids=["torch", "reference", "torch-static-attention", "cpu-fused"],
)
def test_mixed_batch_logits_equal_peft_per_row(written, backend: BackendKind, static: bool) -> None:
    model, _, _, meta, rows = serving_setup(written, torch.float32, backend)
    prompts, adapters = [p for p, _ in ROWS], [a for _, a in ROWS]
    ours = prefill_logits(model, prompts, slots_of(adapters, SLOTTED), meta, static=static, slot_rows=rows)
    assert meta.fused == (backend is BackendKind.CPU)
    for logits, prompt, name in zip(ours, prompts, adapters, strict=True):
        assert max_diff(logits, oracle_logits(written, name, prompt)) <= FP32_TOL, name


def test_greedy_generations_equal_hf_generate(written) -> None:
    model, _, _, meta, rows = serving_setup(written, torch.float32)
    prompts, adapters = [p for p, _ in ROWS], [a for _, a in ROWS]
    generated, _ = greedy(model, prompts, NEW_TOKENS, slots_of(adapters, SLOTTED), meta, slot_rows=rows)
    for ids, prompt, name in zip(generated, prompts, adapters, strict=True):
        hf = written[name][1]
        hf.generation_config.eos_token_id = None
        with torch.no_grad():
            out = hf.generate(
                input_ids=torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )
        assert ids == out[0, len(prompt) :].tolist(), name


def test_swapping_a_slot_between_steps(written) -> None:
    """More adapters than slots: loading another adapter into a slot changes exactly that slot's rows."""
    model, registry, pool, meta, rows = serving_setup(written, torch.float32)
    prompts, adapters = [p for p, _ in ROWS], [a for _, a in ROWS]
    prefill_logits(model, prompts, slots_of(adapters, SLOTTED), meta, slot_rows=rows)
    pool.load(SLOTTED.index("patterns"), registry.prepared("spare"))
    rows[SLOTTED.index("patterns")] = registry.prepared("spare").rows
    layout = tuple("spare" if name == "patterns" else name for name in SLOTTED)
    swapped = ["spare" if name == "patterns" else name for name in adapters]
    ours = prefill_logits(model, prompts, slots_of(swapped, layout), meta, slot_rows=rows)
    for logits, prompt, name in zip(ours, prompts, swapped, strict=True):
        assert max_diff(logits, oracle_logits(written, name, prompt)) <= FP32_TOL, name


def test_lora_disabled_is_exactly_the_base_model(written) -> None:
    model, _, _, meta, rows = serving_setup(written, torch.float32)
    prompts = [p for p, _ in ROWS]
    with_stacks_no_adapter = prefill_logits(model, prompts, None, meta, slot_rows=rows)
    no_meta = prefill_logits(model, prompts)
    model.detach_lora()
    detached = prefill_logits(model, prompts, slots_of([a for _, a in ROWS], SLOTTED), meta, slot_rows=rows)
    base = load_model(written[None][0])
    base.setup_caches(max_batch=len(ROWS), max_seq_len=32)
    plain = prefill_logits(base, prompts)
    for i, prompt in enumerate(prompts):
        assert torch.equal(with_stacks_no_adapter[i], plain[i])
        assert torch.equal(no_meta[i], plain[i])
        assert torch.equal(detached[i], plain[i])
        assert max_diff(plain[i], oracle_logits(written, None, prompt)) <= FP32_TOL


def test_bf16_within_documented_tolerance(written) -> None:
    model, _, _, meta, rows = serving_setup(written, torch.bfloat16)
    assert isinstance(model, Llama) and model.dtype == torch.bfloat16
    prompts, adapters = [p for p, _ in ROWS], [a for _, a in ROWS]
    ours = prefill_logits(model, prompts, slots_of(adapters, SLOTTED), meta, slot_rows=rows)
    for logits, prompt, name in zip(ours, prompts, adapters, strict=True):
        reference = oracle_logits(written, name, prompt)
        bound = BF16_ATOL + BF16_RTOL * reference.abs().max().item()
        assert logits.dtype == torch.bfloat16
        assert max_diff(logits, reference) <= bound, (name, max_diff(logits, reference), bound)


def test_attach_checks_the_stacks(written) -> None:
    model, _, pool, _, _ = serving_setup(written, torch.float32)
    stacks = pool.stacks[ModuleKey(0, "k_proj")]
    wqkv = model.layers[0].attention.wqkv
    with pytest.raises(ValueError, match=r"bt_rows must have shape \[33, 32\], got \(33, 16\)"):
        wqkv.attach(0, SimpleNamespace(a=pool.stacks[ModuleKey(0, "q_proj")].a, bt=stacks.bt, vector=None))
    with pytest.raises(ValueError, match="torch.bfloat16"):
        wqkv.attach(1, SimpleNamespace(a=stacks.a.bfloat16(), bt=stacks.bt.bfloat16(), vector=None))
    with pytest.raises(ValueError, match="layer 7"):
        model.attach_lora({ModuleKey(7, "q_proj"): stacks})
    assert wqkv.has_lora
    model.detach_lora()
    assert not any(m.has_lora for m in model.modules() if isinstance(m, LoRALinear))


def test_fused_shrink_is_taken_for_wqkv_and_w13_on_a_real_pool(written, monkeypatch) -> None:
    """The pool lays A_q|A_k|A_v and A_gate|A_up side by side: attach finds them adjacent, an eager forward runs one
    shrink_parts per fused linear and one shrink per other linear, and the logits are the per-part path's."""
    model, _, _, meta, rows = serving_setup(written, torch.float32, BackendKind.TORCH)
    for block in model.layers:
        assert block.attention.wqkv.fused_parts == ((0, 1, 2),)
        assert block.feed_forward.w13.fused_parts == ((0, 1),)
        assert block.attention.wo.fused_parts == () and block.feed_forward.w2.fused_parts == ()
    calls: Counter[str] = Counter()

    def counted(name: str, op):
        def call(*args, **kwargs):
            calls[name] += 1
            return op(*args, **kwargs)

        return call

    monkeypatch.setattr(executor, "shrink_parts", counted("shrink_parts", executor.shrink_parts))
    monkeypatch.setattr(executor, "shrink", counted("shrink", executor.shrink))
    prompts, adapters = [p for p, _ in ROWS], [a for _, a in ROWS]
    fused = prefill_logits(model, prompts, slots_of(adapters, SLOTTED), meta, slot_rows=rows)
    assert calls == {"shrink_parts": 2 * len(model.layers), "shrink": 2 * len(model.layers)}
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.fuse_shrink = False
    calls.clear()
    per_part = prefill_logits(model, prompts, slots_of(adapters, SLOTTED), meta, slot_rows=rows)
    assert calls == {"shrink": 7 * len(model.layers)}
    for ours, theirs, prompt, name in zip(fused, per_part, prompts, adapters, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        assert max_diff(ours, oracle_logits(written, name, prompt)) <= FP32_TOL, name


def count_linear_calls(monkeypatch) -> Counter[str]:  # noqa: ANN001
    """Count, by name, the LoRA calls a linear makes: the model's own (apply_parts, shrink_parts, shrink, expand) and
    the one-call kernels the cpu backend's ``fused_linear`` chooses (lora_blocked, lora_onednn, lora_linear)."""
    calls: Counter[str] = Counter()
    targets = [(executor, n) for n in ("apply_parts", "shrink_parts", "shrink", "expand")]
    targets += [(cpu_backend, n) for n in ("lora_blocked", "lora_onednn", "lora_linear")]
    for module, name in targets:
        op = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _op=op, _name=name, **k: calls.update([_name]) or _op(*a, **k))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_step_applies_each_linear_in_one_call(written, monkeypatch, dtype) -> None:
    """The cpu backend's FUSED form: one call per linear (q/k/v, o, gate/up, down) per layer, no shrink or expand of
    their own, and the logits those of the torch forms (and PEFT's, within the dtype's tolerance). On a packed weight
    the call is lora_blocked (fp32, our blocked layout) or lora_onednn (bf16), base matmul and LoRA; on a plain one
    apply_parts after the base matmul."""
    model, _, _, meta, rows = serving_setup(written, dtype, BackendKind.CPU)
    kinds = {
        ("lora_blocked" if module.layout is WeightLayout.BLOCKED else "lora_onednn") if module.packed else "apply_parts"
        for module in model.modules()
        if isinstance(module, LoRALinear) and module.has_lora
    }
    assert len(kinds) == 1
    one_call = kinds.pop()
    calls = count_linear_calls(monkeypatch)
    prompts, adapters = [p for p, _ in ROWS], [a for _, a in ROWS]
    fused = prefill_logits(model, prompts, slots_of(adapters, SLOTTED), meta, slot_rows=rows)
    assert meta.fused and calls == {one_call: 4 * len(model.layers)}
    if one_call != "apply_parts":  # one_call = False: the packed matmul, then apply_parts; the same values
        linears = [m for m in model.modules() if isinstance(m, LoRALinear)]
        for linear in linears:
            linear.one_call = False
        calls.clear()
        two_calls = prefill_logits(model, prompts, slots_of(adapters, SLOTTED), meta, slot_rows=rows)
        for linear in linears:
            linear.one_call = True
        assert calls == {"apply_parts": 4 * len(model.layers)}
        for ours, theirs in zip(fused, two_calls, strict=True):
            assert torch.equal(ours, theirs)
    _, _, _, torch_meta, _ = serving_setup(written, dtype, BackendKind.TORCH)
    forms = prefill_logits(model, prompts, slots_of(adapters, SLOTTED), torch_meta, slot_rows=rows)
    for ours, theirs, prompt, name in zip(fused, forms, prompts, adapters, strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
            assert max_diff(ours, oracle_logits(written, name, prompt)) <= FP32_TOL, name
        else:
            reference = oracle_logits(written, name, prompt)
            assert max_diff(ours, reference) <= BF16_ATOL + BF16_RTOL * reference.abs().max().item(), name


def test_a_prefill_of_long_prompts_takes_lora_blocked_and_equals_peft(written, monkeypatch) -> None:
    """A prefill past the FUSED form's token limit (the torch forms' step), prompts of 16+ tokens: every blocked
    linear still takes one lora_blocked call (their runs' LoRA inside its GEMM), and each row equals PEFT's logits
    with its adapter alone (slot -1 rows the base model's)."""
    model, _, pool, _, rows = serving_setup(written, torch.float32, BackendKind.CPU)
    backend = select_backend("cpu", KernelConfig(fused_max_tokens=16))
    meta = LoRAKernelMeta.make(backend, pool.num_slots, MAX_RANK, 256, "cpu", granule=pool.granule)
    linears = [m for m in model.modules() if isinstance(m, LoRALinear) and m.has_lora]
    assert linears and all(m.layout is WeightLayout.BLOCKED for m in linears)
    calls = count_linear_calls(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    lengths, adapters = (30, 17, 24, 20), ["all_rslora", None, "qv", "mlp_subset"]
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    ours = prefill_logits(model, prompts, slots_of(adapters, SLOTTED), meta, slot_rows=rows)
    assert not meta.fused and meta.runs is not None and calls == {"lora_blocked": 4 * len(model.layers)}
    for logits, prompt, name in zip(ours, prompts, adapters, strict=True):
        assert max_diff(logits, oracle_logits(written, name, prompt)) <= FP32_TOL, name


def test_fusion_needs_adjacent_attached_parts(written) -> None:
    """Only consecutive attached parts whose A rows are adjacent column blocks of one tensor are fused."""
    _, _, pool, _, _ = serving_setup(written, torch.float32)
    q, k, v = (pool.stacks[ModuleKey(0, proj)] for proj in ("q_proj", "k_proj", "v_proj"))
    linear = LoRALinear(q.a.shape[1], (q.bt.shape[1], k.bt.shape[1], v.bt.shape[1]))
    linear.attach(0, q)
    linear.attach(2, v)
    assert linear.fused_parts == ()  # k between them has no LoRA
    linear.attach(1, k)
    assert linear.fused_parts == ((0, 1, 2),)
    linear.detach()
    linear.attach(1, k)
    linear.attach(2, v)
    assert linear.fused_parts == ((1, 2),)
    linear.attach(0, SimpleNamespace(a=q.a.clone(), bt=q.bt, vector=None))  # same values, its own buffer: not adjacent
    assert linear.fused_parts == ((1, 2),)
    linear.attach(1, SimpleNamespace(a=v.a, bt=k.bt, vector=None))  # v's A in k's place: v follows it, not k
    assert linear.fused_parts == ()
