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

    The step's executor runs it (:meth:`kernels.executor.LinearExecutor.vectors`). Eager backends write y in place
    and return it, per group of adjacent parts (`LinearLoRA.vector_groups`): a gather of each token's row, or, where
    the step's runs of variant tokens are few (one, or 16 tokens a run and more), the run's one row broadcast over it
    (no ``[T, out]`` gather; tokens of other adapters untouched). Both do the same arithmetic per element, a multiply
    then an add (two roundings, never a fused multiply-add), so a token's result does not depend on which is taken
    (the deterministic mode relies on it). Traced backends return a new tensor (static shapes, no in-place update), a
    gather per part. Shape: y [T, sum(out)]; returns [T, sum(out)].
    """
    if meta.bias_index is None and meta.scale_index is None:
        return y
    return meta.executor.vectors(y, lora, meta)


def eager_vectors(y: torch.Tensor, lora: LinearLoRA, meta: LoRAKernelMeta) -> torch.Tensor:
    """:func:`apply_vectors` on an eager step: y written in place."""
    bias, scale = meta.bias_index, meta.scale_index
    if bias is None and scale is None:
        return y
    runs = meta.vector_runs
    if runs is not None and (len(runs) == 1 or y.shape[0] >= 16 * len(runs)):
        for start, count, slot, kind in runs:
            for columns, vectors in lora.vector_groups:
                piece, row = y[start : start + count, columns], vectors[slot]  # [count, cols], [cols]
                if kind == "bias":
                    piece.add_(row)
                else:
                    piece.add_(piece * row)
        return y
    for columns, vectors in lora.vector_groups:
        piece = y[:, columns]
        if bias is not None:
            piece.add_(vectors.index_select(0, bias))  # [T, cols]
        if scale is not None:
            piece.add_(vectors.index_select(0, scale).mul_(piece))
    return y


def gathered_vectors(y: torch.Tensor, lora: LinearLoRA, meta: LoRAKernelMeta) -> torch.Tensor:
    """:func:`apply_vectors` on a traced step: a gather per part, a new tensor."""
    bias, scale = meta.bias_index, meta.scale_index
    pieces = list(y.split(lora.out_features, dim=-1)) if len(lora.out_features) > 1 else [y]
    for index, stacks in enumerate(lora.parts):
        vectors = None if stacks is None else stacks.vector  # [S + 1, out_p]
        if vectors is None:
            continue
        piece = pieces[index]
        if bias is not None:
            piece = piece + vectors.index_select(0, bias)  # [T, out_p]
        if scale is not None:
            piece = piece + piece * vectors.index_select(0, scale)
        pieces[index] = piece
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
