"""The vector epilogue: a LoRA variant's per-output vector applied to a linear's output, per token (DoRA, LoRA bias).

Each slot of the pool has a vector row (`adapter_manager.tiers.row_layout`); a part's vectors are ``V [S + 1, out]``,
the last row zero. The step's metadata names, per token, the row it adds (``bias_index``: LoRA's ``s · b``) and the
row it scales by (``scale_index``: DoRA's ``g - 1``); a token whose adapter has neither reads the zero row, which is
the identity of both. Run after the linear's base matmul and LoRA, it makes every variant exact::

    lora_bias: (W x + s B A x) + s b
    DoRA:      (W x + s B A x) + (W x + s B A x) ⊙ (g - 1) = g ⊙ (W x + s B A x)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from adapter_manager.kernels.linear_lora import LinearLoRA
    from adapter_manager.kernels.meta import LoRAKernelMeta


def apply_vectors(y: torch.Tensor, lora: LinearLoRA, meta: LoRAKernelMeta) -> torch.Tensor:
    """Semantics::

        for each part p (columns c_p of y) whose rows have vectors V_p [S + 1, out_p]:
            y[:, c_p] += V_p[bias_index]                  # skipped when bias_index is None
            y[:, c_p] += y[:, c_p] ⊙ V_p[scale_index]     # skipped when scale_index is None

    Eager backends write y in place and return it; traced ones return a new tensor (static shapes, no in-place
    update). Shape: y [T, sum(out)]; returns [T, sum(out)].
    """
    bias, scale = meta.bias_index, meta.scale_index
    if bias is None and scale is None:
        return y
    traced = meta.backend.traced
    pieces = list(y.split(lora.out_features, dim=-1)) if len(lora.out_features) > 1 else [y]
    for index, stacks in enumerate(lora.parts):
        vectors = None if stacks is None else stacks.vector  # [S + 1, out_p]
        if vectors is None:
            continue
        piece = pieces[index]
        if bias is not None:
            added = vectors.index_select(0, bias)  # [T, out_p]
            piece = piece + added if traced else piece.add_(added)
        if scale is not None:
            factor = vectors.index_select(0, scale)  # [T, out_p]
            piece = piece + piece * factor if traced else piece.addcmul_(piece, factor)
        pieces[index] = piece
    if not traced:
        return y
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
