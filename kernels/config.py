"""Kernel configuration: which backend the seam picks and how the Pallas kernels run."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class BackendKind(StrEnum):
    """The shrink/expand implementations; ``AUTO`` lets the seam choose by device."""

    AUTO = "auto"
    REFERENCE = "reference"
    TORCH = "torch"
    XLA = "xla"
    PALLAS = "pallas"


class PallasInterpret(StrEnum):
    """How the Pallas kernels run: compiled for a TPU, or interpreted on any backend."""

    OFF = "off"
    """Compile with Mosaic for a real TPU."""
    TPU = "tpu"
    """Pallas TPU interpret mode (``pltpu.InterpretParams()``): faithful TPU semantics, JAX only; its ordered host
    callbacks (XLA TOKEN values) cannot be embedded into a torch_xla graph."""
    HLO = "hlo"
    """The generic interpreter (``interpret=True``): the kernel discharged to plain HLO loops; runs inside torch_xla."""


@dataclass(frozen=True)
class KernelConfig:
    """How :func:`kernels.select_backend` picks and configures a backend."""

    backend: BackendKind = BackendKind.AUTO
    """Forced backend, or AUTO: cpu/cuda -> torch, xla -> ``xla_backend``."""
    xla_backend: BackendKind = BackendKind.XLA
    """What AUTO picks on an XLA device: XLA (laned torch ops) or PALLAS (Pallas TPU kernels)."""
    pallas_interpret: PallasInterpret = PallasInterpret.OFF
    """Interpret the Pallas kernels (CPU tests) instead of compiling for a TPU; HLO is the one usable on torch_xla."""
    dispatch_table: str | None = None
    """Path of a torch dispatch table JSON written by scripts/bench_kernels.py; None uses the shipped one."""
    block_size_table: str | None = None
    """Path of a Pallas block-size table JSON; None uses the shipped one."""

    def __post_init__(self) -> None:
        if not isinstance(self.backend, BackendKind):
            raise ValueError(f"backend must be a BackendKind, got {self.backend!r}")
        if self.xla_backend not in (BackendKind.XLA, BackendKind.PALLAS):
            raise ValueError(f"xla_backend must be BackendKind.XLA or BackendKind.PALLAS, got {self.xla_backend!r}")
        if not isinstance(self.pallas_interpret, PallasInterpret):
            raise ValueError(f"pallas_interpret must be a PallasInterpret, got {self.pallas_interpret!r}")
