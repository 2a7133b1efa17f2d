"""Shrink/expand LoRA kernels and their batch metadata."""

from kernels.backend import KernelBackend, select_backend
from kernels.config import BackendKind, KernelConfig
from kernels.dispatch_table import DispatchEntry, TorchDispatchTable
from kernels.meta import LoRAKernelMeta, SlotGrouping
from kernels.ops import expand, shrink

__all__ = [
    "BackendKind",
    "DispatchEntry",
    "KernelBackend",
    "KernelConfig",
    "LoRAKernelMeta",
    "SlotGrouping",
    "TorchDispatchTable",
    "expand",
    "select_backend",
    "shrink",
]
