"""Oracle (LoRA variants): each row of a batch mixing DoRA and LoRA-bias adapters with plain LoRA and base rows equals
`PeftModel` with that row's adapter alone, on every eager backend.

The adapters are trained a few steps by real `peft` (`tests.runtime._variants`), registered from their folders,
prepared against the model's own weights (DoRA's row norms) and loaded into the pool's slots with their vector rows.
"""

from __future__ import annotations

import pytest
import torch

from adapter_manager import AdapterRegistry, RegistryConfig, RowOptions, Variant
from adapter_manager.kernels import BackendKind, KernelConfig, LoRAKernelMeta, WeightLayout, select_backend
from adapter_manager.runtime.model.checkpoint import load_model
from adapter_manager.tiers.slot_pool import SlotPool, SlotPoolConfig
from tests.conftest import TINY_NAME
from tests.runtime._oracle import (
    BF16_ATOL,
    BF16_RTOL,
    FP32_TOL,
    MAX_RANK,
    hf_greedy,
    max_diff,
    oracle_logits,
    slots_of,
)
from tests.runtime._steps import greedy, prefill_logits
from tests.runtime._variants import VARIANT_ROWS, VARIANTS

NAMES = tuple(VARIANTS)


def variant_setup(written_variants, dtype: torch.dtype, backend: BackendKind = BackendKind.AUTO):
    """Model, registry (DoRA prepared from the model's weights), pool with every variant adapter in slot i = NAMES[i],
    metadata with vectors, each slot's rank and each vector slot's epilogue."""
    model = load_model(written_variants[None][0], dtype=dtype)
    model.setup_caches(max_batch=len(VARIANT_ROWS), max_seq_len=32)
    spec = model.config.to_spec(TINY_NAME)
    registry = AdapterRegistry(spec, RegistryConfig(rows=RowOptions(max_rank=MAX_RANK), dtype=dtype))
    registry.base_weight = model.base_weight
    for name in NAMES:
        registry.register(str(written_variants[name][0]), adapter_id=name)
    pool = SlotPool(spec, SlotPoolConfig(max_slots=len(NAMES), rows=RowOptions(max_rank=MAX_RANK), dtype=dtype))
    for slot, name in enumerate(NAMES):
        pool.load(slot * pool.units_for(MAX_RANK), registry.prepared(name))
    model.attach_lora(pool.stacks)
    prepared = {slot * pool.units_for(MAX_RANK): registry.prepared(name) for slot, name in enumerate(NAMES)}
    rows = {slot: p.rows for slot, p in prepared.items()}
    vectors = {slot: p.variant.epilogue for slot, p in prepared.items() if p.variant.epilogue is not None}
    meta = LoRAKernelMeta.make(
        select_backend("cpu", KernelConfig(backend=backend)), pool.num_slots, MAX_RANK, 256, "cpu",
        granule=pool.granule, vectors=True,
    )  # fmt: skip
    return model, registry, meta, rows, vectors


def row_slots(pool_slots: dict[int, int]) -> list[int]:
    layout = tuple(NAMES)
    return [-1 if s < 0 else sorted(pool_slots)[s] for s in slots_of([a for _, a in VARIANT_ROWS], layout)]


@pytest.mark.parametrize(
    "backend", [BackendKind.TORCH, BackendKind.REFERENCE, BackendKind.CPU, BackendKind.TRITON], ids=lambda b: b.value
)
def test_variant_rows_equal_peft_per_row(written_variants, backend, request) -> None:
    if backend is BackendKind.TRITON:
        request.getfixturevalue("triton_interpret")
    model, _, meta, rows, vectors = variant_setup(written_variants, torch.float32, backend)
    prompts = [p for p, _ in VARIANT_ROWS]
    ours = prefill_logits(model, prompts, row_slots(rows), meta, slot_rows=rows, slot_vectors=vectors)
    assert meta.bias_index is not None and meta.scale_index is not None
    for logits, (prompt, name) in zip(ours, VARIANT_ROWS, strict=True):
        assert max_diff(logits, oracle_logits(written_variants, name, prompt)) <= FP32_TOL, name


def test_the_vectors_carry_the_variant(written_variants) -> None:
    """Without the vector epilogue (the slots' vectors not named) the variant rows are off PEFT by far more than the
    tolerance: the oracle above can fail, and the variants' trained vectors are not near the identity."""
    model, _, meta, rows, _ = variant_setup(written_variants, torch.float32, BackendKind.TORCH)
    prompts = [p for p, _ in VARIANT_ROWS]
    ours = prefill_logits(model, prompts, row_slots(rows), meta, slot_rows=rows)
    for logits, (prompt, name) in zip(ours, VARIANT_ROWS, strict=True):
        off = max_diff(logits, oracle_logits(written_variants, name, prompt))
        assert (off > 100 * FP32_TOL) if name not in (None, "plain") else (off <= FP32_TOL), (name, off)


def test_greedy_generations_equal_peft(written_variants) -> None:
    model, _, meta, rows, vectors = variant_setup(written_variants, torch.float32, BackendKind.CPU)
    prompts = [p for p, _ in VARIANT_ROWS]
    ours, _ = greedy(model, prompts, 6, row_slots(rows), meta, slot_rows=rows, slot_vectors=vectors)
    for tokens, (prompt, name) in zip(ours, VARIANT_ROWS, strict=True):
        assert tokens == hf_greedy(written_variants[name][1], prompt, 6), name


