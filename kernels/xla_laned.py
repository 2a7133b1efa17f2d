"""The laned form: one dense matmul per op against the (slot, rank)-flattened stacks, masked to each token's slot.

Static shapes, no gather, no data-dependent Python branching: what XLA (and the TPU MXU) wants. Runs on any torch
device; on the torch_xla device it traces into the step's graph.
"""

from __future__ import annotations

import torch

from kernels.meta import LoRAKernelMeta


def _lane_mask(meta: LoRAKernelMeta) -> torch.Tensor:
    token_slots, lane_slot = meta.args()
    return token_slots[:, None] == lane_slot[None, :]  # [T, S·R]


class XlaLanedBackend:
    """Laned shrink/expand; h is ``[T, S·R]`` with zeros outside each token's own slot's lanes."""

    traced = True
    laned_output = True

    def shrink(self, x: torch.Tensor, a_stack: torch.Tensor, meta: LoRAKernelMeta) -> torch.Tensor:
        """Semantics::

            h = x @ a_stack.reshape(S·R, in).T          # every token against every slot's lanes
            h[t, l] = 0 where lane_slot[l] != slot[t]   # so a -1 token's row is all zero

        Shape: x [T, in], a_stack [S, R, in] -> h [T, S·R], new tensor.
        """
        lanes = a_stack.reshape(-1, a_stack.shape[-1])  # [S·R, in]
        h = x @ lanes.T
        return torch.where(_lane_mask(meta), h, torch.zeros((), dtype=h.dtype, device=h.device))

    def expand(
        self, y: torch.Tensor, h: torch.Tensor, bt_stack: torch.Tensor, meta: LoRAKernelMeta, accumulate: bool = True
    ) -> torch.Tensor:
        """Semantics::

            h[t, l] = 0 where lane_slot[l] != slot[t]   # re-masked, so any h is safe
            y_new = y + h @ bt_stack.reshape(S·R, out)   # accumulate=False: y_new = h @ bt_stack.reshape(S·R, out)

        Shape: y [T, out], h [T, S·R], bt_stack [S, R, out] -> y_new [T, out], a new tensor (y is not written).
        """
        masked = torch.where(_lane_mask(meta), h, torch.zeros((), dtype=h.dtype, device=h.device))
        delta = masked @ bt_stack.reshape(-1, bt_stack.shape[-1])
        return y + delta if accumulate else delta
