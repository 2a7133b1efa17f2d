"""Base weights on CPU and the base matmul in their layout: packed for decode's small M, in our blocked layout (fp32,
where the library builds) or oneDNN's reordered one (bf16, or ``ADAPTER_MANAGER_WEIGHT_LAYOUT=onednn``).

At M = 8 a plain ``x @ W.T`` on an AVX2/AVX-512 CPU runs far from the memory bound (and may use one core). oneDNN's
linear over a weight reordered once at load reads it about twice as fast and does prefill's large M as well as MKL's
sgemm; :func:`kernels.cpu.linear_ops.lora_blocked` over our blocked layout (32 columns per block, each block one
contiguous stream) reads it near the read pass's rate on some CPUs, and adds the step's LoRA in the same call
(``scripts/bench_layout.py`` compares the two layouts on the machine at hand). Packing replaces the plain weight: one
copy in memory. CUDA and XLA keep their plain weights.
"""

from __future__ import annotations

import os

import torch

from adapter_manager.kernels.cpu.library import load
from adapter_manager.kernels.cpu.linear_ops import (
    LINEAR_MAX_TOKENS,
    block_weight,
    lora_blocked,
    lora_linear,
    q8_block,
    q8_linear,
    q8_unblock,
    unblock_weight,
)
from adapter_manager.kernels.protocol import LinearWeight, WeightLayout
from adapter_manager.kernels.quantize import dequantize_int8, int8_matmul, quantize_int8