def test_bf16_within_documented_tolerance(written_variants) -> None:
    model, _, meta, rows, vectors = variant_setup(written_variants, torch.bfloat16, BackendKind.CPU)
    prompts = [p for p, _ in VARIANT_ROWS]
    ours = prefill_logits(model, prompts, row_slots(rows), meta, slot_rows=rows, slot_vectors=vectors)
    for logits, (prompt, name) in zip(ours, VARIANT_ROWS, strict=True):
        reference = oracle_logits(written_variants, name, prompt)
        assert max_diff(logits, reference) <= BF16_ATOL + BF16_RTOL * reference.abs().max().item(), name


def test_prepared_vectors_are_peft_s(written_variants) -> None:
    """The bias vector is ``s · b`` and DoRA's ``m / ‖W + s·B·A‖_row - 1`` with the row norm PEFT's own layer
    computes, for every targeted module."""
    _, registry, _, _, _ = variant_setup(written_variants, torch.float32)
    for name in ("bias", "dora"):
        prepared, peft_model = registry.prepared(name), written_variants[name][1]
        assert prepared.variant is (Variant.LORA_BIAS if name == "bias" else Variant.DORA) and prepared.complete
        for key, weights in prepared.modules.items():
            layer = peft_model.get_submodule(f"base_model.model.{key.module_name}")
            scaling = layer.scaling["default"]
            if name == "bias":
                expected = scaling * layer.lora_B["default"].bias
            else:
                delta = layer.lora_B["default"].weight @ layer.lora_A["default"].weight
                norm = layer.lora_magnitude_vector["default"].get_weight_norm(layer.weight, delta, scaling)
                expected = layer.lora_magnitude_vector["default"].weight / norm - 1
            assert weights.vector is not None and max_diff(weights.vector, expected.detach()) <= 1e-5, (name, key)


@pytest.mark.parametrize("backend", [BackendKind.TORCH, BackendKind.CPU], ids=lambda b: b.value)
def test_a_run_broadcast_and_a_gather_give_the_same_bits(written_variants, monkeypatch, backend) -> None:
    """A step whose variant tokens are one run takes the torch epilogue's broadcast path; forced onto the gathers it
    gives the same bits (the deterministic mode relies on it), and both equal PEFT. The cpu backend's C++ epilogue
    is per token either way."""
    model, _, meta, rows, vectors = variant_setup(written_variants, torch.float32, backend)
    dora, bias = (sorted(rows)[NAMES.index(name)] for name in ("dora", "bias"))
    prompts = [[(7 * i) % 60 + 1 for i in range(24)], [2, 8, 33], [5, 9, 1, 4]]
    outputs = []
    for variant_slot, name in ((dora, "dora"), (bias, "bias")):
        slots = [variant_slot, -1, sorted(rows)[NAMES.index("plain")]]
        broadcast = prefill_logits(model, prompts, slots, meta, slot_rows=rows, slot_vectors=vectors)
        assert meta.vector_runs == ((0, 24, variant_slot, vectors[variant_slot]),)
        with monkeypatch.context() as patch:
            patch.setattr(type(meta), "vector_runs", property(lambda self: None, lambda self, value: None))
            gathered = prefill_logits(model, prompts, slots, meta, slot_rows=rows, slot_vectors=vectors)
        assert all(torch.equal(a, b) for a, b in zip(broadcast, gathered, strict=True)), name
        assert max_diff(broadcast[0], oracle_logits(written_variants, name, prompts[0])) <= FP32_TOL, name
        outputs.append(broadcast)
    assert max_diff(outputs[0][0], outputs[1][0]) > 100 * FP32_TOL  # the two variants differ


LAYOUTS = [WeightLayout.PLAIN, WeightLayout.ONEDNN, WeightLayout.BLOCKED]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda w: w.value)
def test_each_one_call_linear_ends_with_the_epilogue(written_variants, layout, monkeypatch) -> None:
    """The cpu backend's one-call linears take the epilogue inside their one call (lora_linear on plain weights at
    decode, lora_onednn, lora_blocked; no separate epilogue call): greedy decode equals PEFT, with every decode
    linear one C++ call (a plain weight's prefill composes, then applies the epilogue alone)."""
    model, _, meta, rows, vectors = variant_setup(written_variants, torch.float32, BackendKind.CPU)
    model.unpack_weights()
    assert layout is WeightLayout.PLAIN or model.pack_weights(layout)
    separate, apply_alone = [], meta.backend.vectors

    def alone(y, epilogue):  # noqa: ANN001, ANN202 - counted, then applied
        separate.append(y.shape[0])
        apply_alone(y, epilogue)

    monkeypatch.setattr(meta.backend, "vectors", alone)
    prompts = [p for p, _ in VARIANT_ROWS]
    ours, _ = greedy(model, prompts, 4, row_slots(rows), meta, slot_rows=rows, slot_vectors=vectors)
    for tokens, (prompt, name) in zip(ours, VARIANT_ROWS, strict=True):
        assert tokens == hf_greedy(written_variants[name][1], prompt, 4), name
    decode_steps = [t for t in separate if t == len(VARIANT_ROWS)]
    assert not decode_steps, f"{len(decode_steps)} decode linears applied the epilogue in a call of its own"
