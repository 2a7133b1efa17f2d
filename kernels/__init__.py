"""Shrink/expand LoRA kernels and their batch metadata."""

from kernels.backend import select_backend
from kernels.config import BackendKind, KernelConfig, LoRAForm, PallasInterpret
from kernels.dispatch_table import DispatchEntry, TorchDispatchTable
from kernels.meta import LoRAKernelMeta, SlotGrouping
from kernels.ops import expand, shrink
from kernels.protocol import EagerBackend, KernelBackend

__all__ = [
    "BackendKind",
    "DispatchEntry",
    "EagerBackend",
    "KernelBackend",
    "KernelConfig",
    "LoRAForm",
    "LoRAKernelMeta",
    "PallasInterpret",
    "SlotGrouping",
    "TorchDispatchTable",
    "expand",
    "select_backend",
    "shrink",
]
