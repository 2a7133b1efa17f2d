"""Phi-3 / Phi-3.5 (and Phi-4 mini where its RoPE is whole): the Llama block whose checkpoint fuses q|k|v into
``qkv_proj`` and gate|up into ``gate_up_proj`` (our own fused layout), as PEFT target modules too (an adapter on
``qkv_proj`` is served as one on q, k and v with the same A: :mod:`adapter_manager.base_model`). LongRoPE and a
partial rotary factor are refused by the common fields."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .family import SILU, Family


def read(config: Mapping[str, Any]) -> dict[str, Any]:
    return {"fused_projections": True}


PHI3 = Family("phi3", ("phi3",), ("Phi3ForCausalLM",), SILU, read)
