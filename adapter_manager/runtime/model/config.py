"""The model configuration: the Llama block and the terms each served family adds to it (:mod:`.families`), read
from a Hugging Face ``config.json`` (and written as Llama's)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from adapter_manager import BaseModelSpec

from .families import read_config

_ROPE_TYPES = ("default", "llama3")
_ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling; ``rope_type="llama3"`` is Llama 3.1's smooth long-context interpolation."""

    rope_type: str = "default"
    """"default" (plain RoPE) or "llama3"."""
    factor: float = 8.0
    """Llama 3: low frequencies are divided by this."""
    low_freq_factor: float = 1.0
    """Llama 3: wavelengths above original_max_position_embeddings / this are fully scaled."""
    high_freq_factor: float = 4.0
    """Llama 3: wavelengths below original_max_position_embeddings / this are left alone."""
    original_max_position_embeddings: int = 8192
    """Llama 3: the context length of pre-training."""

    def __post_init__(self) -> None:
        if self.rope_type not in _ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {_ROPE_TYPES}, got {self.rope_type!r}")
        if self.rope_type == "llama3":
            if self.factor <= 0 or self.original_max_position_embeddings <= 0:
                raise ValueError(
                    f"llama3 rope scaling needs factor > 0 and original_max_position_embeddings > 0, got "
                    f"factor={self.factor}, original_max_position_embeddings={self.original_max_position_embeddings}"
                )
            if not 0 < self.low_freq_factor < self.high_freq_factor:
                raise ValueError(
                    f"llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, got "
                    f"low_freq_factor={self.low_freq_factor}, high_freq_factor={self.high_freq_factor}"
                )

    def to_hf(self) -> dict[str, Any] | None:
        """The ``rope_scaling`` entry of an HF config.json; None for plain RoPE."""
        return None if self.rope_type == "default" else asdict(self)


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and numerics of a Llama-family model (the fields of its HF ``config.json`` that the forward uses)."""

    hidden_size: int = 32
    """H, the residual stream width."""
    intermediate_size: int = 48
    """Width of the SwiGLU MLP."""
    num_layers: int = 2
    """L, number of decoder blocks."""
    num_heads: int = 4
    """Query heads."""
    num_kv_heads: int = 2
    """Key/value heads (GQA); divides num_heads."""
    head_dim: int = 0
    """Width of one head; 0 means hidden_size // num_heads."""
    vocab_size: int = 512
    """Embedding rows and logits width."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base wavelength."""
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    """RoPE frequency scaling (plain or Llama 3)."""
    tie_word_embeddings: bool = False
    """lm_head shares the embedding matrix."""
    max_position_embeddings: int = 2048
    """Longest context the model was built for (an upper bound for setup_caches' max_seq_len)."""
    bos_token_id: int | None = 1
    """Beginning-of-sequence token, if any."""
    eos_token_ids: tuple[int, ...] = (2,)
    """End-of-sequence tokens (HF allows one id or a list); the engine stops a request at any of them by default."""
    model_type: str = "llama"
    """The served family (:data:`families.FAMILIES`); the fields below are the terms it adds to the Llama block."""
    hidden_act: str = "silu"
    """The MLP's gated activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)."""
    bias: tuple[str, ...] = ()
    """The projections with a base bias (Qwen2: q/k/v; Llama's attention_bias: q/k/v/o)."""
    qk_norm: bool = False
    """An RMSNorm over each head of q and of k before RoPE (Qwen3)."""
    norm_offset: float = 0.0
    """Added to every RMSNorm weight at load: Gemma's ``(1 + w)`` norms."""
    scale_embeddings: bool = False
    """The embedding (with its LoRA) times √hidden, rounded to the dtype (Gemma)."""
    sandwich_norms: bool = False
    """RMSNorms on the attention's and the MLP's outputs too, before each residual add (Gemma 2)."""
    query_pre_attn_scalar: float | None = None
    """Attention scores scaled by this ** -0.5 instead of head_dim ** -0.5 (Gemma 2)."""
    attn_logit_softcapping: float | None = None
    """Attention scores soft-capped: ``c · tanh(s / c)`` (Gemma 2)."""
    final_logit_softcapping: float | None = None
    """Logits soft-capped: ``c · tanh(l / c)`` (Gemma 2)."""
    sliding_window: int | None = None
    """The shortest sliding window of any layer; served only where every context fits it (`Llama.setup_caches`)."""
    fused_projections: bool = False
    """The checkpoint holds q|k|v as ``qkv_proj`` and gate|up as ``gate_up_proj`` (Phi-3)."""
    local_rope_theta: float | None = None
    """The RoPE base of the ``local_layers`` (Gemma 3's sliding layers); None: every layer uses ``rope_theta``."""
    local_layers: tuple[int, ...] = ()
    """The layers that rotate by ``local_rope_theta`` (plain RoPE)."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not a multiple of num_heads ({self.num_heads}); set head_dim"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim < 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even int, got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(f"rms_norm_eps ({self.rms_norm_eps}) and rope_theta ({self.rope_theta}) must be > 0")
        if self.max_position_embeddings <= 0:
            raise ValueError(f"max_position_embeddings must be positive, got {self.max_position_embeddings}")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {_ACTIVATIONS}, got {self.hidden_act!r}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "sliding_window"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"LlamaConfig.{name} must be positive or None, got {value!r}")

    @classmethod
    def tiny(cls) -> LlamaConfig:
        """A few-KiB model for tests and demos; vocab 512 leaves room for the byte tokenizer's 256 bytes + specials."""
        return cls(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512)

    @classmethod
    def bench(cls) -> LlamaConfig:
        """The benchmark model: hidden 1024, 8 layers, 16 heads, 4 KV heads, intermediate 2816, vocab 32000."""
        return cls(
            hidden_size=1024,
            intermediate_size=2816,
            num_layers=8,
            num_heads=16,
            num_kv_heads=4,
            vocab_size=32000,
            rms_norm_eps=1e-5,
            max_position_embeddings=4096,
        )

    @classmethod
    def from_hf(cls, config: dict[str, Any] | str | Path) -> LlamaConfig:
        """Read an HF ``config.json`` (a dict, the file, or its folder) of a served family (:mod:`.families`: by
        ``model_type``); any other architecture, or a field whose value we do not compute, raises
        :class:`families.UnsupportedModelError` naming both.

        Both the legacy layout (``rope_theta`` + ``rope_scaling``) and transformers 5's ``rope_parameters`` are read.
        """
        if not isinstance(config, dict):
            path = Path(config)
            config = json.loads((path / "config.json" if path.is_dir() else path).read_text())
        fields = read_config(config)
        rope = fields.pop("rope_scaling")
        known = RopeScaling.__dataclass_fields__
        fields["rope_scaling"] = RopeScaling(**{k: v for k, v in rope.items() if k in known})
        fields["eos_token_ids"] = eos_ids(fields.pop("eos_token_id"))
        fields["bias"] = tuple(fields.get("bias", ()))
        fields["local_layers"] = tuple(fields.get("local_layers", ()))
        return cls(**fields)

    def to_hf(self) -> dict[str, Any]:
        """An HF ``config.json`` dict for ``LlamaForCausalLM`` (legacy rope layout, read by transformers 4 and 5); the
        other families' checkpoints are written by transformers itself."""
        if self.model_type != "llama" or self.hidden_act != "silu":
            raise ValueError(f"to_hf writes Llama configs, this one is {self.model_type} ({self.hidden_act})")
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.to_hf(),
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids),
            "hidden_act": "silu",
            "attention_bias": "q_proj" in self.bias,
            "mlp_bias": "down_proj" in self.bias,
        }

    def to_spec(self, name: str = "", aliases: tuple[str, ...] = ()) -> BaseModelSpec:
        """The shape adapters see (for the registry and the slot pool); ``name`` and ``aliases`` are what an
        adapter's base model is checked against."""
        return BaseModelSpec(
            name=name,
            aliases=aliases,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            tie_word_embeddings=self.tie_word_embeddings,
            fused_projections=self.fused_projections,
        )


def eos_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """An HF ``eos_token_id`` (one id, a list, or absent) as a tuple."""
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)
