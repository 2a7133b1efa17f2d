"""A model packed in the layout measured fastest here (kernels.choose_weight_layout) or in a given one computes what
its plain weights do, and keeps that layout through a pickle."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from adapter_manager.kernels import WeightLayout
from adapter_manager.kernels.cpu import layout_choice, library
from adapter_manager.runtime.model.checkpoint import load_model
from adapter_manager.runtime.model.projection import LoRALinear
from tests.runtime._oracle import ROWS
from tests.runtime._steps import prefill_logits


@pytest.fixture
def auto(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(layout_choice.LAYOUT_ENV, "auto")
    monkeypatch.setattr(layout_choice, "_path", lambda: tmp_path / layout_choice.CACHE_FILE)


def _layouts(model) -> set[WeightLayout]:
    return {m.layout for m in model.modules() if isinstance(m, LoRALinear)}


def test_a_model_packed_by_the_choice_computes_what_its_plain_weights_do(auto, written) -> None:
    plain, model = (load_model(written[None][0], pack_weights=False) for _ in range(2))
    assert model.pack_weights() == (model.layout_choice.layout is not WeightLayout.PLAIN)
    choice = model.layout_choice
    assert choice.source in ("measured", "cached") and _layouts(model) == {choice.layout}
    copy = pickle.loads(pickle.dumps(model))  # travels plain, packed again in the same layout on arrival
    assert _layouts(copy) == {choice.layout}
    prompts = [p for p, _ in ROWS]
    for m in (plain, model, copy):
        m.setup_caches(max_batch=len(ROWS), max_seq_len=32)
    for ours, again, theirs in zip(*(prefill_logits(m, prompts) for m in (model, copy, plain)), strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(again, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", [WeightLayout.BLOCKED, WeightLayout.ONEDNN, WeightLayout.PLAIN])
def test_pack_weights_in_a_given_layout(layout: WeightLayout, written) -> None:
    plain, model = (load_model(written[None][0], pack_weights=False) for _ in range(2))
    assert model.pack_weights(layout) == (layout is not WeightLayout.PLAIN)
    expected = WeightLayout.ONEDNN if layout is WeightLayout.BLOCKED and not library.load() else layout
    assert _layouts(model) == {expected} and model.layout_choice is None  # given, not chosen
    prompts = [p for p, _ in ROWS]
    for m in (plain, model):
        m.setup_caches(max_batch=len(ROWS), max_seq_len=32)
    for ours, theirs in zip(prefill_logits(model, prompts), prefill_logits(plain, prompts), strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
