"""The one warning a bf16 model gets on a CPU whose bf16 matmuls are emulated (no avx512_bf16, no AMX)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from adapter_manager.kernels import cpu_flags, has_fast_bf16

log = logging.getLogger(__name__)
_warned = False


def warn_if_slow_bf16(dtype: torch.dtype, flags: Iterable[str] | None = None) -> bool:
    """Warn, once per process, that bf16 is slow on this CPU when ``dtype`` is bf16 and the CPU's ``flags`` (default:
    :func:`kernels.cpu_flags`; unknown flags warn nothing) have neither avx512_bf16 nor AMX. Returns whether it
    warned."""
    global _warned
    if dtype != torch.bfloat16 or _warned:
        return False
    flags = cpu_flags() if flags is None else frozenset(flags)
    if flags is None or has_fast_bf16(flags):
        return False
    _warned = True
    log.warning(
        "serving in bfloat16 on a CPU without avx512_bf16 or AMX (amx_bf16): its bf16 matmuls are emulated and "
        "slower than float32's here; --dtype float32 (load_model(dtype=torch.float32)) is faster on this machine"
    )
    return True
