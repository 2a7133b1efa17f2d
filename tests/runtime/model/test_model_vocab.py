"""Oracle (vocabulary modules): each row of a batch mixing embedding / lm_head LoRA and trainable-token adapters with
plain LoRA and base rows equals `PeftModel` with that row's adapter alone, untied and tied, on every eager backend.

The adapters are trained a few steps by real `peft` (`tests.runtime._vocab`), registered from their folders, prepared
against the model's own tables (the tokens' one-hot LoRA, the saved tables' check) and loaded into the pool's
vocabulary columns.
"""

from __future__ import annotations

import pytest
import torch

from adapter_manager import AdapterRegistry, RegistryConfig, RowOptions
from adapter_manager.kernels import BackendKind, KernelConfig, LoRAKernelMeta, select_backend
from adapter_manager.runtime.model.checkpoint import load_model
from adapter_manager.tiers.slot_pool import SlotPool, SlotPoolConfig
from tests.conftest import TINY_NAME
from tests.runtime._oracle import BF16_ATOL, BF16_RTOL, FP32_TOL, MAX_RANK, hf_greedy, max_diff
from tests.runtime._steps import greedy, prefill_logits
from tests.runtime._vocab import TIED_ROWS, UNTIED_ROWS, VOCAB_ADAPTERS

BASES = {False: (None, UNTIED_ROWS), True: ("tied", TIED_ROWS)}


def vocab_setup(written_vocab, tied: bool, dtype: torch.dtype, backend: BackendKind = BackendKind.AUTO):
    """Model, pool (vocabulary columns on) with each of the base's adapters in a slot, the metadata, each row's slot
    and each slot's rank."""
    base_key, rows = BASES[tied]
    names = sorted({name for _, name in rows if name is not None})
    model = load_model(written_vocab[base_key][0], dtype=dtype)
    model.setup_caches(max_batch=len(rows), max_seq_len=32)
    spec = model.config.to_spec(TINY_NAME)
    assert spec.tie_word_embeddings is tied and spec.vocab_size == 64
    registry = AdapterRegistry(spec, RegistryConfig(rows=RowOptions(max_rank=MAX_RANK, lora_vocab=True), dtype=dtype))
    registry.base_weight = model.base_weight
    pool = SlotPool(
        spec, SlotPoolConfig(max_slots=len(names), rows=RowOptions(max_rank=MAX_RANK, lora_vocab=True), dtype=dtype)
    )
    slot_of, slot_rows = {}, {}
    for index, name in enumerate(names):
        registry.register(str(written_vocab[name][0]), adapter_id=name)
        slot = index * pool.units_for(MAX_RANK)
        prepared = registry.prepared(name)
        assert prepared.complete
        pool.load(slot, prepared)
        slot_of[name], slot_rows[slot] = slot, prepared.rows
    model.attach_lora(pool.stacks)
    meta = LoRAKernelMeta.make(
        select_backend("cpu", KernelConfig(backend=backend)), pool.num_slots, MAX_RANK, 256, "cpu",
        granule=pool.granule,
    )  # fmt: skip
    slots = [-1 if name is None else slot_of[name] for _, name in rows]
    return model, meta, slots, slot_rows


def oracle(written_vocab, tied: bool, name: str | None, prompt: list[int]) -> torch.Tensor:
    hf = written_vocab[name][1] if name is not None else written_vocab[BASES[tied][0]][1]
    with torch.no_grad():
        return hf(input_ids=torch.tensor([prompt])).logits[0].float()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize(
    "backend", [BackendKind.TORCH, BackendKind.REFERENCE, BackendKind.CPU, BackendKind.TRITON], ids=lambda b: b.value
)
def test_vocab_rows_equal_peft_per_row(written_vocab, tied, backend, request) -> None:
    if backend is BackendKind.TRITON:
        request.getfixturevalue("triton_interpret")
    model, meta, slots, slot_rows = vocab_setup(written_vocab, tied, torch.float32, backend)
    rows = BASES[tied][1]
    ours = prefill_logits(model, [p for p, _ in rows], slots, meta, slot_rows=slot_rows)
    for logits, (prompt, name) in zip(ours, rows, strict=True):
        assert max_diff(logits, oracle(written_vocab, tied, name, prompt)) <= FP32_TOL, name


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_vocab_columns_carry_the_adapters(written_vocab, tied) -> None:
    """Without the vocabulary LoRA (the model's vocab stacks dropped) each vocabulary adapter's rows are off PEFT by
    far more than the tolerance: the oracle above can fail, and the trained rows are not near the base's."""
    model, meta, slots, slot_rows = vocab_setup(written_vocab, tied, torch.float32, BackendKind.TORCH)
    model.vocab_lora = {}
    rows = BASES[tied][1]
    ours = prefill_logits(model, [p for p, _ in rows], slots, meta, slot_rows=slot_rows)
    for logits, (prompt, name) in zip(ours, rows, strict=True):
        off = max_diff(logits, oracle(written_vocab, tied, name, prompt))
        assert (off > 100 * FP32_TOL) if name not in (None, "plain") else (off <= FP32_TOL), (name, off)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_greedy_generations_equal_peft(written_vocab, tied) -> None:
    """Decode steps (logits for every row, each row's adapter on its head) generate PEFT's tokens."""
    model, meta, slots, slot_rows = vocab_setup(written_vocab, tied, torch.float32, BackendKind.CPU)
    rows = BASES[tied][1]
    ours, _ = greedy(model, [p for p, _ in rows], 6, slots, meta, slot_rows=slot_rows)
    for tokens, (prompt, name) in zip(ours, rows, strict=True):
        hf = written_vocab[name][1] if name is not None else written_vocab[BASES[tied][0]][1]
        assert tokens == hf_greedy(hf, prompt, 6), name


def test_bf16_within_documented_tolerance(written_vocab) -> None:
    model, meta, slots, slot_rows = vocab_setup(written_vocab, False, torch.bfloat16, BackendKind.CPU)
    ours = prefill_logits(model, [p for p, _ in UNTIED_ROWS], slots, meta, slot_rows=slot_rows)
    for logits, (prompt, name) in zip(ours, UNTIED_ROWS, strict=True):
        reference = oracle(written_vocab, False, name, prompt)
        assert max_diff(logits, reference) <= BF16_ATOL + BF16_RTOL * reference.abs().max().item(), name


def test_the_adapters_are_what_peft_saved(written_vocab) -> None:
    """Each adapter in the oracle set is the kind it claims: trainable tokens with no LoRA of their own on the tied
    head, LoRA on embed_tokens / lm_head with the frozen tables saved beside it."""
    from safetensors import safe_open

    def keys(name: str) -> set[str]:
        with safe_open(written_vocab[name][0] / "adapter_model.safetensors", framework="pt") as handle:
            return set(handle.keys())

    assert any(k.endswith("embed_tokens.base_layer.weight") for k in keys("embed_head"))
    assert any(k.endswith("lm_head.lora_B.weight") for k in keys("tied_head"))
    assert not any("lm_head" in k for k in keys("tied_tokens"))  # the head takes the embedding's rows
    assert any(k.startswith("base_model.model.lm_head.token_adapter") for k in keys("tied_apart"))
    assert set(VOCAB_ADAPTERS) >= {name for _, name in UNTIED_ROWS + TIED_ROWS if name}
