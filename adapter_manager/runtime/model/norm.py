"""RMSNorm, as HF Llama computes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 and cast back before the weight (as HF Llama)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Semantics: ``w · (x / sqrt(mean(x²) + eps))``. Shape: x [T, H]; returns [T, H]."""
        if x.dtype == torch.float32 and x.device.type != "xla":  # fp32: the same math as one fused op
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
