"""Oracle material for the vocabulary modules: embedding / lm_head LoRA and trainable tokens, trained a few steps by
real `peft` on the tiny Llama, untied and tied, and the batches that mix them with plain LoRA and base rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import make_tiny_llama
from tests.runtime._oracle import QV_LORA
from tests.runtime._variants import write_trained

# name -> (tied base, LoraConfig keywords, save_embedding_layers)
VOCAB_ADAPTERS = {
    "embed_head": (False, dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "lm_head", "q_proj"]), True),
    "embed_only": (False, dict(r=2, lora_alpha=4, target_modules=["embed_tokens"]), False),
    "tokens": (False, dict(r=2, lora_alpha=4, target_modules=["v_proj"], trainable_token_indices=[3, 5, 9, 60]), False),
    "tokens_both": (
        False, dict(r=2, lora_alpha=4, target_modules=["q_proj"],
                    trainable_token_indices={"embed_tokens": [2, 7], "lm_head": [7, 11, 40]}), False,
    ),
    "plain": (False, QV_LORA, False),
    "tied_tokens": (True, dict(r=2, lora_alpha=4, target_modules=["q_proj"], trainable_token_indices=[3, 5, 9]), False),
    "tied_head": (True, dict(r=3, lora_alpha=6, target_modules=["lm_head", "embed_tokens", "o_proj"]), True),
    "tied_apart": (
        True, dict(r=2, lora_alpha=4, target_modules=["k_proj"],
                   trainable_token_indices={"embed_tokens": [4, 6], "lm_head": [6, 8, 50]}), False,
    ),
}  # fmt: skip
# (prompt, adapter or None) per base: the prompts hold the trained token ids, so the replaced rows are read
UNTIED_ROWS = [
    ([1, 3, 9, 3, 7, 11], "embed_head"),
    ([2, 8, 33], None),
    ([5, 60, 4, 33, 9, 17, 3], "tokens"),
    ([7, 1, 2], "plain"),
    ([30, 7, 32, 2, 34], "tokens_both"),
    ([9, 9, 40, 2], "embed_only"),
    ([50, 3, 8, 12], "embed_head"),
]
TIED_ROWS = [
    ([1, 3, 9, 5, 7], "tied_tokens"),
    ([2, 8, 33], None),
    ([4, 6, 8, 50, 6], "tied_apart"),
    ([5, 9, 40, 2], "tied_head"),
    ([3, 3, 3], "tied_tokens"),
]


def write_vocab_adapters(root: Path) -> dict[str | None | tuple[str, bool], tuple[Path, object]]:
    """Every adapter of VOCAB_ADAPTERS written by peft (with its PeftModel), and both bases: None the untied,
    "tied" the tied tiny Llama (folder, HF model)."""
    pytest.importorskip("peft")
    out: dict = {}
    for i, (name, (tie, kwargs, save_tables)) in enumerate(VOCAB_ADAPTERS.items()):
        out[name] = write_trained(root / name, seed=i + 31, tie=tie, save_embedding_layers=save_tables, **kwargs)
    for key, tie in ((None, False), ("tied", True)):
        base = make_tiny_llama(tie=tie)
        base.save_pretrained(root / f"base-{tie}")
        out[key] = (root / f"base-{tie}", base)
    return out
