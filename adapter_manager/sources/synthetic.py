"""Writes random LoRA adapters in PEFT's on-disk format, for demos and benchmarks (tests also use real `peft`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..base_model import PROJECTIONS, BaseModelSpec
from .peft_format import CONFIG_NAME, WEIGHTS_NAME, LoraAdapterConfig, Variant


def write_synthetic_adapter(
    folder: str | Path,
    spec: BaseModelSpec,
    *,
    r: int = 16,
    lora_alpha: float = 32.0,
    target_modules: Sequence[str] = PROJECTIONS,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    variant: Variant | str = Variant.LORA,
    trainable_tokens: Sequence[int] = (),
) -> Path:
    """Write `adapter_config.json` and `adapter_model.safetensors` as `peft`'s `save_pretrained` lays them out.

    A and B are both random (unlike a freshly initialised PEFT adapter, whose B is zero), so the adapter changes the
    model's output. ``variant`` "dora" adds a `lora_magnitude_vector` per module (``1 + 0.01 · noise``: the writer does
    not know the base's row norms, so the scale it makes is arbitrary), "lora_bias" a small random `lora_B.bias`.
    ``target_modules`` may name ``embed_tokens`` (``lora_embedding_A [r, V]``, ``lora_embedding_B [H, r]``) and
    ``lm_head``; ``trainable_tokens``: ids whose embedding rows the adapter replaces by random ones (PEFT's
    ``trainable_token_indices``; tied to the head where the spec ties it).
    """
    variant = Variant(variant)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    raw = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": spec.name,
        "r": r,
        "lora_alpha": lora_alpha,
        "use_rslora": use_rslora,
        "target_modules": list(target_modules),
        "rank_pattern": rank_pattern or {},
        "alpha_pattern": alpha_pattern or {},
        "bias": "none",
        "lora_dropout": 0.0,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_dora": variant is Variant.DORA,
        "lora_bias": variant is Variant.LORA_BIAS,
    }
    if trainable_tokens:
        raw["trainable_token_indices"] = list(trainable_tokens)
    config = LoraAdapterConfig.from_dict(raw, str(folder))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, lora in config.resolve(spec, str(folder), max_rank=1 << 30).items():
        fan_in, fan_out = spec.projection_shape(key.proj)
        prefix = f"base_model.model.{key.module_name}"
        if lora.tokens is not None:
            if lora.tokens.source == key.proj:
                rows = 0.02 * torch.randn(lora.rank, spec.hidden_size, generator=generator)
                tensors[f"{prefix}.token_adapter.trainable_tokens_delta"] = rows.to(dtype)
            continue
        if key.proj == "embed_tokens":
            tensors[f"{prefix}.lora_embedding_A"] = torch.randn(lora.rank, fan_in, generator=generator).to(dtype)
            tensors[f"{prefix}.lora_embedding_B"] = (0.02 * torch.randn(fan_out, lora.rank, generator=generator)).to(
                dtype
            )
            continue
        tensors[f"{prefix}.lora_A.weight"] = (torch.randn(lora.rank, fan_in, generator=generator) / fan_in**0.5).to(
            dtype
        )
        tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, lora.rank, generator=generator) / lora.rank).to(
            dtype
        )
        if variant is Variant.DORA:
            magnitude = 1 + 0.01 * torch.randn(fan_out, generator=generator)
            tensors[f"{prefix}.lora_magnitude_vector"] = magnitude.to(dtype)
        elif variant is Variant.LORA_BIAS:
            tensors[f"{prefix}.lora_B.bias"] = (0.01 * torch.randn(fan_out, generator=generator)).to(dtype)
    save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    (folder / CONFIG_NAME).write_text(json.dumps(raw, indent=2))
    return folder
