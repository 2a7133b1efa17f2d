"""RMSNorm, as HF Llama computes it."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm's parameters (``w · (x / sqrt(mean(x²) + eps))``, as HF Llama computes it): the step
    applies it through its decode glue, ``DecodeOps.add_rms_norm`` (:mod:`kernels.layer_reference` for its math)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
