"""The laned form over the compact active table: one dense matmul per op, masked to each token's compact slot.

The A·R active rows are gathered from the row pool (``index_select`` with ``meta.gather_rows``), so the cost follows
the active bucket A, never the pool size. Static shapes given (T, A), no data-dependent Python branching: what XLA
(and the TPU MXU) wants. Runs on any torch device; on the torch_xla device it traces into the step's graph.
"""

from __future__ import annotations

import torch

from adapter_manager.kernels.executor import TracedExecutor
from adapter_manager.kernels.meta import LoRAKernelMeta


def _masked(h: torch.Tensor, meta: LoRAKernelMeta) -> torch.Tensor:
    """h with every lane outside the token's own compact slot set to zero (a -1 token's row is all zero)."""
    token_compact, _, lane_owner = meta.args()
    mask = token_compact[:, None] == lane_owner[None, :]  # [T, A·R]
    return torch.where(mask, h, torch.zeros((), dtype=h.dtype, device=h.device))


class XlaLanedBackend:
    """Laned shrink/expand; h is ``[T, A·R]`` with zeros outside each token's own compact slot's lanes."""

    traced = True
    laned_output = True
    executor_type = TracedExecutor

    def shrink(self, x: torch.Tensor, a_rows: torch.Tensor, meta: LoRAKernelMeta) -> torch.Tensor:
        """Semantics::

            table = a_rows[gather_rows]                       # [A·R, in]; lanes past a rank read the zero row
            h = x @ table.T                                   # every token against every active lane
            h[t, l] = 0 where lane_owner[l] != token_compact[t]

        Shape: x [T, in], a_rows [N, in] -> h [T, A·R], new tensor.
        """
        _, gather_rows, _ = meta.args()
        return _masked(x @ a_rows.index_select(0, gather_rows).T, meta)

    def shrink_parts(self, x: torch.Tensor, a_parts: torch.Tensor, meta: LoRAKernelMeta) -> torch.Tensor:
        """Semantics: ``h[p] = shrink(x, a_parts[:, p])`` for every part p, one laned shrink per part (the graph
        fuses what it can; the eager backends are the ones that batch the parts into one matmul).

        Shape: x [T, in], a_parts [N, P, in] -> h [P, T, A·R], new tensor.
        """
        return torch.stack([self.shrink(x, a_parts[:, part], meta) for part in range(a_parts.shape[1])])

    def expand(
        self, y: torch.Tensor, h: torch.Tensor, bt_rows: torch.Tensor, meta: LoRAKernelMeta, accumulate: bool = True
    ) -> torch.Tensor:
        """Semantics::

            h[t, l] = 0 where lane_owner[l] != token_compact[t]   # re-masked, so any h is safe
            y_new = y + h @ bt_rows[gather_rows]                   # accumulate=False: y_new = h @ bt_rows[gather_rows]

        Shape: y [T, out], h [T, A·R], bt_rows [N, out] -> y_new [T, out], a new tensor (y is not written).
        """
        _, gather_rows, _ = meta.args()
        delta = _masked(h, meta) @ bt_rows.index_select(0, gather_rows)
        return y + delta if accumulate else delta
