"""Kernel configuration: which backend the seam picks and how the Pallas kernels run."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class BackendKind(StrEnum):
    """The shrink/expand implementations; ``AUTO`` lets the seam choose by device."""

    AUTO = "auto"
    REFERENCE = "reference"
    TORCH = "torch"
    CPU = "cpu"
    """The torch forms plus the C++ CPU kernel (kernels/cpu/library.py) for steps of few tokens."""
    XLA = "xla"
    PALLAS = "pallas"
    TRITON = "triton"
    """The cuda backend: Triton BGMV / SGMV kernels for every step with an adapter (kernels/triton/backend.py);
    on a CPU device only in Triton's interpret mode (``TRITON_INTERPRET=1``, tests)."""


class LoRAForm(StrEnum):
    """How the eager torch backend computes one step's LoRA; ``LoRAKernelMeta.form`` records the one each step took.

    ``KernelConfig.torch_form`` may force SEGMENTS, GROUPED, LANED (or, on the cpu backend, FUSED) for every step
    with an adapter (no single-slot fast path then; a step with no adapter still skips LoRA), to compare the forms on
    the same batches.
    """

    AUTO = "auto"
    """Config only: the fast paths when the step allows them, else segments, else the measured table's choice."""
    NONE = "none"
    """No token has an adapter: no LoRA work at all."""
    SINGLE = "single"
    """Every adapter token uses one slot: plain matmuls with its pool rows, rows of -1 tokens zeroed."""
    SEGMENTS = "segments"
    """One matmul per run of equal slots in token order, on row slices (a batch ordered by adapter)."""
    GROUPED = "grouped"
    """Tokens sorted by slot once per step: per-slot matmuls, or, padded per active slot, two batched matmuls
    against the compact active table."""
    LANED = "laned"
    """One dense matmul over the k·R lanes of the step's k active adapters, masked to each token's slot (small
    batches)."""
    FUSED = "fused"
    """cpu and triton backends: one kernel call (triton: one shrink and one expand launch) per fused linear (all its
    parts, all runs of equal slots) reading each active adapter's pool rows in place; its cost follows the active
    adapters' bytes, its call count does not grow with them (cpu: steps of few tokens; triton: every step with an
    adapter)."""


_FORCIBLE_FORMS = (LoRAForm.AUTO, LoRAForm.SEGMENTS, LoRAForm.GROUPED, LoRAForm.LANED, LoRAForm.FUSED)


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
    """Forced backend, or AUTO: cpu -> cpu (torch where its kernel cannot be built), cuda -> triton (torch where
    triton cannot be imported), xla -> ``xla_backend``."""
    xla_backend: BackendKind = BackendKind.XLA
    """What AUTO picks on an XLA device: XLA (laned torch ops) or PALLAS (Pallas TPU kernels)."""
    pallas_interpret: PallasInterpret = PallasInterpret.OFF
    """Interpret the Pallas kernels (CPU tests) instead of compiling for a TPU; HLO is the one usable on torch_xla."""
    dispatch_table: str | None = None
    """Path of a torch dispatch table JSON written by scripts/bench_kernels.py; None uses the shipped one."""
    block_size_table: str | None = None
    """Path of a Pallas block-size table JSON; None uses the shipped one."""
    torch_form: LoRAForm = LoRAForm.AUTO
    """Torch and cpu backends: AUTO picks per step; SEGMENTS, GROUPED, LANED (cpu backend: or FUSED) forces that form
    (to compare forms)."""
    fused_max_tokens: int = 128
    """cpu backend: AUTO takes the fused kernel for steps of at most this many tokens (beyond, MKL's matmuls per run
    win: prefill)."""
    triton_block_size_table: str | None = None
    """Path of a Triton block-size table JSON (scripts/bench_kernels.py --device cuda --tune); None: the shipped one."""
    bgmv_max_tokens: int = 64
    """triton backend: steps of at most this many tokens take the BGMV kernels (one token per program: decode, and
    the only form a captured step may take), longer ones the SGMV kernels over runs of equal slots (prefill)."""

    def __post_init__(self) -> None:
        if not isinstance(self.backend, BackendKind):
            raise ValueError(f"backend must be a BackendKind, got {self.backend!r}")
        if self.xla_backend not in (BackendKind.XLA, BackendKind.PALLAS):
            raise ValueError(f"xla_backend must be BackendKind.XLA or BackendKind.PALLAS, got {self.xla_backend!r}")
        if self.bgmv_max_tokens < 0:
            raise ValueError(f"bgmv_max_tokens must be >= 0, got {self.bgmv_max_tokens}")
        if not isinstance(self.pallas_interpret, PallasInterpret):
            raise ValueError(f"pallas_interpret must be a PallasInterpret, got {self.pallas_interpret!r}")
        if self.torch_form in set(LoRAForm):  # a plain string ("laned") becomes the enum member
            object.__setattr__(self, "torch_form", LoRAForm(self.torch_form))
        if self.torch_form not in _FORCIBLE_FORMS:
            raise ValueError(
                f"torch_form must be one of {', '.join(f.value for f in _FORCIBLE_FORMS)}, got {self.torch_form!r} "
                "(none and single are fast paths AUTO takes when a step allows them)"
            )
