"""A (possibly fused) linear layer with per-token LoRA through the slot stacks: ``y = x @ W.T + expand(shrink(x))``."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from kernels import LoRAKernelMeta, expand, shrink


class Stacks(Protocol):
    """One module's LoRA rows (``adapter_manager.slot_pool.SlotStacks``)."""

    @property
    def a(self) -> torch.Tensor: ...  # Shape: [N, in]

    @property
    def bt(self) -> torch.Tensor: ...  # Shape: [N, out]


class LoRALinear(nn.Module):
    """One base matmul for one or more projections that share an input (q/k/v, gate/up), each with its own LoRA.

    The base weight of the fused parts is one ``[sum(out), in]`` matrix (gpt-fast's ``wqkv``); the LoRA stacks stay
    per projection, as the slot pool owns them: each part's rows ``A [N, in]`` and ``Bt [N, out]``, strided views of
    the pool's row tensor. They are attached by reference: a slot load, which writes the pool in place, is seen by
    the next forward without re-attaching.
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
        self._lora: list[Stacks | None] = [None] * len(out_features)

    def attach(self, part: int, stacks: Stacks) -> None:
        """Route part ``part``'s LoRA through the pool's rows ``stacks.a`` [N, in] and ``stacks.bt`` [N, out], read at
        every forward (the pool may hand out fresh views of the same rows)."""
        out = self.out_features[part]
        a_rows, bt_rows = stacks.a, stacks.bt
        if a_rows.dim() != 2 or a_rows.shape[1] != self.in_features:
            raise ValueError(f"a_rows must have shape [N, {self.in_features}], got {tuple(a_rows.shape)}")
        if bt_rows.shape != (a_rows.shape[0], out):
            raise ValueError(f"bt_rows must have shape [{a_rows.shape[0]}, {out}], got {tuple(bt_rows.shape)}")
        if a_rows.dtype != self.weight.dtype or bt_rows.dtype != self.weight.dtype:
            raise ValueError(f"rows are {a_rows.dtype}/{bt_rows.dtype}, the layer is {self.weight.dtype}")
        self._lora[part] = stacks

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
            for each part p with rows (A_p, Bt_p), unless meta is None or meta.no_adapter (eager fast path):
                y_p = expand(y_p, shrink(x, A_p, meta), Bt_p, meta)  # y_p[t] += x[t] @ A_p[rows of slot[t]].T @ ...
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
                    parts[index] = expand(parts[index], shrink(x, stacks.a, meta), stacks.bt, meta)
            return parts
        y = x.new_empty(x.shape[0], sum(self.out_features))  # [T, sum(out)]
        parts = list(y.split(self.out_features, dim=-1)) if len(self.out_features) > 1 else [y]
        for index, stacks in enumerate(self._lora):
            if stacks is None:
                parts[index].zero_()
            else:
                expand(parts[index], shrink(x, stacks.a, meta), stacks.bt, meta, accumulate=False)
        y.addmm_(x, self.weight.t())  # y = LoRA terms + x @ W.T, one pass
        return parts

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, lora={self.has_lora}"
