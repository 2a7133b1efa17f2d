"""The base model's shape, as far as LoRA adapters see it: layers and the in/out width of each projection."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

# The Llama projections a LoRA adapter may target, and the submodule that holds each.
PROJECTIONS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROJECTION_PARENT: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
# Checkpoints that fuse projections (Phi-3) name these modules, each the listed projections' outputs side by side;
# a LoRA on one is served as a LoRA on each part with the same A (`sources.peft_fused`).
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# The modules over the vocabulary a LoRA adapter may also target (with the pool's vocabulary columns on): the input
# embedding table and the output head. Their ModuleKey has layer -1.
VOCAB_MODULES: tuple[str, ...] = ("embed_tokens", "lm_head")
MAX_RANK = 64
"""R, the highest LoRA rank a pool accepts unless told: the one default every config and the CLI read."""

_VOCAB_NAMES = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}


class ModuleKey(NamedTuple):
    """One LoRA-able module of the base model: (layer index, projection name); (-1, "embed_tokens") and
    (-1, "lm_head") for the vocabulary modules (:meth:`vocab`)."""

    layer: int
    proj: str

    @classmethod
    def vocab(cls, name: str) -> ModuleKey:
        """The key of vocabulary module ``name`` ("embed_tokens", "lm_head")."""
        if name not in VOCAB_MODULES:
            raise ValueError(f"unknown vocabulary module {name!r}; expected one of {VOCAB_MODULES}")
        return cls(-1, name)

    @property
    def is_vocab(self) -> bool:
        return self.layer < 0

    @property
    def module_name(self) -> str:
        """The module's name inside HF `LlamaForCausalLM`, e.g. `model.layers.3.self_attn.q_proj`, `lm_head`."""
        if self.is_vocab:
            return _VOCAB_NAMES[self.proj]
        return f"model.layers.{self.layer}.{PROJECTION_PARENT[self.proj]}.{self.proj}"


@dataclass(frozen=True)
class BaseModelSpec:
    """Shape of a Llama-family base model (read from its HF config.json)."""

    name: str  # the base model's name or hub id, compared with an adapter's base_model_name_or_path
    hidden_size: int  # H
    intermediate_size: int  # MLP width
    num_layers: int  # L
    num_heads: int  # attention (query) heads
    num_kv_heads: int  # key/value heads (GQA); equals num_heads without GQA
    head_dim: int  # width of one head
    aliases: tuple[str, ...] = ()  # the served checkpoint's other identities (its folder, hub id, hub id@revision)
    vocab_size: int = 0  # V, rows of the embedding table and the head (0: unknown, no vocabulary module can be served)
    tie_word_embeddings: bool = False  # the head's weight is the embedding table
    fused_projections: bool = False  # the model's modules are qkv_proj and gate_up_proj (Phi-3), not their parts

    def __post_init__(self) -> None:
        for field in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"BaseModelSpec.{field} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})")

    @classmethod
    def from_hf_config(cls, config: dict[str, Any] | str | Path, name: str | None = None) -> BaseModelSpec:
        """Read the shape from an HF Llama `config.json` (a dict, the file, or the folder that holds it)."""
        if not isinstance(config, dict):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            config = json.loads(path.read_text())
        num_heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        return cls(
            name=name or config.get("_name_or_path") or "",
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or hidden // num_heads,
            vocab_size=config.get("vocab_size") or 0,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    @classmethod
    def bench(cls) -> BaseModelSpec:
        """The benchmark model: hidden 1024, 8 layers, 16 heads, 4 KV heads, intermediate 2816, vocab 32000."""
        return cls("adapter-manager/bench-llama", 1024, 2816, 8, 16, 4, 64, vocab_size=32000)

    @property
    def identities(self) -> tuple[str, ...]:
        """Every name an adapter's ``base_model_name_or_path`` may give the served model by: its name, then its
        aliases (empty ones left out)."""
        return tuple(dict.fromkeys(n for n in (self.name, *self.aliases) if n))

    def projection_shape(self, proj: str) -> tuple[int, int]:
        """(in_features, out_features) of one projection; of a vocabulary module its LoRA's: embed_tokens (V, H)
        (PEFT's ``lora_embedding_A [r, V]``, ``lora_embedding_B [H, r]``), lm_head (H, V)."""
        q_width = self.num_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        shapes = {
            "q_proj": (self.hidden_size, q_width),
            "k_proj": (self.hidden_size, kv_width),
            "v_proj": (self.hidden_size, kv_width),
            "o_proj": (q_width, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
            "embed_tokens": (self.vocab_size, self.hidden_size),
            "lm_head": (self.hidden_size, self.vocab_size),
        }
        return shapes[proj]

    def module_keys(self) -> list[ModuleKey]:
        """Every LoRA-able linear, layer-major."""
        return [ModuleKey(layer, proj) for layer in range(self.num_layers) for proj in PROJECTIONS]

    def vocab_keys(self) -> list[ModuleKey]:
        """The vocabulary modules' keys (embed_tokens, lm_head)."""
        return [ModuleKey.vocab(name) for name in VOCAB_MODULES]

    def module_names(self) -> list[str]:
        """Names of all modules of HF `LlamaForCausalLM` (as `named_modules()` lists them), for target matching."""
        names = ["", "model", "model.embed_tokens", "model.layers"]
        for layer in range(self.num_layers):
            prefix = f"model.layers.{layer}"
            names += [prefix, f"{prefix}.self_attn"]
            attention, mlp = PROJECTIONS[:4], PROJECTIONS[4:]
            if self.fused_projections:
                attention, mlp = ("qkv_proj", "o_proj"), ("gate_up_proj", "down_proj")
            names += [f"{prefix}.self_attn.{p}" for p in attention]
            names += [f"{prefix}.mlp"] + [f"{prefix}.mlp.{p}" for p in mlp]
            names += [f"{prefix}.mlp.act_fn", f"{prefix}.input_layernorm", f"{prefix}.post_attention_layernorm"]
        return names + ["model.norm", "model.rotary_emb", "lm_head"]

    def fused_parts(self, name: str) -> tuple[ModuleKey, ...]:
        """The projections a fused module ``name`` (``model.layers.3.self_attn.qkv_proj``) holds, in order; () for
        any other name or where the model does not fuse."""
        parts = name.split(".")
        if not self.fused_projections or len(parts) != 5 or parts[-1] not in FUSED_PROJECTIONS:
            return ()
        return tuple(ModuleKey(int(parts[2]), proj) for proj in FUSED_PROJECTIONS[parts[-1]])

    def max_adapter_bytes(self, max_rank: int, element_size: int) -> int:
        """Bytes of a prepared adapter that targets every projection of every layer at max_rank."""
        per_layer = sum(sum(self.projection_shape(p)) for p in PROJECTIONS)
        return self.num_layers * per_layer * max_rank * element_size
