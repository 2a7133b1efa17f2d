"""The per-output vector of a LoRA variant, prepared once on the host: LoRA's bias, DoRA's scale.

PEFT's forward of a targeted module, restated (s = scaling, W the base weight ``[out, in]``)::

    lora_bias:  y = W x + s · (B A x + b)
    DoRA:       y = W x + (g - 1) ⊙ W x + g ⊙ s · B A x = g ⊙ (W x + s · B A x),  g = m / ‖W + s · B A‖_row

(``‖·‖_row`` the norm of each output row, a constant at inference.) So a module's whole LoRA is the plain one plus an
epilogue on its output, per token with the token's adapter::

    y += bias_vector            # bias_vector = s · b
    y += y ⊙ dora_vector        # dora_vector = g - 1, 0 where the module has no DoRA: a zero vector is the identity

The vector is prepared in the serving dtype beside the adapter's block (`prepare.PreparedAdapter.vector`) and held
in the pool's vector row of the adapter's slot. DoRA's needs the base weight: ``base_weight(key)`` gives it as
served (`[out, in]`, any float dtype, on its device), and the row norms are taken there in fp32, a chunk of rows at
a time, so no ``[out, in]`` temporary of the whole module is made.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..base_model import ModuleKey

BaseWeight = Callable[[ModuleKey], torch.Tensor]
"""The base model's weight of one module as served: Shape: [out, in]."""

_NORM_CHUNK = 1024  # output rows per chunk of ``W + s · B A``


def bias_vector(bias: torch.Tensor, scaling: float) -> torch.Tensor:
    """``s · b``, fp32. Shape: bias [out]; returns [out]."""
    return bias.to(torch.float32) * scaling


def dora_vector(magnitude: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``m / ‖W + Btᵀ A‖_row - 1``, fp32, on the host; ``bt`` already holds the scaling (``(s · B)ᵀ``).

    Shape: magnitude [out], a [r, in], bt [r, out], weight [out, in]; returns [out]."""
    device = weight.device
    a32 = a.to(device, torch.float32)
    b32 = bt.to(device, torch.float32).t()  # [out, r]
    norms = torch.empty(weight.shape[0], dtype=torch.float32, device=device)
    for start in range(0, weight.shape[0], _NORM_CHUNK):
        stop = min(start + _NORM_CHUNK, weight.shape[0])
        rows = weight[start:stop].to(torch.float32) + b32[start:stop] @ a32  # [chunk, in]
        norms[start:stop] = torch.linalg.vector_norm(rows, dim=1)
    return magnitude.to(torch.float32) / norms.cpu() - 1
