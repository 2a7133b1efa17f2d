"""The config fields every family shares (shapes, RoPE, ids), the sliding window, and the refusals common to all."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .family import Family, neutral, refuse

_ROPE_TYPES = ("default", "llama3")
_FOREIGN_TERMS: dict[str, tuple[Any, ...]] = {
    "quantization_config": (),
    "embedding_multiplier": (1, 1.0, None),
    "residual_multiplier": (1, 1.0, None),
    "attention_multiplier": (None,),
    "logits_scaling": (1, 1.0, None),
    "no_rope_layers": (None,),
    "rope_interleaved": (False, None),
    "use_bidirectional_attention": (False, None),
    "use_qk_norm": (False, None),
    "partial_rotary_factor": (1, 1.0, None),
}
"""Terms of other Llama-like families (Granite's multipliers, SmolLM3's NoPE layers, interleaved RoPE, ...): refused
wherever they are not neutral, whatever the model_type says."""


def common_fields(config: Mapping[str, Any], family: Family) -> dict[str, Any]:
    """LlamaConfig keyword arguments every family reads the same way, after the refusals common to all."""
    for field, allowed in _FOREIGN_TERMS.items():
        neutral(config, field, *allowed)
    act = config.get(family.activation_key) or config.get("hidden_act") or next(iter(family.activations))
    if act not in family.activations:
        served = ", ".join(family.activations)
        raise refuse(config, family.activation_key, f"{act!r} is not computed for {family.name} (served: {served})")
    rope_parameters = config.get("rope_parameters")
    if isinstance(rope_parameters, Mapping) and "full_attention" in rope_parameters:  # per layer type (Gemma 3)
        rope_parameters = rope_parameters["full_attention"]  # the global layers'; the family reads the others
    rope = dict(rope_parameters or config.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", None) or config.get("rope_theta") or 10000.0
    rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    if rope_type not in _ROPE_TYPES:
        raise refuse(config, "rope_parameters.rope_type", f"{rope_type!r} is not computed (served: {_ROPE_TYPES})")
    neutral(rope, "partial_rotary_factor", 1, 1.0, None)
    num_heads = config["num_attention_heads"]
    return {
        "model_type": family.name,
        "hidden_act": family.activations[act],
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "num_layers": config["num_hidden_layers"],
        "num_heads": num_heads,
        "num_kv_heads": config.get("num_key_value_heads") or num_heads,
        "head_dim": config.get("head_dim") or 0,
        "vocab_size": config["vocab_size"],
        "rms_norm_eps": config.get("rms_norm_eps", 1e-6),
        "rope_theta": float(theta),
        "rope_scaling": {"rope_type": rope_type, **rope},
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "max_position_embeddings": config.get("max_position_embeddings", 2048),
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": config.get("eos_token_id"),
        "sliding_window": sliding_window(config),
    }


def sliding_window(config: Mapping[str, Any]) -> int | None:
    """The shortest sliding window any layer attends through, None where every layer attends in full.

    HF's rule: layers whose ``layer_types`` entry is "sliding_attention" (every layer where the config lists no
    layer_types), and Qwen's ``use_sliding_window`` off means none. A query at position i then reads keys j with
    i - j < window: the engine serves such a model only where every context fits the window
    (:meth:`Llama.setup_caches` refuses a longer ``max_seq_len``)."""
    window = config.get("sliding_window")
    if not window or config.get("use_sliding_window") is False:
        return None
    types = config.get("layer_types")
    if types is not None and "sliding_attention" not in types:
        return None
    return int(window)
