"""A (possibly fused) linear layer with per-token LoRA through the slot stacks: ``y = x @ W.T + expand(shrink(x))``."""

from __future__ import annotations

import torch
from torch import nn

from kernels import LoRAKernelMeta, expand, shrink


class LoRALinear(nn.Module):
    """One base matmul for one or more projections that share an input (q/k/v, gate/up), each with its own LoRA.

    The base weight of the fused parts is one ``[sum(out), in]`` matrix (gpt-fast's ``wqkv``); the LoRA stacks stay
    per projection, as the slot pool owns them. Stacks are attached by reference: a slot load, which writes the
    stacks in place, is seen by the next forward without re-attaching.
    """

    def __init__(
        self,
        in_features: int,
        out_features: tuple[int, ...],
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if in_features <= 0 or not out_features or min(out_features) <= 0:
            raise ValueError(f"in_features ({in_features}) and every out_features {out_features} must be positive")
        self.in_features = in_features
        self.out_features = tuple(out_features)
        self.weight = nn.Parameter(torch.empty(sum(out_features), in_features, device=device, dtype=dtype))
        self._lora: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(out_features)

    def attach(self, part: int, a_stack: torch.Tensor, bt_stack: torch.Tensor) -> None:
        """Route part ``part``'s LoRA through these stacks. Shape: a_stack [S, R, in]; bt_stack [S, R, out]."""
        out = self.out_features[part]
        if a_stack.dim() != 3 or a_stack.shape[2] != self.in_features:
            raise ValueError(f"a_stack must have shape [S, R, {self.in_features}], got {tuple(a_stack.shape)}")
        if bt_stack.shape != (*a_stack.shape[:2], out):
            raise ValueError(
                f"bt_stack must have shape [{a_stack.shape[0]}, {a_stack.shape[1]}, {out}], got {tuple(bt_stack.shape)}"
            )
        if a_stack.dtype != self.weight.dtype or bt_stack.dtype != self.weight.dtype:
            raise ValueError(f"stacks are {a_stack.dtype}/{bt_stack.dtype}, the layer is {self.weight.dtype}")
        self._lora[part] = (a_stack, bt_stack)

    def detach(self) -> None:
        """Drop every part's stacks: the layer is its base matmul again."""
        self._lora = [None] * len(self.out_features)

    @property
    def has_lora(self) -> bool:
        return any(stacks is not None for stacks in self._lora)

    def forward(self, x: torch.Tensor, meta: LoRAKernelMeta | None = None) -> list[torch.Tensor]:
        """The base projection(s) plus each token's adapter.

        Semantics::

            y = x @ W.T                                        # all parts in one matmul
            for each part p with stacks (A_p, Bt_p), unless meta is None or meta.no_adapter (eager fast path):
                y_p = expand(y_p, shrink(x, A_p, meta), Bt_p, meta)  # y_p[t] += x[t] @ A_p[slot[t]].T @ Bt_p[slot[t]]
            return [y_p for each part]

        Shape: x [T, in]; returns one [T, out_p] per part (views of one [T, sum(out)] on eager backends, which write
        the LoRA term into them in place; new tensors on traced backends).
        """
        y = x @ self.weight.t()  # [T, sum(out)]
        parts = list(y.split(self.out_features, dim=-1)) if len(self.out_features) > 1 else [y]
        if meta is None or meta.no_adapter:
            return parts
        for index, stacks in enumerate(self._lora):
            if stacks is not None:
                a_stack, bt_stack = stacks
                parts[index] = expand(parts[index], shrink(x, a_stack, meta), bt_stack, meta)
        return parts

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, lora={self.has_lora}"
