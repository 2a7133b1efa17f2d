"""The row layout shared by prepared adapters and the slot pool: one rank row of an adapter holds every module.

Row ``i`` of an adapter is one flat run of ``width`` elements: for each layer, the i-th row of ``A`` of every
projection, then the i-th row of ``Bt`` of every projection (projections in `PROJECTIONS` order, so the parts of a
fused base linear — q/k/v, gate/up — sit side by side)::

    row i = [ L0: A_q[i] A_k[i] A_v[i] A_o[i] A_gate[i] A_up[i] A_down[i]  Bt_q[i] Bt_k[i] ... Bt_down[i] | L1: ... ]

An adapter of rank r is an ``[r, width]`` block: it moves host -> slot as ONE contiguous copy, its memory is
proportional to its own rank, and each module's weights are strided views of it (row stride ``width``, inner stride
1): ``A = block[:, a_start : a_start + in]`` (Shape: [r, in]) and ``Bt = block[:, bt_start : bt_start + out]``
(Shape: [r, out]). The slot pool is the same layout with N rows: the rows of all resident adapters, one range each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..base_model import PROJECTIONS, BaseModelSpec, ModuleKey


@dataclass(frozen=True)
class ModuleColumns:
    """Where one module's A and Bt rows lie inside a row."""

    a_start: int
    in_features: int
    bt_start: int
    out_features: int


@dataclass(frozen=True)
class RowLayout:
    """Column ranges of every module in one row; build it with :meth:`of`."""

    columns: Mapping[ModuleKey, ModuleColumns]
    width: int  # elements of one row: sum over modules of (in + out)

    @classmethod
    def of(cls, spec: BaseModelSpec) -> RowLayout:
        columns: dict[ModuleKey, ModuleColumns] = {}
        offset = 0
        for layer in range(spec.num_layers):
            shapes = [spec.projection_shape(proj) for proj in PROJECTIONS]
            a_starts, bt_starts = [], []
            for fan_in, _ in shapes:
                a_starts.append(offset)
                offset += fan_in
            for _, fan_out in shapes:
                bt_starts.append(offset)
                offset += fan_out
            for i, proj in enumerate(PROJECTIONS):
                columns[ModuleKey(layer, proj)] = ModuleColumns(a_starts[i], shapes[i][0], bt_starts[i], shapes[i][1])
        return cls(columns, offset)

    def a_view(self, rows: torch.Tensor, key: ModuleKey) -> torch.Tensor:
        """Module ``key``'s A rows of a ``[n, width]`` tensor. Shape: [n, in], a strided view."""
        c = self.columns[key]
        return rows[:, c.a_start : c.a_start + c.in_features]

    def bt_view(self, rows: torch.Tensor, key: ModuleKey) -> torch.Tensor:
        """Module ``key``'s Bt rows of a ``[n, width]`` tensor. Shape: [n, out], a strided view."""
        c = self.columns[key]
        return rows[:, c.bt_start : c.bt_start + c.out_features]

    def row_bytes(self, dtype: torch.dtype) -> int:
        return self.width * dtype.itemsize
