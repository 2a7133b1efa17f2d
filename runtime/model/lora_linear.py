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

        On eager backends the LoRA terms are written first (``expand(accumulate=False)``) and the base matmul is added
        on top by one ``addmm_``, so the output is never read back by a separate pass; traced backends add the LoRA
        term to the base matmul's result.

        Shape: x [T, in]; returns one [T, out_p] per part (views of one [T, sum(out)] on eager backends; new tensors
        on traced backends).
        """
        if meta is None or meta.no_adapter or not self.has_lora:
            y = x @ self.weight.t()  # [T, sum(out)]
            return list(y.split(self.out_features, dim=-1)) if len(self.out_features) > 1 else [y]
        if meta.backend.traced:
            y = x @ self.weight.t()
            parts = list(y.split(self.out_features, dim=-1)) if len(self.out_features) > 1 else [y]
            for index, stacks in enumerate(self._lora):
                if stacks is not None:
                    parts[index] = expand(parts[index], shrink(x, stacks[0], meta), stacks[1], meta)
            return parts
        y = x.new_empty(x.shape[0], sum(self.out_features))  # [T, sum(out)]
        parts = list(y.split(self.out_features, dim=-1)) if len(self.out_features) > 1 else [y]
        for index, stacks in enumerate(self._lora):
            if stacks is None:
                parts[index].zero_()
            else:
                expand(parts[index], shrink(x, stacks[0], meta), stacks[1], meta, accumulate=False)
        y.addmm_(x, self.weight.t())  # y = LoRA terms + x @ W.T, one pass
        return parts

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, lora={self.has_lora}"
