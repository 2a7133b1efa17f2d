"""The triton backend's room (CUDA): the backend (``kernels.triton.backend``, reached through
:func:`kernels.select_backend`), its BGMV / SGMV kernels (``kernels.triton.kernels``; both import triton) and their
block-size table, which this face exports (no triton import)."""

from adapter_manager.kernels.triton.block_sizes import OPS, TritonBlockEntry, TritonBlocks, TritonBlockTable

__all__ = ["OPS", "TritonBlockEntry", "TritonBlockTable", "TritonBlocks"]
