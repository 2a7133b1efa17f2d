"""The bench checkpoint and synthetic PEFT adapters on disk: what every benchmark serves."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from adapter_manager import BaseModelSpec, write_synthetic_adapter
from adapter_manager.base_model import PROJECTIONS
from adapter_manager.runtime.model.checkpoint import write_random_checkpoint
from adapter_manager.runtime.model.config import LlamaConfig


def write_checkpoint(
    folder: Path, config: LlamaConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32, reuse: bool = False
) -> Path:
    """The random checkpoint of ``config`` in ``folder``; ``reuse``: keep one already there (config.json present)."""
    if not (reuse and (folder / "config.json").exists()):
        write_random_checkpoint(config, folder, seed=seed, dtype=dtype)
    return folder


FAMILY_CLASSES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
}
"""Families whose bench-shaped checkpoints transformers writes (:func:`write_family_checkpoint`)."""


def write_family_checkpoint(folder: Path, config: LlamaConfig, family: str, dtype: torch.dtype) -> Path:
    """A random checkpoint of ``family`` with ``config``'s shapes (so the same weight bytes as the Llama one, an
    untied head included), written by transformers (the dev extra); norms and biases random too."""
    import transformers

    config_class, model_class, extra = FAMILY_CLASSES[family]
    hf_config = getattr(transformers, config_class)(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(hf_config).to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "bias")):
                param.normal_(0.0 if family == "gemma" or name.endswith("bias") else 1.0, 0.05)
    model.save_pretrained(folder)
    return folder


TRAINED_TOKENS = 8  # trainable tokens of a "tokens" adapter: ids 100 .. 107
VOCAB_KINDS = {
    "vocab": {"target_modules": (*PROJECTIONS, "embed_tokens", "lm_head")},
    "tokens": {"trainable_tokens": tuple(range(100, 100 + TRAINED_TOKENS))},
}
"""Adapter kinds served with the pool's vocabulary columns (`RowOptions.lora_vocab`)."""


def write_adapters(
    root: Path,
    spec: BaseModelSpec,
    ids: Sequence[str],
    ranks: Sequence[int],
    *,
    lora_alpha: float | None = None,
    reuse: bool = False,
    variant: str = "lora",
) -> list[Path]:
    """One synthetic adapter per id in ``root / id``: rank ``ranks[i]``, seed i, all seven projections.

    ``lora_alpha`` None: twice the adapter's rank. ``reuse``: keep a folder that holds adapter_config.json (written
    last, so such a folder is complete). ``variant``: "lora", "dora" or "lora_bias" (`write_synthetic_adapter`),
    or a vocabulary kind (:data:`VOCAB_KINDS`): "vocab" (LoRA on embed_tokens and lm_head too), "tokens" (and
    :data:`TRAINED_TOKENS` trainable tokens). Returns the folders, in the order of ``ids``.
    """
    extra = VOCAB_KINDS.get(variant, {"variant": variant})
    folders = []
    for i, (adapter_id, rank) in enumerate(zip(ids, ranks, strict=True)):
        folder = root / adapter_id
        if not (reuse and (folder / "adapter_config.json").exists()):
            alpha = 2 * rank if lora_alpha is None else lora_alpha
            write_synthetic_adapter(folder, spec, r=rank, lora_alpha=alpha, seed=i, **extra)
        folders.append(folder)
    return folders
