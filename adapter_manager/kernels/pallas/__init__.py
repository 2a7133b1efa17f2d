"""The Pallas backend's room (TPU): the backend (``kernels.pallas.backend``: torch_xla, reached through
:func:`kernels.select_backend`), its kernels and work schedule (``kernels.pallas.kernels``, ``schedule``: JAX) and
their block-size table, which this face exports (no JAX import)."""

from adapter_manager.kernels.pallas.block_sizes import BlockSizeEntry, BlockSizes, BlockSizeTable

__all__ = ["BlockSizeEntry", "BlockSizeTable", "BlockSizes"]
