"""CUDA's layer kernels: the torch forms plus the Triton paged decode attention (:mod:`kernels.triton.attention`)."""

from __future__ import annotations

import torch

from adapter_manager.kernels.device_kernels import LayerKernels


class CudaLayerKernels(LayerKernels):
    """CUDA: the torch forms plus the Triton paged decode attention, built on first use (None without triton)."""

    def __init__(self, deterministic: bool = False) -> None:
        super().__init__(deterministic)
        self._paged = None  # kernels.triton.attention.PagedAttention once built; False: triton is missing

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: torch.Tensor,
        rows: torch.Tensor | None,
        positions: torch.Tensor,
    ) -> torch.Tensor | None:
        """Semantics: :meth:`LayerKernels.paged_attention`, the Triton kernel."""
        if self._paged is None:
            try:
                from adapter_manager.kernels.triton.attention import PagedAttention

                self._paged = PagedAttention()
            except ImportError:
                self._paged = False
        if self._paged is False:
            return None
        rows = torch.arange(q.shape[0], device=q.device) if rows is None else rows
        q = q if q.stride(2) == 1 else q.contiguous()
        tables = tables if tables.stride(1) == 1 else tables.contiguous()
        return self._paged(q, k_cache, v_cache, tables, rows, positions)
