"""Shrink/expand LoRA kernels and their batch metadata."""

from kernels.backend import select_backend
from kernels.config import BackendKind, KernelConfig, LoRAForm, PallasInterpret
from kernels.dispatch_table import DispatchEntry, TorchDispatchTable
from kernels.grouping import AdapterRows, Segment, SlotGrouping
from kernels.meta import LoRAKernelMeta
from kernels.ops import apply_parts, expand, shrink, shrink_parts
from kernels.protocol import EagerBackend, KernelBackend

__all__ = [
    "AdapterRows",
    "BackendKind",
    "DispatchEntry",
    "EagerBackend",
    "KernelBackend",
    "KernelConfig",
    "LoRAForm",
    "LoRAKernelMeta",
    "PallasInterpret",
    "Segment",
    "SlotGrouping",
    "TorchDispatchTable",
    "apply_parts",
    "expand",
    "select_backend",
    "shrink",
    "shrink_parts",
]
