"""Qwen2 / Qwen2.5 (q/k/v bias) and Qwen3 dense (per-head RMSNorm of q and k before RoPE, explicit head_dim)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .family import SILU, Family
from .llama import ATTENTION


def read_qwen2(config: Mapping[str, Any]) -> dict[str, Any]:
    return {"bias": ATTENTION[:3]}  # Qwen2Attention: q/k/v with bias, o without, whatever the config says


def read_qwen3(config: Mapping[str, Any]) -> dict[str, Any]:
    return {"bias": ATTENTION if config.get("attention_bias") else (), "qk_norm": True}


QWEN2 = Family("qwen2", ("qwen2",), ("Qwen2ForCausalLM",), SILU, read_qwen2)
QWEN3 = Family("qwen3", ("qwen3",), ("Qwen3ForCausalLM",), SILU, read_qwen3)
