"""Gemma 1 and Gemma 2: (1 + w) RMSNorm, embeddings scaled by √hidden, GeGLU (tanh); Gemma 2 adds the post-norms
around attention and the MLP, the query scale ``query_pre_attn_scalar``, and tanh soft-capping of the final logits
and of the attention scores."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .family import GELU_TANH, Family
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
