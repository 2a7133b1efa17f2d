"""What every eager backend shares (torch forms, reference; the cpu and triton backends through the torch forms)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from adapter_manager.kernels.executor import LinearExecutor
from adapter_manager.kernels.meta import LoRAKernelMeta
from adapter_manager.kernels.ops import compose_parts
from adapter_manager.kernels.protocol import LinearWeight, LoRAGroups


class EagerBase:
    """An eager backend's defaults: op by op (no trace), h ``[T, R]``, the eager executor, a fused linear's LoRA as
    ``shrink_parts`` then one ``expand`` per part, no one-call form, the runs table on FUSED steps only."""

    traced = False
    laned_output = False
    executor_type = LinearExecutor
    runs_every_step = False

    def apply_parts(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        a_parts: torch.Tensor,
        bt_parts: Sequence[torch.Tensor],
        meta: LoRAKernelMeta,
    ) -> torch.Tensor:
        """Semantics: :func:`kernels.ops.apply_parts`: ``shrink_parts``, then one ``expand`` per part."""
        return compose_parts(y, x, a_parts, bt_parts, meta)

    def fused_linear(
        self, x: torch.Tensor, weight: LinearWeight, groups: LoRAGroups, meta: LoRAKernelMeta
    ) -> torch.Tensor | None:
        """No one-call form: the executor runs the base matmul, then the step's form."""
        return None
