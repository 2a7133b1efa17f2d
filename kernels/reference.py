"""The fp32 loop reference of shrink and expand: slow, obvious, the oracle every backend is tested against."""

from __future__ import annotations

import torch

from kernels.config import LoRAForm
from kernels.meta import LoRAKernelMeta


class ReferenceBackend:
    """Per-token Python loops in float32; results are cast back to the inputs' dtype."""

    traced = False
    laned_output = False

    def choose_form(self, num_tokens: int, num_slots: int, rank: int, active_slots: int, runs: int) -> LoRAForm:
        return LoRAForm.SINGLE if active_slots == 1 else LoRAForm.SEGMENTS  # the loops read only token_slots

    def shrink(self, x: torch.Tensor, a_stack: torch.Tensor, meta: LoRAKernelMeta) -> torch.Tensor:
        """Semantics::

            for t in range(T):
                h[t] = x[t] @ a_stack[slot[t]].T if slot[t] >= 0 else 0

        Shape: x [T, in], a_stack [S, R, in] -> h [T, R], new tensor.
        """
        slots = meta.token_slots.tolist()
        h = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)
        for t, s in enumerate(slots):
            if s >= 0:
                h[t] = a_stack[s].float() @ x[t].float()
        return h.to(x.dtype)

    def expand(
        self, y: torch.Tensor, h: torch.Tensor, bt_stack: torch.Tensor, meta: LoRAKernelMeta, accumulate: bool = True
    ) -> torch.Tensor:
        """Semantics::

            if not accumulate: y[:] = 0
            for t in range(T):
                if slot[t] >= 0:
                    y[t] += h[t] @ bt_stack[slot[t]]

        Shape: y [T, out] (updated in place and returned), h [T, R], bt_stack [S, R, out].
        """
        slots = meta.token_slots.tolist()
        if not accumulate:
            y.zero_()
        for t, s in enumerate(slots):
            if s >= 0:
                y[t] = (y[t].float() + h[t].float() @ bt_stack[s].float()).to(y.dtype)
        return y
