"""Gemma 1, 2 and 3 (text): (1 + w) RMSNorm, embeddings scaled by √hidden, GeGLU (tanh); Gemma 2 adds the
post-norms around attention and the MLP, the query scale ``query_pre_attn_scalar``, and tanh soft-capping of the final
logits and of the attention scores; Gemma 3 drops the soft-caps and adds per-head q/k norms and a RoPE base of its own
for the sliding (local) layers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .family import GELU_TANH, Family, refuse
from .llama import ATTENTION

_GEMMA1_ACT = {**GELU_TANH, "gelu": "gelu_tanh"}  # transformers reads Gemma 1's legacy "gelu" as the tanh form


def read_gemma(config: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "bias": ATTENTION if config.get("attention_bias") else (),
        "norm_offset": 1.0,
        "scale_embeddings": True,
    }


def read_gemma2(config: Mapping[str, Any]) -> dict[str, Any]:
    return {
        **read_gemma(config),
        "sandwich_norms": True,
        "query_pre_attn_scalar": config.get("query_pre_attn_scalar", 256),
        "attn_logit_softcapping": config.get("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": config.get("final_logit_softcapping", 30.0),
    }


GEMMA = Family("gemma", ("gemma",), ("GemmaForCausalLM",), _GEMMA1_ACT, read_gemma)
GEMMA2 = Family("gemma2", ("gemma2",), ("Gemma2ForCausalLM",), GELU_TANH, read_gemma2, "hidden_activation")


def read_gemma3(config: Mapping[str, Any]) -> dict[str, Any]:
    types = config.get("layer_types")
    if types is None:  # transformers' default: every sliding_window_pattern-th layer global
        pattern, layers = config.get("sliding_window_pattern", 6), config["num_hidden_layers"]
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    return {
        **read_gemma(config),
        "sandwich_norms": True,
        "qk_norm": True,
        "query_pre_attn_scalar": config.get("query_pre_attn_scalar", 256),
        "attn_logit_softcapping": config.get("attn_logit_softcapping"),
        "final_logit_softcapping": config.get("final_logit_softcapping"),
        "local_rope_theta": _local_theta(config),
        "local_layers": tuple(i for i, kind in enumerate(types) if kind == "sliding_attention"),
    }


def _local_theta(config: Mapping[str, Any]) -> float:
    """The sliding layers' RoPE base: transformers 5's ``rope_parameters["sliding_attention"]`` (plain RoPE only), or
    the older ``rope_local_base_freq``."""
    local = (config.get("rope_parameters") or {}).get("sliding_attention")
    if local is None:
        return float(config.get("rope_local_base_freq", 10000.0))
    if (local.get("rope_type") or "default") != "default":
        raise refuse(config, "rope_parameters.sliding_attention.rope_type", f"{local['rope_type']!r} is not computed")
    return float(local.get("rope_theta", 10000.0))


GEMMA3 = Family("gemma3_text", ("gemma3_text",), ("Gemma3ForCausalLM",), GELU_TANH, read_gemma3, "hidden_activation")
