"""Base weights in oneDNN's reordered layout on CPU: the form its linear reads fastest at decode's small M.

At M = 8 a plain ``x @ W.T`` on an AVX2/AVX-512 CPU runs far from the memory bound (and may use one core); oneDNN's
linear over a weight reordered once at load reads it about twice as fast and does prefill's large M as well as MKL's
sgemm (``scripts/bench_engine.py`` measures both). The reorder replaces the plain weight: one copy in memory.
CUDA and XLA keep their plain weights.
"""

from __future__ import annotations

import os

import torch

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


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's reordered copy of ``weight`` [out, in] (an opaque ``torch._mkldnn`` tensor, same values)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """Semantics: ``x @ W.T`` for a packed W. Shape: x [T, in]; packed [out, in]; returns a new [T, out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """The plain [out, in] weight back from its packed copy."""
    return packed.to_dense()
