"""The Pallas backend on torch_xla: the JAX Pallas kernels called inside the torch_xla graph via ``call_jax``."""

from __future__ import annotations

import torch
from torch_xla.core.xla_builder import call_jax

from kernels.block_sizes import BlockSizeTable
from kernels.config import PallasInterpret
from kernels.meta import LoRAKernelMeta
from kernels.pallas_kernels import lora_expand, lora_shrink


class PallasBackend:
    """Laned h ``[T, S·R]``; expand returns a new tensor. Block sizes come from the table, keyed by op and shape."""

    traced = True
    laned_output = True

    def __init__(self, table: BlockSizeTable, *, interpret: PallasInterpret) -> None:
        self._table = table
        self._interpret = interpret

    def shrink(self, x: torch.Tensor, a_stack: torch.Tensor, meta: LoRAKernelMeta) -> torch.Tensor:
        """Semantics: as :func:`kernels.pallas_kernels.lora_shrink`.

        Shape: x [T, in], a_stack [S, R, in] -> h [T, S·R], new tensor.
        """
        blocks = self._table.lookup("shrink", x.shape[0], x.shape[1])
        kwargs = {"blocks": blocks, "interpret": self._interpret}
        return call_jax(lora_shrink, (x, a_stack, meta.token_slots), kwargs)

    def expand(
        self, y: torch.Tensor, h: torch.Tensor, bt_stack: torch.Tensor, meta: LoRAKernelMeta, accumulate: bool = True
    ) -> torch.Tensor:
        """Semantics: as :func:`kernels.pallas_kernels.lora_expand` (on zeros when ``accumulate=False``).

        Shape: y [T, out], h [T, S·R], bt_stack [S, R, out] -> y_new [T, out], a new tensor (y is not written).
        """
        blocks = self._table.lookup("expand", y.shape[0], y.shape[1])
        kwargs = {"blocks": blocks, "interpret": self._interpret}
        base = y if accumulate else torch.zeros_like(y)
        return call_jax(lora_expand, (base, h, bt_stack, meta.token_slots), kwargs)
