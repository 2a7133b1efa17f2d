"""Base weights packed on CPU for decode's small M: our blocked layout (fp32, where the CPU kernels build) or oneDNN's
reordered one (bf16, or ``ADAPTER_MANAGER_WEIGHT_LAYOUT=onednn``).

At M = 8 a plain ``x @ W.T`` on an AVX2/AVX-512 CPU runs far from the memory bound (and may use one core). oneDNN's
linear over a weight reordered once at load reads it about twice as fast and does prefill's large M as well as MKL's
sgemm; ``kernels.cpu_kernels.lora_blocked`` over our blocked layout (32 columns per block, each block one contiguous
stream) reads it near the read pass's rate, faster still at decode, and adds the step's LoRA in the same call
(``scripts/bench_layout.py`` compares the two layouts). Packing replaces the plain weight: one copy in memory. CUDA
and XLA keep their plain weights.
"""

from __future__ import annotations

import os

import torch

from kernels import cpu_kernels

PACK_ENV = "ADAPTER_MANAGER_PACK_WEIGHTS"
"""Set to ``0`` to keep plain weights on CPU (benchmarks compare the two); default on where oneDNN can."""
LAYOUT_ENV = "ADAPTER_MANAGER_WEIGHT_LAYOUT"
"""``blocked`` (the default: fp32 weights in our blocked layout where the CPU kernels build) or ``onednn`` (every
packed weight in oneDNN's layout, as before the blocked one; benchmarks compare the two)."""


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


def blocked_by_default() -> bool:
    """Whether :func:`pack_weight` takes the blocked layout for fp32 (``ADAPTER_MANAGER_WEIGHT_LAYOUT``)."""
    layout = os.environ.get(LAYOUT_ENV, "blocked").strip().lower()
    if layout not in ("blocked", "onednn"):
        raise ValueError(f"{LAYOUT_ENV}={layout!r}: expected 'blocked' or 'onednn'")
    return layout == "blocked"


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The packed copy of ``weight`` [out, in] (same values): an fp32 weight in our blocked layout (a dense
    ``[ceil(out / 32), in, 32]``, ``kernels.cpu_kernels.block_weight``) where the CPU kernels load and
    :func:`blocked_by_default`; otherwise oneDNN's reordered copy (an opaque ``torch._mkldnn`` tensor)."""
    if weight.dtype == torch.float32 and blocked_by_default() and cpu_kernels.load():
        return cpu_kernels.block_weight(weight)
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
        return cpu_kernels.lora_blocked(x, packed, out_features, (), (), (), None)
    return onednn_linear(x, packed)


def unpack_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The plain [out_features, in] weight back from its packed copy."""
    return cpu_kernels.unblock_weight(packed, out_features) if is_blocked(packed) else packed.to_dense()
