"""Weight-only int8 (:class:`kernels.protocol.WeightLayout` INT8): the scheme and its torch forms, for every device.

Symmetric, one scale per output row: ``s[n] = max|W[n]| / 127`` rounded to the serving dtype, ``q = round(W / s)`` in
[-127, 127] (an all-zero row: s = 1, q = 0); the weight stands for ``W = q · s[:, None]`` and every int8 matmul
computes ``x @ W.T`` for it. The CPU room reads q in its own layouts (:mod:`kernels.cpu.weights`); elsewhere (XLA,
CUDA) :func:`int8_matmul` dequantizes inside the matmul.
"""

from __future__ import annotations

import torch


def quantize_int8(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)`` of ``w`` [out, in] by the scheme above (computed in fp32, on w's device): q [out, in] int8,
    scales [out] in ``scale_dtype`` (rounded before q is computed, so ``q · scales`` is exactly the weight meant)."""
    w32 = w.detach().float()
    scales = (w32.abs().amax(dim=1) / 127).to(scale_dtype)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w32 / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``q · scales[:, None]`` in the scales' dtype (computed in fp32). Shape: q [out, in]; returns [out, in]."""
    return (q.float() * scales.float()[:, None]).to(scales.dtype)


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Semantics: ``x @ (q · scales[:, None]).T`` in x's dtype, the weight dequantized inside the matmul (XLA fuses
    the conversion into the dot, static shapes; CUDA materialises the dequantized weight at each call). Shape:
    x [T, in]; q [out, in]; returns a new [T, out]."""
    return x @ (q.to(x.dtype) * scales.to(x.dtype)[:, None]).t()
