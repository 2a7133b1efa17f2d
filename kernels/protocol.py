"""What a shrink/expand backend provides: the protocol the metadata, the ops and the seam all refer to."""

from __future__ import annotations

import enum
from typing import NamedTuple, Protocol

import torch

from kernels.config import LoRAForm


class KernelBackend(Protocol):
    """Every backend; ops in :mod:`kernels.ops` validate, then call these.

    ``a_rows [N, in]`` / ``bt_rows [N, out]`` are the row pools (see :class:`kernels.meta.LoRAKernelMeta`). ``meta``
    is the step's :class:`kernels.meta.LoRAKernelMeta`; it is typed ``object`` here because meta.py imports this
    module (the arrows run backends -> meta -> protocol, never back).

    A backend may also provide ``apply_parts(y, x, a_parts, bt_parts, meta)``: a fused linear's whole LoRA in one
    call (the cpu backend's FUSED form); :func:`kernels.ops.apply_parts` composes ``shrink_parts`` and ``expand``
    for a backend that does not. And ``fused_linear(x, weight, groups, meta) -> Tensor | None``: the base matmul of
    a :class:`LinearWeight` and every one of its :class:`LoRAGroups` in one call where it has such a form for that
    weight's layout and that step, None otherwise (:func:`kernels.ops.fused_linear`; the caller then composes its
    base matmul and ``apply_parts``). Which form a step takes is the backend's choice, never the model's.
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


class WeightLayout(enum.Enum):
    """How a linear's base weight ``W [out, in]`` is held, as a backend's :meth:`fused_linear` reads it."""

    PLAIN = "plain"
    """``[out, in]``, as ``nn.Linear`` holds it."""
    BLOCKED = "blocked"
    """Our fp32 blocked layout, ``[ceil(out / 32), in, 32]`` (:func:`kernels.cpu_kernels.block_weight`)."""
    ONEDNN = "onednn"
    """oneDNN's reordered copy (an opaque ``torch._mkldnn`` tensor: ``torch.ops.mkldnn._reorder_linear_weight``)."""


class LinearWeight(NamedTuple):
    """A linear's base weight in its layout: what a backend's one-call form needs to run ``x @ W.T``."""

    layout: WeightLayout
    tensor: torch.Tensor
    out_features: int
    """W's rows: the output's width (a blocked weight pads them to a multiple of 32)."""


class LoRAGroups(NamedTuple):
    """A linear's LoRA as the one-call forms take it: groups of parts sharing x, each one ``apply_parts``' worth."""

    a_groups: tuple[torch.Tensor, ...]
    """Per group ``[N, P, in]``: a view of the pool's A rows (unit inner stride)."""
    bts: tuple[torch.Tensor, ...]
    """Every group's parts' Bt rows in order, ``[N, out_p]`` each (views of the pool, unit inner stride)."""
    offsets: tuple[int, ...]
    """Per group, its first column of the linear's output (ascending, groups not overlapping)."""
