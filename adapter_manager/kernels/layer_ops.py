"""The model's ops besides its LoRA terms: a linear's base matmul in the layout its weight is held in, and the decode
step's glue (RoPE + KV write + attention, add + RMSNorm, SiLU·mul: :class:`DecodeOps`).

The model names the op and says how its weight is held (:class:`LinearWeight`); the room of the tensors' device picks
the implementation, as :func:`kernels.ops.fused_linear` lets the step's backend pick a linear's one-call form. On CPU
that is the cpu room (:mod:`kernels.cpu`: our blocked fp32 layout, oneDNN's, the C++ decode ops where its library
builds); elsewhere (CUDA, XLA) a plain weight and torch's matmul, and the model's own torch layers in place of the
decode ops. :mod:`kernels.layer_reference` holds each op's torch form, which the tests compare every implementation
with.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import adapter_manager.kernels.cpu as cpu
from adapter_manager.kernels.protocol import DecodeOps, LinearWeight, WeightLayout
from adapter_manager.kernels.quantize import dequantize_int8, int8_matmul, quantize_int8


def decode_ops(x: torch.Tensor) -> DecodeOps | None:
    """The fused decode glue for tensors like ``x`` (CPU, fp32 / bf16 / fp16, the library built: building it on the
    first call), or None where there is none: the model then runs its torch layers. Ask once per step."""
    return cpu.decode_ops if x.device.type == "cpu" and cpu.decode_ops.available(x) else None


def pack_weight(weight: torch.Tensor, layout: WeightLayout | None = None) -> LinearWeight | None:
    """``weight`` [out, in] as a new copy (same values) in ``layout`` (from :func:`choose_weight_layout`; None: the
    room's default for a lone weight); None where the plain layout stays (CUDA, XLA, ``layout`` plain, a dtype no
    packed matmul takes)."""
    return cpu.weights.pack(weight, layout) if weight.device.type == "cpu" else None


def quantize_weight(weight: torch.Tensor) -> LinearWeight:
    """``weight`` [out, in] as weight-only int8 with one scale per output row (symmetric, ``max|W[n]| / 127`` rounded
    to the weight's dtype), on its own device: the :class:`WeightLayout` INT8 form the device's matmul reads. The
    matmul of every device computes ``x @ W.T`` for the dequantized ``W = q · scales[:, None]``
    (:func:`unpack_weight` returns it). The scheme: :mod:`kernels.quantize`."""
    if weight.device.type == "cpu":
        return cpu.weights.quantize(weight)
    q, scales = quantize_int8(weight, weight.dtype)
    return LinearWeight(WeightLayout.INT8, q, weight.shape[0], scales)


def choose_weight_layout(dtype: torch.dtype, shapes: Sequence[tuple[int, int, int]], device: torch.device | str):
    """The layout a model's base weights of ``shapes`` (out, in, count) in ``dtype`` read fastest in on ``device``:
    on CPU measured once per machine and cached (:func:`kernels.cpu.layout_choice.choose_layout`;
    ``ADAPTER_MANAGER_WEIGHT_LAYOUT`` forces one), returned with the times it was chosen by; elsewhere plain."""
    if torch.device(device).type != "cpu":
        return cpu.layout_choice.LayoutChoice(WeightLayout.PLAIN, "forced", {}, {})
    return cpu.layout_choice.choose_layout(dtype, shapes)


def packs_by_default() -> bool:
    """Whether loading a model packs its weights unless told (``ADAPTER_MANAGER_PACK_WEIGHTS=0``: not)."""
    return cpu.weights.pack_by_default()


def unpack_weight(weight: LinearWeight) -> torch.Tensor:
    """The plain ``[out, in]`` weight back from any layout (a plain one as it is; an int8 one dequantized)."""
    if weight.layout is WeightLayout.INT8 and weight.tensor.device.type != "cpu":
        assert weight.scales is not None
        return dequantize_int8(weight.tensor, weight.scales)
    return weight.tensor if weight.layout is WeightLayout.PLAIN else cpu.weights.unpack(weight)


def base_linear(x: torch.Tensor, weight: LinearWeight, fast: bool = False, reorder: bool = True) -> torch.Tensor:
    """Semantics: ``x @ W.T`` whichever layout W is held in (torch form: :func:`kernels.layer_reference.base_linear` on
    the plain weight). ``fast``: the model's fused decode ops are on, so a CPU decode step's plain fp32 weight may
    take the library's decode linear. ``reorder``: a plain weight may be reordered for oneDNN's linear at this call
    (a prefill's projection); False keeps torch's matmul (a tied lm_head, whose reorder would cost more than its few
    rows' matmul). Shape: x [T, in]; returns a new [T, weight.out_features]."""
    if weight.layout is WeightLayout.INT8 and x.device.type != "cpu":
        assert weight.scales is not None
        return int8_matmul(x, weight.tensor, weight.scales)
    if weight.layout is WeightLayout.PLAIN and x.device.type != "cpu":
        return x @ weight.tensor.t()
    return cpu.weights.linear(x, weight, fast, reorder)


def plain_matmul(x: torch.Tensor, weight: LinearWeight) -> bool:
    """Whether :func:`base_linear` of ``x`` is torch's own ``x @ W.T`` for this weight (no packed or oneDNN
    matmul): then a caller may write its LoRA terms first and add the base matmul on top with one ``addmm_``."""
    if weight.layout is WeightLayout.INT8:
        return False
    if weight.layout is WeightLayout.PLAIN and x.device.type != "cpu":
        return True
    return cpu.weights.plain_matmul(x, weight)


_paged = None  # kernels.triton.attention.PagedAttention, built on the first CUDA call; False: triton is missing


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor | None:
    """Causal GQA attention of each token over its sequence's cached keys read in place through the block tables
    (no gather), where the device has a kernel for it: CUDA with triton (:mod:`kernels.triton.attention`); None
    elsewhere (the caller gathers and runs SDPA: ``runtime.model.kv_cache.KVCache.attend_static`` is the torch
    form). Semantics and shapes: :class:`kernels.triton.attention.PagedAttention`."""
    global _paged
    if q.device.type != "cuda" or _paged is False:
        return None
    if _paged is None:
        try:
            from adapter_manager.kernels.triton.attention import PagedAttention

            _paged = PagedAttention()
        except ImportError:
            _paged = False
            return None
    q = q if q.stride(2) == 1 else q.contiguous()
    tables = tables if tables.stride(1) == 1 else tables.contiguous()
    return _paged(q, k_cache, v_cache, tables, rows, positions)
