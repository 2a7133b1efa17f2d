"""LlamaConfig: presets, validation messages, the adapter-facing spec, and RoPE frequencies against transformers."""

from __future__ import annotations

import pytest
import torch

from adapter_manager import BaseModelSpec
from adapter_manager.runtime.model.config import LlamaConfig, RopeScaling
from adapter_manager.runtime.model.rope import inv_frequencies

transformers = pytest.importorskip("transformers")


def test_presets() -> None:
    bench = LlamaConfig.bench()
    assert (bench.hidden_size, bench.num_layers, bench.num_heads, bench.num_kv_heads) == (1024, 8, 16, 4)
    assert (bench.intermediate_size, bench.vocab_size, bench.head_dim) == (2816, 32000, 64)
    assert bench.to_spec("adapter-manager/bench-llama") == BaseModelSpec.bench()
    tiny = LlamaConfig.tiny()
    assert tiny.vocab_size >= 258 and tiny.num_heads > tiny.num_kv_heads


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_heads=6, num_kv_heads=4, hidden_size=48), r"num_heads \(6\) is not a multiple of num_kv_heads \(4\)"),
        (dict(hidden_size=30), r"hidden_size \(30\) is not a multiple of num_heads \(4\)"),
        (dict(num_layers=0), r"num_layers must be a positive int, got 0"),
        (dict(head_dim=7), r"head_dim must be a positive even int, got 7"),
        (dict(rms_norm_eps=0.0), r"rms_norm_eps \(0.0\)"),
    ],
)
def test_validation_names_the_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LlamaConfig(**kwargs)


def test_rope_scaling_validation() -> None:
    with pytest.raises(ValueError, match="'yarn'"):
        RopeScaling("yarn")
    with pytest.raises(ValueError, match="low_freq_factor=4.0, high_freq_factor=1.0"):
        RopeScaling("llama3", low_freq_factor=4.0, high_freq_factor=1.0)


@pytest.mark.parametrize("rope_type", ["default", "llama3"])
def test_inv_frequencies_match_transformers(rope_type: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    hf = transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_theta=5e5,
        rope_scaling=scaling if rope_type == "llama3" else None,
    )
    ours = inv_frequencies(LlamaConfig.from_hf(hf.to_dict()))
    if rope_type == "llama3":
        theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    else:
        theirs = 1.0 / (5e5 ** (torch.arange(0, 128, 2, dtype=torch.float) / 128))
    assert torch.equal(ours, theirs)
