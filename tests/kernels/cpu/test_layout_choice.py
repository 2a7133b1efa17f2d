"""The weight layout chosen by measurement (kernels.cpu.layout_choice): every layout this build has is timed, the
fastest decode chain is kept, cached per machine and shapes, forced by ADAPTER_MANAGER_WEIGHT_LAYOUT (the model
packed by it: tests/runtime/model/test_layout_packing.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from adapter_manager.kernels import WeightLayout
from adapter_manager.kernels.cpu import layout_choice, library

SHAPES = [(96, 32, 3), (64, 48, 2)]


@pytest.fixture
def auto(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Layout ``auto`` with a kernel cache of this test's own (the library builds there once per session dir)."""
    monkeypatch.setenv(layout_choice.LAYOUT_ENV, "auto")
    monkeypatch.setattr(layout_choice, "_path", lambda: tmp_path / layout_choice.CACHE_FILE)
    monkeypatch.setattr(layout_choice, "_logged", set())
    return tmp_path / layout_choice.CACHE_FILE


def test_measures_every_candidate_keeps_the_fastest_and_caches_it(auto: Path, caplog) -> None:
    options = layout_choice.candidates(torch.float32)
    assert options[-1] is WeightLayout.PLAIN and (WeightLayout.BLOCKED in options) == library.load()
    with caplog.at_level(logging.INFO, logger=layout_choice.__name__):
        first = layout_choice.choose_layout(torch.float32, SHAPES)
    assert first.source == "measured" and first.layout in options
    assert set(first.decode_ms) == {o.value for o in options}
    assert first.layout.value in first.prefill_ms and set(first.prefill_ms) <= set(first.decode_ms)
    assert all(ms > 0 for ms in (*first.decode_ms.values(), *first.prefill_ms.values()))
    assert first.decode_ms[first.layout.value] == min(first.decode_ms.values())
    assert "weight layout for float32" in caplog.text and first.layout.value in caplog.text
    table = json.loads(auto.read_text())
    assert [entry["layout"] for entry in table.values()] == [first.layout.value]

    again = layout_choice.choose_layout(torch.float32, list(reversed(SHAPES)))  # the same shapes in another order
    assert (again.source, again.layout, again.decode_ms) == ("cached", first.layout, first.decode_ms)
    other = layout_choice.choose_layout(torch.float32, [(96, 32, 1)])
    assert other.source == "measured" and len(json.loads(auto.read_text())) == 2


def test_bf16_and_fp16_candidates() -> None:
    assert WeightLayout.BLOCKED not in layout_choice.candidates(torch.bfloat16)
    assert layout_choice.candidates(torch.float16) == [WeightLayout.PLAIN]


def test_an_unreadable_cache_is_measured_again_and_rewritten(auto: Path) -> None:
    auto.write_text("{not json")
    choice = layout_choice.choose_layout(torch.float32, SHAPES)
    assert choice.source == "measured" and len(json.loads(auto.read_text())) == 1
    key = next(iter(json.loads(auto.read_text())))
    auto.write_text(json.dumps({key: {"layout": "no-such-layout"}}))
    assert layout_choice.choose_layout(torch.float32, SHAPES).source == "measured"
    assert json.loads(auto.read_text())[key]["layout"] in {o.value for o in layout_choice.candidates(torch.float32)}
    assert not [p for p in auto.parent.iterdir() if p.name.startswith(".layouts-")]  # no temp file left


@pytest.mark.parametrize("value", ["blocked", "onednn", "plain", " ONEDNN "])
def test_the_environment_forces_a_layout(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(layout_choice.LAYOUT_ENV, value)
    choice = layout_choice.choose_layout(torch.float32, SHAPES)
    wanted = WeightLayout(value.strip().lower())
    expected = wanted if wanted in layout_choice.candidates(torch.float32) else WeightLayout.ONEDNN
    assert choice.source == "forced" and choice.layout is expected and choice.decode_ms == {}
    assert value.strip().lower() in choice.describe()
    fp16 = layout_choice.choose_layout(torch.float16, SHAPES)
    assert fp16.layout is WeightLayout.PLAIN  # a layout the dtype has no form for falls back to one it has


@pytest.mark.parametrize("value", ["fastest", "int8"])  # int8 is load_model's quantize, not a layout
def test_an_unknown_forced_layout_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(layout_choice.LAYOUT_ENV, value)
    with pytest.raises(ValueError, match="expected auto, blocked, onednn or plain"):
        layout_choice.choose_layout(torch.float32, SHAPES)