LAYOUT_ENV = "ADAPTER_MANAGER_WEIGHT_LAYOUT"
"""``auto`` (default: measured here, :func:`choose_layout`), or ``blocked`` / ``onednn`` / ``plain`` to force one."""
PACK_ENV = "ADAPTER_MANAGER_PACK_WEIGHTS"
"""Set to ``0`` to keep plain weights on CPU (benchmarks compare the two); default on where oneDNN can."""


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN's linear takes this weight: a CPU tensor in fp32, or bf16 where oneDNN supports bf16."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_by_default() -> bool:
    """The load-time default: on unless ``ADAPTER_MANAGER_PACK_WEIGHTS=0``."""
    return os.environ.get(PACK_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def forced_layout() -> WeightLayout | None:
    """The layout ``ADAPTER_MANAGER_WEIGHT_LAYOUT`` forces, or None for ``auto`` / unset (a ValueError otherwise)."""
    value = os.environ.get(LAYOUT_ENV, "auto").strip().lower() or "auto"
    if value == "auto":
        return None
    if value not in ("blocked", "onednn", "plain"):  # int8 is a quantization (load_model's quantize), not a layout
        raise ValueError(f"{LAYOUT_ENV}={value!r}: expected auto, blocked, onednn or plain")
    return WeightLayout(value)


def default_layout(weight: torch.Tensor) -> WeightLayout:
    """The layout of a weight packed on its own, without a measured choice: ``ADAPTER_MANAGER_WEIGHT_LAYOUT``'s where
    it forces one, else fp32 in our blocked layout where the library builds and oneDNN's otherwise."""
    forced = forced_layout()
    if forced is not None:
        return forced
    return WeightLayout.BLOCKED if weight.dtype == torch.float32 and load() else WeightLayout.ONEDNN


def pack_weight(weight: torch.Tensor, layout: WeightLayout | None = None) -> torch.Tensor:
    """The packed copy of ``weight`` [out, in] (same values) in ``layout`` (None: :func:`default_layout`): our
    blocked layout (a dense ``[ceil(out / 32), in, 32]``, :func:`kernels.cpu.linear_ops.block_weight`) for fp32 where
    the CPU kernels load, otherwise oneDNN's reordered copy (an opaque ``torch._mkldnn`` tensor)."""
    layout = default_layout(weight) if layout is None else layout
    if layout is WeightLayout.BLOCKED and weight.dtype == torch.float32 and load():
        return block_weight(weight)
    return onednn_pack(weight)


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's reordered copy of ``weight`` [out, in] (an opaque ``torch._mkldnn`` tensor, same values)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def is_blocked(packed: torch.Tensor) -> bool:
    """Whether a packed weight is in our blocked layout (else oneDNN's)."""
    return not packed.is_mkldnn and packed.dim() == 3


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Semantics: ``x @ W.T`` through oneDNN's linear, for W oneDNN-packed or plain (reordered at every call)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """Semantics: ``x @ W.T`` for a packed W. Shape: x [T, in]; packed W [out_features, in]; returns a new [T, out]."""
    if is_blocked(packed):
        return lora_blocked(x, packed, out_features, (), (), (), None)
    return onednn_linear(x, packed)


def unpack_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The plain [out_features, in] weight back from its packed copy."""
    return unblock_weight(packed, out_features) if is_blocked(packed) else packed.to_dense()


def pack(weight: torch.Tensor, layout: WeightLayout | None = None) -> LinearWeight | None:
    """``weight`` [out, in] packed (:func:`pack_weight`, in ``layout``; None: :func:`default_layout`) as a
    :class:`LinearWeight`; None where it stays plain (``layout`` plain, or :func:`can_pack` refuses it)."""
    if not can_pack(weight) or (layout or default_layout(weight)) is WeightLayout.PLAIN:
        return None
    packed = pack_weight(weight, layout)
    layout = WeightLayout.BLOCKED if is_blocked(packed) else WeightLayout.ONEDNN
    return LinearWeight(layout, packed, weight.shape[0])


def unpack(weight: LinearWeight) -> torch.Tensor:
    """The plain [out, in] weight of any layout (a plain one as it is; an int8 one dequantized)."""
    if weight.layout is WeightLayout.INT8:
        return dequantize(weight)
    return weight.tensor if weight.layout is WeightLayout.PLAIN else unpack_weight(weight.tensor, weight.out_features)


def quantize(weight: torch.Tensor) -> LinearWeight:
    """``weight`` [out, in] on CPU as weight-only int8 (:mod:`kernels.quantize`): for fp32 where the library builds,
    q in the blocked layout :func:`q8_linear` reads; otherwise q plain ``[out, in]`` (bf16 / fp16: torch's
    ``_weight_int8pack_mm`` reads it)."""
    q, scales = quantize_int8(weight, weight.dtype)
    blocked = weight.dtype == torch.float32 and load()
    return LinearWeight(WeightLayout.INT8, q8_block(q) if blocked else q, weight.shape[0], scales)


def dequantize(weight: LinearWeight) -> torch.Tensor:
    """The dequantized [out, in] weight of an int8 one, either form of q."""
    q = weight.tensor if weight.tensor.dim() == 2 else q8_unblock(weight.tensor, weight.out_features)
    assert weight.scales is not None
    return dequantize_int8(q, weight.scales)


def int8_linear(x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
    """Semantics: ``x @ W.T`` for the dequantized int8 W on CPU: the blocked fp32 form through :func:`q8_linear`,
    bf16 / fp16 through torch's ``_weight_int8pack_mm`` (fp32 accumulation), else the weight dequantized inside the
    matmul. Shape: x [T, in]; returns a new [T, out]."""
    q, scales = weight.tensor, weight.scales
    assert scales is not None
    if q.dim() == 3:
        return q8_linear(x if x.stride(1) == 1 else x.contiguous(), q, scales, weight.out_features)
    if x.dtype in (torch.bfloat16, torch.float16) and x.dtype == scales.dtype:
        return torch.ops.aten._weight_int8pack_mm(x.contiguous(), q, scales)
    return int8_matmul(x, q, scales)


def onednn_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether oneDNN's linear takes this plain weight for ``x``: CPU, a dtype it packs, and more tokens than the
    decode kernel's (it reorders a plain weight at every call: 5 % of a 1024-token GEMM, half MKL's time there)."""
    fits = x.shape[0] > LINEAR_MAX_TOKENS and x.device.type == "cpu" and weight.dtype == x.dtype
    return fits and can_pack(weight)


def decode_kernel_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`kernels.cpu.linear_ops.lora_linear` takes ``x @ weight.T``: fp32 both, at most
    ``LINEAR_MAX_TOKENS`` rows of unit inner stride, a contiguous weight, the library built."""
    return (
        x.shape[0] <= LINEAR_MAX_TOKENS
        and x.dtype == weight.dtype == torch.float32
        and x.stride(1) == 1
        and weight.is_contiguous()
        and load()
    )


def linear(x: torch.Tensor, weight: LinearWeight, fast: bool, reorder: bool) -> torch.Tensor:
    """Semantics: ``x @ W.T`` on CPU in W's layout: packed (blocked / oneDNN's) through its own matmul; a plain fp32
    weight of few tokens through the decode kernel when ``fast``; a plain one of many tokens through oneDNN's
    linear when ``reorder``; else torch's matmul. Shape: x [T, in]; returns a new [T, out]."""
    w = weight.tensor
    if weight.layout is WeightLayout.INT8:
        return int8_linear(x, weight)
    if weight.layout is not WeightLayout.PLAIN:
        return packed_linear(x, w, weight.out_features)
    if fast and decode_kernel_takes(x, w):
        return lora_linear(x, w, (), (), (), None)
    if reorder and onednn_takes(x, w):
        return onednn_linear(x, w)
    return x @ w.t()


def plain_matmul(x: torch.Tensor, weight: LinearWeight) -> bool:
    """Whether :func:`linear` of ``x`` would be torch's own ``x @ W.T`` at prefill (a plain weight oneDNN does not
    take): then a caller may write the LoRA terms first and add the base matmul on top with one ``addmm_``."""
    return weight.layout is WeightLayout.PLAIN and not onednn_takes(x, weight.tensor)
