"""Rotary position embeddings: plain RoPE and Llama 3's frequency scaling, in HF's rotate-half layout."""

from __future__ import annotations

import math

import torch

from .config import LlamaConfig


def inv_frequencies(config: LlamaConfig) -> torch.Tensor:
    """The per-pair inverse frequencies, fp32, as HF computes them.

    Semantics::

        inv[i] = 1 / theta ** (2i / D)                           for i in [0, D/2)
        llama3: wavelen = 2π / inv[i]
                wavelen > orig / low_freq_factor   -> inv[i] / factor
                wavelen < orig / high_freq_factor  -> inv[i]
                otherwise s = (orig / wavelen - low) / (high - low), (1 - s) · inv[i] / factor + s · inv[i]

    Shape: returns [D/2].
    """
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [D/2]
    scaling = config.rope_scaling
    if scaling.rope_type == "default":
        return inv
    orig = scaling.original_max_position_embeddings
    low_wavelen = orig / scaling.low_freq_factor
    high_wavelen = orig / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (orig / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_table(config: LlamaConfig, max_seq_len: int, device: torch.device | str) -> torch.Tensor:
    """cos and sin of every position up to ``max_seq_len``, fp32.

    Shape: returns [max_seq_len, 2, D/2]: ``[:, 0]`` cos, ``[:, 1]`` sin.
    """
    inv = inv_frequencies(config)  # [D/2]
    angles = torch.arange(max_seq_len, dtype=torch.float32)[:, None] * inv[None, :]  # [P, D/2]
    return torch.stack([angles.cos(), angles.sin()], dim=1).to(device)  # [P, 2, D/2]


def rope_factors(table: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's cos and sin, cast to the model's dtype first as HF does: made once per step, used by every layer.

    Shape: table [T, 2, D/2] (the rope table gathered at the tokens' positions); returns cos, sin [T, 1, D/2].
    """
    return table[:, None, 0].to(dtype), table[:, None, 1].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head of each token by its position's angles (HF's rotate_half pairing: i with i + D/2).

    Semantics::

        x1, x2 = x[..., :D/2], x[..., D/2:]
        out = cat(x1·cos - x2·sin, x2·cos + x1·sin)

    Shape: x [T, heads, D] (any strides); cos, sin [T, 1, D/2] from :func:`rope_factors`. Returns a new tensor in
    x's dtype.
    """
    x1, x2 = x.chunk(2, dim=-1)  # [T, heads, D/2] each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
