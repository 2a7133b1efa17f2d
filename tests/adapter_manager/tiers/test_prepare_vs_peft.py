"""Prepared weights equal what PEFT applies: scaling * B @ A per module, for adapters written by real `peft`."""

from __future__ import annotations

import pytest
import torch

from adapter_manager import AdapterRegistry, ModuleKey, RegistryConfig, RowOptions, write_synthetic_adapter
from adapter_manager.sources.peft_format import CONFIG_NAME, LoraAdapterConfig
from adapter_manager.tiers.row_layout import RowLayout
from tests.conftest import ALL_LINEAR_RSLORA, PATTERNS_LORA, QV_LORA

CASES = {
    "q_v": QV_LORA,
    "all_linear_rslora": ALL_LINEAR_RSLORA,
    "patterns": PATTERNS_LORA,
    "regex_targets": dict(r=2, lora_alpha=5, target_modules=r".*layers\.[02]\.mlp\.(up|gate)_proj"),
    "layers_to_transform": dict(r=4, lora_alpha=8, target_modules=["up_proj", "k_proj"], layers_to_transform=[0, 2]),
    "layers_pattern_int": dict(
        r=3, lora_alpha=7, target_modules=["v_proj"], layers_to_transform=1, layers_pattern="layers"
    ),
    "exclude": dict(r=4, lora_alpha=8, target_modules="all-linear", exclude_modules=["down_proj", "q_proj"]),
}


def peft_modules(model) -> dict[ModuleKey, object]:
    """PEFT's LoRA layers by (layer, proj)."""
    found = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "r", {}):
            parts = name.split(".")
            found[ModuleKey(int(parts[parts.index("layers") + 1]), parts[-1])] = module
    return found


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepared_equals_peft_delta(case, dtype, write_peft_adapter, tiny_spec):
    folder, model = write_peft_adapter(**CASES[case])
    registry = AdapterRegistry(tiny_spec, RegistryConfig(rows=RowOptions(max_rank=8), dtype=dtype))
    result = registry.register(str(folder), adapter_id="a")
    prepared = registry.prepared("a")
    expected = peft_modules(model)
    assert set(prepared.modules) == set(expected)
    assert result.record.modules.keys() == expected.keys()
    rank = max(layer.r["default"] for layer in expected.values())
    layout = RowLayout.of(tiny_spec)
    assert prepared.rows == rank == result.record.rank  # the block is as tall as the highest module rank
    assert prepared.storage.shape == (rank, layout.width) and prepared.dtype == dtype
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    untargeted = torch.ones_like(prepared.storage, dtype=torch.bool)  # [r, width]: columns no module owns
    for key, layer in expected.items():
        weights = prepared.modules[key]
        assert weights.rank == layer.r["default"]
        assert result.record.modules[key].scaling == pytest.approx(layer.scaling["default"], rel=1e-12)
        assert weights.a.shape == (rank, tiny_spec.projection_shape(key.proj)[0])
        assert weights.bt.shape == (rank, tiny_spec.projection_shape(key.proj)[1])
        for view, full in (
            (weights.a, layout.a_view(prepared.storage, key)),
            (weights.bt, layout.bt_view(prepared.storage, key)),
        ):
            assert view.data_ptr() == full.data_ptr() and view.stride() == (layout.width, 1)  # a view of the block
        layout.a_view(untargeted, key).fill_(False)
        layout.bt_view(untargeted, key).fill_(False)
        assert weights.a.dtype == dtype and weights.bt.dtype == dtype
        assert not weights.a[weights.rank :].any() and not weights.bt[weights.rank :].any()
        ours = weights.bt.float().T @ weights.a.float()  # [out, in]
        theirs = layer.get_delta_weight("default").float()
        torch.testing.assert_close(ours, theirs, **tol)
    assert not prepared.storage[untargeted].any()  # modules it does not target are zero
    assert prepared.nbytes == result.record.nbytes == rank * layout.width * dtype.itemsize


@pytest.mark.parametrize("case", sorted(CASES))
def test_target_resolution_matches_peft(case, write_peft_adapter, tiny_spec):
    folder, model = write_peft_adapter(**CASES[case])
    config = LoraAdapterConfig.from_file(folder / CONFIG_NAME, "a")
    ours = config.resolve(tiny_spec, "a", max_rank=64)
    theirs = peft_modules(model)
    assert ours.keys() == theirs.keys()
    for key, layer in theirs.items():
        assert ours[key].rank == layer.r["default"]
        assert ours[key].alpha == pytest.approx(layer.lora_alpha["default"])


def test_synthetic_adapter_loads_in_peft_and_matches(tmp_path, tiny_spec):
    peft = pytest.importorskip("peft")
    from tests.conftest import make_tiny_llama

    folder = write_synthetic_adapter(
        tmp_path / "syn", tiny_spec, r=4, lora_alpha=12, rank_pattern={"o_proj": 2}, alpha_pattern={"up_proj": 3}
    )
    model = peft.PeftModel.from_pretrained(make_tiny_llama(), folder)
    registry = AdapterRegistry(tiny_spec, RegistryConfig(rows=RowOptions(max_rank=4)))
    registry.register(str(folder), adapter_id="syn")
    prepared = registry.prepared("syn")
    expected = peft_modules(model)
    assert set(prepared.modules) == set(expected) and len(expected) == 7 * tiny_spec.num_layers
    for key, layer in expected.items():
        ours = prepared.modules[key].bt.T @ prepared.modules[key].a
        torch.testing.assert_close(ours, layer.get_delta_weight("default"), atol=1e-6, rtol=1e-5)
