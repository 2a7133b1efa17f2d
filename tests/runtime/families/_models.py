"""Tiny random checkpoints of every served family, written by transformers, with PEFT adapters written by peft: the
oracles of the family tests (each family's HF model and PeftModels, one adapter at a time)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    # name: (transformers config class, causal LM class, config fields beyond SHAPE)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6, tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, rope_theta=1e6)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=32, sliding_window=64)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=32)),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=64,
            attn_logit_softcapping=1.0,  # small caps, so the random model's scores and logits feel them
            final_logit_softcapping=2.0,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=64,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},  # far from the global base
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            },
        ),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict()),
}
ATTENTION_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHI3_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
ADAPTERS: dict[str, dict] = {
    "all": dict(r=4, lora_alpha=8),
    "attn": dict(r=8, lora_alpha=4, use_rslora=True, target="attention"),
    "mlp": dict(r=2, lora_alpha=6, target="mlp"),
}


@dataclass
class WrittenFamily:
    """One family's checkpoint folder and HF model, and its adapters' folders and PeftModels by name."""

    name: str
    folder: Path
    model: object
    adapters: dict[str, tuple[Path, object]] = field(default_factory=dict)

    def oracle(self, adapter: str | None):
        return self.model if adapter is None else self.adapters[adapter][1]


def hf_model(family: str, seed: int = 0, **overrides):
    """The family's tiny causal LM with every weight random (norms and biases too, so a missing term shows)."""
    transformers = pytest.importorskip("transformers")
    config_class, model_class, fields = FAMILIES[family]
    config = getattr(transformers, config_class)(**SHAPE, vocab_size=512, **{**fields, **overrides})
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, 0
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(0.1 * torch.randn_like(param) + (0.0 if family.startswith("gemma") else 1.0))
            elif name.endswith("bias"):
                param.copy_(0.05 * torch.randn_like(param))
    return model


def targets(family: str, which: str | None) -> list[str]:
    names = PHI3_TARGETS if family == "phi3" else ATTENTION_MLP
    if which == "attention":
        return [n for n in names if n in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")]
    if which == "mlp":
        return [n for n in names if n not in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")]
    return names


def write_family(root: Path, family: str, adapters: dict[str, dict] = ADAPTERS) -> WrittenFamily:
    """Write the family's checkpoint (transformers) and its adapters (peft) under ``root``."""
    peft = pytest.importorskip("peft")
    model = hf_model(family)
    model.save_pretrained(root / "base")
    written = WrittenFamily(family, root / "base", model)
    for i, (name, kwargs) in enumerate(adapters.items()):
        kwargs = dict(kwargs)
        kwargs.setdefault("target_modules", targets(family, kwargs.pop("target", None)))
        config = peft.LoraConfig(init_lora_weights=False, **kwargs)
        torch.manual_seed(100 + i)
        peft_model = peft.get_peft_model(hf_model(family), config).eval()
        peft_model.save_pretrained(root / name)
        written.adapters[name] = (root / name, peft_model)
    return written
