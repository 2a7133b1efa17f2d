"""What CPU this is, as the kernels' choices depend on it: its model name and ISA flags (``/proc/cpuinfo``), and
whether it runs bf16 matmuls natively."""

from __future__ import annotations

import platform
from collections.abc import Iterable
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
FAST_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
"""Either one makes oneDNN's bf16 matmuls native; without both they are emulated, slower than fp32."""


def _read(cpuinfo: str | None) -> str:
    if cpuinfo is not None:
        return cpuinfo
    try:
        return CPUINFO.read_text()
    except OSError:
        return ""


def cpu_model(cpuinfo: str | None = None) -> str:
    """The first CPU's model name in ``cpuinfo`` (default: /proc/cpuinfo), else ``platform.processor()``."""
    for line in _read(cpuinfo).splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "model name":
            return value.strip()
    return platform.processor() or "unknown"


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str] | None:
    """The ISA flags of the first CPU in ``cpuinfo`` (default: /proc/cpuinfo; ``flags`` on x86, ``Features`` on
    Arm); None where there is no such line (unknown, not "none").

    Example: ``cpu_flags("flags\\t\\t: fpu avx2 amx_bf16\\n")`` -> ``frozenset({"fpu", "avx2", "amx_bf16"})``."""
    for line in _read(cpuinfo).splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


def has_fast_bf16(flags: Iterable[str]) -> bool:
    """Whether a CPU with these ISA flags runs bf16 matmuls natively (avx512_bf16 or amx_bf16)."""
    return not FAST_BF16_FLAGS.isdisjoint(flags)
