"""The engine serving LoRA variants (DoRA, LoRA bias) beside plain LoRA and the base model, more adapters than slots,
against `PeftModel` generate with each adapter alone."""

from __future__ import annotations

import pytest
import torch

from adapter_manager import AdapterManager, AdapterManagerConfig, RowOptions, UnsupportedAdapterError, Variant
from adapter_manager.runtime.engine.sampling import SamplingParams
from adapter_manager.runtime.model import load_model
from tests.conftest import TINY_NAME
from tests.runtime._oracle import hf_greedy
from tests.runtime._variants import VARIANT_ROWS, VARIANTS

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def variant_expected(written_variants) -> dict[tuple[tuple[int, ...], str | None], list[int]]:
    return {(tuple(p), name): hf_greedy(written_variants[name][1], p, NEW_TOKENS) for p, name in VARIANT_ROWS}


@pytest.mark.parametrize(
    ("max_batch", "device"),
    [
        (4, "cpu"),
        (7, "cpu"),
        pytest.param(4, "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
    ],
)
def test_variants_through_two_slots_match_peft(written_variants, variant_expected, make_engine, max_batch, device):
    """Five adapters (two DoRA, two LoRA-bias, one plain) through two slots; DoRA adapters are registered before the
    engine exists, so their scales are prepared on first use from the engine's model (on CUDA from its device
    weights; its steps with a variant run eagerly, the others replay CUDA graphs)."""
    model = load_model(written_variants[None][0], dtype=torch.float32, device=device)
    engine, manager = make_engine(
        adapters=tuple(VARIANTS), source=written_variants, max_batch=max_batch, model=model, device=device
    )
    assert {name: manager.record(name).variant for name in ("dora", "bias", "plain")} == {
        "dora": Variant.DORA, "bias": Variant.LORA_BIAS, "plain": Variant.LORA,
    }  # fmt: skip
    requests = VARIANT_ROWS * 2
    handles = [engine.submit(p, a, SamplingParams(max_tokens=NEW_TOKENS)) for p, a in requests]
    engine.run_until_idle(max_steps=500)
    for handle, (prompt, name) in zip(handles, requests, strict=True):
        assert handle.result(timeout=0) == variant_expected[(tuple(prompt), name)], (prompt, name)
    snapshot = manager.metrics()
    assert snapshot.moves["host_to_slot"].count >= len(VARIANTS)  # through two slots: vectors moving with their rows
    assert snapshot.evictions["slot"] > 0
    manager.close()


def test_a_pool_without_vector_rows_refuses_variants_by_name(written_variants, tiny_spec):
    manager = AdapterManager(
        tiny_spec, AdapterManagerConfig(max_slots=2, rows=RowOptions(max_rank=8, lora_vectors=False))
    )
    with pytest.raises(UnsupportedAdapterError, match="'dora'.*lora_vectors=False"):
        manager.register(str(written_variants["dora"][0]), adapter_id="dora")
    manager.register(str(written_variants["plain"][0]), adapter_id="plain")
    assert not manager.lora_vectors and manager.records()[0].adapter_id == "plain"
    manager.close()


def test_dora_without_a_model_fails_its_first_use_by_name(written_variants):
    """Registered on a manager no engine serves: checked whole, then its first load names what it lacks."""
    manager = AdapterManager(
        __import__("adapter_manager").BaseModelSpec.from_hf_config(written_variants[None][0], TINY_NAME),
        AdapterManagerConfig(max_slots=2, rows=RowOptions(max_rank=8)),
    )
    manager.register(str(written_variants["dora"][0]), adapter_id="dora")
    with pytest.raises(UnsupportedAdapterError, match="'dora'.*attach_base_weights"):
        manager.acquire(["dora"])
    manager.close()
