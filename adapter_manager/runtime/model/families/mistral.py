"""Mistral: the Llama block with an explicit head_dim and a sliding window (served where every context fits it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .family import SILU, Family


def read(config: Mapping[str, Any]) -> dict[str, Any]:
    return {}  # head_dim and the window are common fields


MISTRAL = Family("mistral", ("mistral",), ("MistralForCausalLM",), SILU, read)
