"""The fp32 loop reference of shrink and expand: slow, obvious, the oracle every backend is tested against."""

from __future__ import annotations

import torch

from adapter_manager.kernels.config import LoRAForm
from adapter_manager.kernels.eager_base import EagerBase
from adapter_manager.kernels.meta import LoRAKernelMeta


class ReferenceBackend(EagerBase):
    """Per-token Python loops in float32 over each token's pool rows; results are cast back to the inputs' dtype."""

    def choose_form(self, num_tokens: int, active_slots: int, rank: int, runs: int) -> LoRAForm:
        return LoRAForm.SINGLE if active_slots == 1 else LoRAForm.SEGMENTS  # the loops read only the rows below

    @staticmethod
    def _rows(meta: LoRAKernelMeta) -> list[slice | None]:
        """Per token: its adapter's pool rows ``[s·G, s·G + r_s)``, or None for slot -1."""
        assert meta.token_slots is not None
        adapters = {a.slot: a for a in meta.active_adapters}
        return [adapters[s].rows if s >= 0 else None for s in meta.token_slots.tolist()]

    def shrink(self, x: torch.Tensor, a_rows: torch.Tensor, meta: LoRAKernelMeta) -> torch.Tensor:
        """Semantics::

            for t in range(T):
                h[t] = 0
                if slot[t] >= 0:
                    r = r_{slot[t]}
                    h[t, :r] = a_rows[slot[t]·G : slot[t]·G + r] @ x[t]

        Shape: x [T, in], a_rows [N, in] -> h [T, R], new tensor.
        """
        h = torch.zeros(x.shape[0], meta.rank, dtype=torch.float32, device=x.device)
        for t, rows in enumerate(self._rows(meta)):
            if rows is not None:
                h[t, : rows.stop - rows.start] = a_rows[rows].float() @ x[t].float()
        return h.to(x.dtype)

    def shrink_parts(self, x: torch.Tensor, a_parts: torch.Tensor, meta: LoRAKernelMeta) -> torch.Tensor:
        """Semantics::

            for p in range(P):
                h[p] = shrink(x, a_parts[:, p])      # the loops above, part by part

        Shape: x [T, in], a_parts [N, P, in] -> h [P, T, R], new tensor.
        """
        return torch.stack([self.shrink(x, a_parts[:, part], meta) for part in range(a_parts.shape[1])])

    def expand(
        self, y: torch.Tensor, h: torch.Tensor, bt_rows: torch.Tensor, meta: LoRAKernelMeta, accumulate: bool = True
    ) -> torch.Tensor:
        """Semantics::

            if not accumulate: y[:] = 0
            for t in range(T):
                if slot[t] >= 0:
                    r = r_{slot[t]}
                    y[t] += h[t, :r] @ bt_rows[slot[t]·G : slot[t]·G + r]

        Shape: y [T, out] (updated in place and returned), h [T, R], bt_rows [N, out].
        """
        if not accumulate:
            y.zero_()
        for t, rows in enumerate(self._rows(meta)):
            if rows is not None:
                r = rows.stop - rows.start
                y[t] = (y[t].float() + h[t, :r].float() @ bt_rows[rows].float()).to(y.dtype)
        return y


def vector_epilogue(
    y: torch.Tensor, start: int, vectors: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None
) -> None:
    """The vector epilogue's loop reference (csrc/vector_epilogue.cpp's signature), in fp32, in place::

        for t in range(T):
            v = y[t, start : start + C]                                  # C = vectors.shape[1]
            if bias is not None:  v += vectors[bias[t]]
            if scale is not None: v += v * vectors[scale[t]]

    Shape: y [T, out], vectors [S + 1, C], bias and scale [T] int64."""
    columns = slice(start, start + vectors.shape[1])
    for t in range(y.shape[0]):
        value = y[t, columns].float()
        if bias is not None:
            value = value + vectors[int(bias[t])].float()
        if scale is not None:
            value = value + value * vectors[int(scale[t])].float()
        y[t, columns] = value.to(y.dtype)
