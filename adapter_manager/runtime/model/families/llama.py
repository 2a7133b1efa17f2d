"""Llama (1-3.x, and every checkpoint that says model_type "llama": SmolLM2, TinyLlama, ...): the block as it is,
with HF's optional ``attention_bias`` (q/k/v/o) and ``mlp_bias`` (gate/up/down)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .family import SILU, Family

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def read(config: Mapping[str, Any]) -> dict[str, Any]:
    bias = ATTENTION if config.get("attention_bias") else ()
    return {"bias": bias + (MLP if config.get("mlp_bias") else ())}


LLAMA = Family("llama", ("llama",), ("LlamaForCausalLM",), SILU, read)
