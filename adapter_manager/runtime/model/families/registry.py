"""The served families by HF ``model_type`` (vLLM's model registry): one place, each family one file beside it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .common import common_fields
from .family import Family, refuse
from .gemma import GEMMA, GEMMA2, GEMMA3
from .llama import LLAMA
from .mistral import MISTRAL
from .phi3 import PHI3
from .qwen import QWEN2, QWEN3

FAMILIES: tuple[Family, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA, GEMMA2, GEMMA3, PHI3)
"""Every family the engine computes exactly; any other checkpoint is refused by name."""


def family_of(config: Mapping[str, Any]) -> Family:
    """The family of an HF config.json: by ``model_type`` (a config without one: Llama, as older checkpoints wrote
    it), its ``architectures`` checked against the family's. Raises :class:`UnsupportedModelError` otherwise."""
    model_type = config.get("model_type") or "llama"
    family = next((f for f in FAMILIES if model_type in f.model_types), None)
    if family is None:
        served = ", ".join(t for f in FAMILIES for t in f.model_types)
        raise refuse(config, "model_type", f"{model_type!r} is not a served family (served: {served})")
    for architecture in config.get("architectures") or ():
        if architecture not in family.architectures:
            served = ", ".join(family.architectures)
            raise refuse(config, "architectures", f"{architecture!r} is not served (served: {served})")
    return family


def read_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """LlamaConfig keyword arguments for an HF config.json of a served family, or :class:`UnsupportedModelError`
    naming the architecture and the field we do not compute."""
    family = family_of(config)
    return {**common_fields(config, family), **family.read(config)}
