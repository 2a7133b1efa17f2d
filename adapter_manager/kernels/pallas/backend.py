"""The Pallas backend on torch_xla: the compact active table gathered in torch, then the JAX Pallas kernels called
inside the torch_xla graph via ``call_jax`` with the compact ids as their slots (A plays S)."""

from __future__ import annotations

import torch
from torch_xla.core.xla_builder import call_jax

from adapter_manager.kernels.config import PallasInterpret
from adapter_manager.kernels.executor import TracedExecutor
from adapter_manager.kernels.meta import LoRAKernelMeta
from adapter_manager.kernels.pallas.block_sizes import BlockSizeTable
from adapter_manager.kernels.pallas.kernels import lora_expand, lora_shrink


def _table(rows: torch.Tensor, meta: LoRAKernelMeta) -> torch.Tensor:
    """[N, F] pool -> [A, R, F]: the active adapters' rows, zero rows past each rank and for padding slots."""
    _, gather_rows, _ = meta.args()
    return rows.index_select(0, gather_rows).view(meta.active_width, meta.rank, rows.shape[1])


class PallasBackend:
    """Laned h ``[T, A·R]``; expand returns a new tensor. Block sizes come from the table, keyed by op and shape."""

    traced = True
    laned_output = True
    executor_type = TracedExecutor
    per_shard = True  # GSPMD cannot partition the kernels: a sharded linear calls them per shard (`kernels.sharded`)

    def __init__(self, table: BlockSizeTable, *, interpret: PallasInterpret) -> None:
        self._table = table
        self._interpret = interpret

    def shrink(self, x: torch.Tensor, a_rows: torch.Tensor, meta: LoRAKernelMeta) -> torch.Tensor:
        """Semantics: :func:`kernels.pallas.kernels.lora_shrink` on ``a_rows[gather_rows]`` viewed [A, R, in], slots
        ``token_compact``.

        Shape: x [T, in], a_rows [N, in] -> h [T, A·R], new tensor.
        """
        token_compact, _, _ = meta.args()
        blocks = self._table.lookup("shrink", x.shape[0], x.shape[1])
        kwargs = {"blocks": blocks, "interpret": self._interpret}
        return call_jax(lora_shrink, (x, _table(a_rows, meta), token_compact), kwargs)

    def shrink_parts(self, x: torch.Tensor, a_parts: torch.Tensor, meta: LoRAKernelMeta) -> torch.Tensor:
        """Semantics: ``h[p] = shrink(x, a_parts[:, p])`` for every part p, one Pallas shrink per part.

        Shape: x [T, in], a_parts [N, P, in] -> h [P, T, A·R], new tensor.
        """
        return torch.stack([self.shrink(x, a_parts[:, part], meta) for part in range(a_parts.shape[1])])

    def expand(
        self, y: torch.Tensor, h: torch.Tensor, bt_rows: torch.Tensor, meta: LoRAKernelMeta, accumulate: bool = True
    ) -> torch.Tensor:
        """Semantics: :func:`kernels.pallas.kernels.lora_expand` on ``bt_rows[gather_rows]`` viewed [A, R, out], slots
        ``token_compact`` (on zeros when ``accumulate=False``).

        Shape: y [T, out], h [T, A·R], bt_rows [N, out] -> y_new [T, out], a new tensor (y is not written).
        """
        token_compact, _, _ = meta.args()
        blocks = self._table.lookup("expand", y.shape[0], y.shape[1])
        kwargs = {"blocks": blocks, "interpret": self._interpret}
        base = y if accumulate else torch.zeros_like(y)
        return call_jax(lora_expand, (base, h, _table(bt_rows, meta), token_compact), kwargs)
