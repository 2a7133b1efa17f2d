"""Oracle material for the LoRA variants (DoRA, LoRA bias): adapters trained a few steps by real `peft` on the tiny
Llama, so their magnitudes and biases are PEFT's own, and the batches that mix them with plain LoRA and base rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import make_tiny_llama
from tests.runtime._oracle import QV_LORA

VARIANTS = {
    "dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules="all-linear"),
    "dora_rslora": dict(
        r=2, lora_alpha=4, use_dora=True, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"down_proj": 4},
    ),
    "bias": dict(r=4, lora_alpha=8, lora_bias=True, target_modules="all-linear"),
    "bias_subset": dict(
        r=3, lora_alpha=6, lora_bias=True, target_modules=["k_proj", "up_proj"], layers_to_transform=[1]
    ),
    "plain": QV_LORA,
}  # fmt: skip
# (prompt, adapter or None): every variant beside plain LoRA and base rows, one variant on two rows
VARIANT_ROWS = [
    ([1, 5, 9, 3, 7, 11], "dora"),
    ([2, 8, 33], None),
    ([4, 60, 4, 33, 4, 17, 4, 9, 12], "bias"),
    ([7, 1], "plain"),
    ([30, 31, 32, 33, 34], "dora_rslora"),
    ([9, 9, 40, 2], "bias_subset"),
    ([50, 3, 8, 12], "dora"),
]


def write_trained(
    folder: Path, seed: int, steps: int = 3, tie: bool = False, save_embedding_layers: bool = False, **lora_kwargs
) -> tuple[Path, object]:
    """A PEFT adapter from random A and B (``init_lora_weights=False``) trained ``steps`` Adam steps on random tokens,
    which moves DoRA's magnitudes, LoRA's biases and trainable tokens' rows off their initial values; saved by peft
    (``save_embedding_layers``: with the frozen tables an embedding / lm_head LoRA wraps). ``tie``: on the tiny
    Llama with tied embeddings."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(init_lora_weights=False, **lora_kwargs)
    torch.manual_seed(seed)
    model = peft.get_peft_model(make_tiny_llama(tie=tie), config)
    model.train()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
    for _ in range(steps):
        tokens = torch.randint(0, 64, (2, 12))
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    model.save_pretrained(folder, save_embedding_layers=save_embedding_layers)
    return folder, model
