"""What a model family is: the HF ``model_type`` / ``architectures`` it answers to and the terms it adds to the Llama
block, read from its ``config.json``; and the one typed error for a checkpoint we do not compute exactly."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

SILU = {"silu": "silu", "swish": "silu"}
"""The SwiGLU families' activation names -> the gated activation the blocks run."""
GELU_TANH = {"gelu_pytorch_tanh": "gelu_tanh"}
"""GeGLU with the tanh approximation (``gelu_new`` computes the same function; plain ``gelu`` is the erf one)."""


class UnsupportedModelError(ValueError):
    """A checkpoint whose architecture or config field the engine does not compute exactly: refused at load, never
    served. ``architecture`` is the HF model_type (or architectures entry); ``field`` the config key at fault."""

    def __init__(self, architecture: str, field: str, message: str) -> None:
        super().__init__(f"{architecture}: {field}: {message}")
        self.architecture, self.field = architecture, field


@dataclass(frozen=True)
class Family:
    """One served model family (vLLM's model registry entry): which configs it reads and what it adds to Llama.

    ``read`` turns an HF config.json (a dict) into :class:`LlamaConfig` keyword arguments beyond the common ones
    (:func:`families.common.common_fields`), raising :class:`UnsupportedModelError` for a value it does not compute.
    """

    name: str
    """The served name, e.g. "qwen3"."""
    model_types: tuple[str, ...]
    """HF ``model_type`` values it reads."""
    architectures: tuple[str, ...]
    """HF ``architectures`` entries it reads (the ``*ForCausalLM`` class)."""
    activations: Mapping[str, str]
    """The activation names the family's checkpoints use that we compute -> the blocks' ("silu", "gelu_tanh")."""
    read: Callable[[Mapping[str, Any]], dict[str, Any]]
    """The family's own fields (see above)."""
    activation_key: str = "hidden_act"
    """The config key naming the MLP's activation (Gemma 2: ``hidden_activation``)."""


def refuse(config: Mapping[str, Any], field: str, message: str) -> UnsupportedModelError:
    """The typed refusal of ``field`` in ``config`` (its model_type named)."""
    return UnsupportedModelError(str(config.get("model_type") or "unknown"), field, message)


def neutral(config: Mapping[str, Any], field: str, *allowed: Any) -> None:
    """Refuse ``field`` unless it is absent or one of ``allowed`` (None, False, 1.0 ...): a term we do not compute."""
    if field in config and config[field] not in allowed:
        allowed_text = " or ".join(repr(a) for a in allowed) or "absent"
        raise refuse(config, field, f"{config[field]!r} is not computed here (served: {allowed_text})")
