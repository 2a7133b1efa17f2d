"""Shrink/expand LoRA kernels and their batch metadata."""

from kernels.backend import KernelBackend, select_backend
from kernels.config import BackendKind, KernelConfig, PallasInterpret
from kernels.dispatch_table import DispatchEntry, TorchDispatchTable
from kernels.meta import LoRAKernelMeta, SlotGrouping
from kernels.ops import expand, shrink

__all__ = [
    "BackendKind",
    "DispatchEntry",
    "KernelBackend",
    "KernelConfig",
    "LoRAKernelMeta",
    "PallasInterpret",
    "SlotGrouping",
    "TorchDispatchTable",
    "expand",
    "select_backend",
    "shrink",
]
