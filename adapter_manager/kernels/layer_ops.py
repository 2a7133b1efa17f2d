"""The seam of the model's ops besides its LoRA terms: :func:`layer_kernels` is the device's platform's
:class:`LayerKernels` (:mod:`kernels.platform`), which the model calls (it never branches on the device); the
functions below are the same ops for one call on a tensor's own device. :mod:`kernels.layer_reference` holds each
op's torch form, which the tests compare every implementation with.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from adapter_manager.kernels.cpu.layer_kernels import CpuLayerKernels
from adapter_manager.kernels.device_kernels import LayerKernels
from adapter_manager.kernels.platform import platform_for
from adapter_manager.kernels.protocol import DecodeOps, LayoutReport, LinearWeight, WeightLayout


def layer_kernels(device: torch.device | str, deterministic: bool = False) -> LayerKernels:
    """The layer kernels of ``device``'s platform (:meth:`kernels.platform.Platform.layer_kernels`: one object per
    device and mode, kept). ``deterministic``: batch-invariant base matmuls and norms (eager devices; refused on
    XLA)."""
    return platform_for(device).layer_kernels(deterministic)


def decode_ops(x: torch.Tensor) -> DecodeOps | None:
    """The compiled decode glue for tensors like ``x`` (CPU, fp32 / bf16 / fp16, the library built: building it on
    the first call), or None where there is none."""
    ops = layer_kernels(x.device).decode_ops(x)
    return ops if ops.compiled else None


def pack_weight(weight: torch.Tensor, layout: WeightLayout | None = None) -> LinearWeight | None:
    """``weight`` [out, in] as a new copy in ``layout`` (None: the device's default for a lone weight); None where
    the plain layout stays (CUDA, XLA, ``layout`` plain, a dtype no packed matmul takes)."""
    return layer_kernels(weight.device).pack(weight, layout)


def quantize_weight(weight: torch.Tensor) -> LinearWeight:
    """``weight`` [out, in] as weight-only int8 (:meth:`LayerKernels.quantize`), in the form its device reads."""
    return layer_kernels(weight.device).quantize(weight)


def choose_weight_layout(
    dtype: torch.dtype, shapes: Sequence[tuple[int, int, int]], device: torch.device | str
) -> LayoutReport | None:
    """The layout a model's base weights of ``shapes`` (out, in, count) read fastest in on ``device`` (on CPU
    measured once per machine and cached; ``ADAPTER_MANAGER_WEIGHT_LAYOUT`` forces one); None: plain, nothing to
    choose (CUDA, XLA)."""
    return layer_kernels(device).choose_layout(dtype, shapes)


def unpack_weight(weight: LinearWeight) -> torch.Tensor:
    """The plain ``[out, in]`` weight back from any layout."""
    return layer_kernels(weight.tensor.device).unpack(weight)


def base_linear(x: torch.Tensor, weight: LinearWeight, fast: bool = False, reorder: bool = True) -> torch.Tensor:
    """Semantics: ``x @ W.T`` whichever layout W is held in (:meth:`LayerKernels.linear` of x's device)."""
    return layer_kernels(x.device).linear(x, weight, fast, reorder)


def plain_matmul(x: torch.Tensor, weight: LinearWeight) -> bool:
    """Whether :func:`base_linear` of ``x`` is torch's own ``x @ W.T`` for this weight."""
    return layer_kernels(x.device).plain_matmul(x, weight)


def packs_by_default() -> bool:
    """Whether loading a model packs its weights unless told (``ADAPTER_MANAGER_PACK_WEIGHTS=0``: not)."""
    return CpuLayerKernels.packs_by_default()


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor | None:
    """:meth:`LayerKernels.paged_attention` of q's device (CUDA with triton: the Triton kernel; None elsewhere)."""
    return layer_kernels(q.device).paged_attention(q, k_cache, v_cache, tables, rows, positions)
