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


TRAINED_TOKENS = 8  # trainable tokens of a "tokens" adapter: ids 100 .. 107
VOCAB_KINDS = {
    "vocab": {"target_modules": (*PROJECTIONS, "embed_tokens", "lm_head")},
    "tokens": {"trainable_tokens": tuple(range(100, 100 + TRAINED_TOKENS))},
}
"""Adapter kinds served with the pool's vocabulary columns (`AdapterManagerConfig.lora_vocab`)."""


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
