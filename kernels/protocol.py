"""What a shrink/expand backend provides: the protocol the metadata, the ops and the seam all refer to."""

from __future__ import annotations

from typing import Protocol

import torch

from kernels.config import LoRAForm


class KernelBackend(Protocol):
    """Every backend; ops in :mod:`kernels.ops` validate, then call these.

    ``a_rows [N, in]`` / ``bt_rows [N, out]`` are the row pools (see :class:`kernels.meta.LoRAKernelMeta`). ``meta``
    is the step's :class:`kernels.meta.LoRAKernelMeta`; it is typed ``object`` here because meta.py imports this
    module (the arrows run backends -> meta -> protocol, never back).

    A backend may also provide ``apply_parts(y, x, a_parts, bt_parts, meta)``: a fused linear's whole LoRA in one
    call (the cpu backend's FUSED form); :func:`kernels.ops.apply_parts` composes ``shrink_parts`` and ``expand``
    for a backend that does not.
    """

    traced: bool
    """True when the ops trace into a graph (XLA): static shapes, no host sync, expand returns a new tensor."""
    laned_output: bool
    """True when shrink's h is laned ``[T, A·R]`` (over the compact active table) rather than ``[T, R]``."""

    def shrink(self, x: torch.Tensor, a_rows: torch.Tensor, meta: object) -> torch.Tensor: ...

    def shrink_parts(self, x: torch.Tensor, a_parts: torch.Tensor, meta: object) -> torch.Tensor:
        """Shrink for P parts sharing x: ``a_parts [N, P, in]`` -> h ``[P, T, R]`` (laned: ``[P, T, A·R]``)."""
        ...

    def expand(
        self, y: torch.Tensor, h: torch.Tensor, bt_rows: torch.Tensor, meta: object, accumulate: bool
    ) -> torch.Tensor: ...


class EagerBackend(KernelBackend, Protocol):
    """A backend that runs op by op (``traced`` False): the metadata asks it which form each step takes."""

    def choose_form(self, num_tokens: int, active_slots: int, rank: int, runs: int) -> LoRAForm:
        """The form for a step of ``num_tokens`` tokens using ``active_slots`` ≥ 1 distinct slots (of padded rank
        ``rank``) in ``runs`` runs of equal slots (token order); never AUTO or NONE."""
        ...
