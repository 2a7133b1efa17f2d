"""Shrink/expand LoRA kernels and their batch metadata."""

from kernels.backend import select_backend
from kernels.config import BackendKind, KernelConfig, LoRAForm, PallasInterpret
from kernels.dispatch_table import DispatchEntry, TorchDispatchTable
from kernels.grouping import AdapterRows, Segment, SlotGrouping
from kernels.meta import LoRAKernelMeta
from kernels.ops import apply_parts, expand, fused_linear, shrink, shrink_parts
from kernels.protocol import EagerBackend, KernelBackend, LinearWeight, LoRAGroups, WeightLayout

__all__ = [
    "AdapterRows",
    "BackendKind",
    "DispatchEntry",
    "EagerBackend",
    "KernelBackend",
    "KernelConfig",
    "LinearWeight",
    "LoRAForm",
    "LoRAGroups",
    "LoRAKernelMeta",
    "PallasInterpret",
    "Segment",
    "SlotGrouping",
    "TorchDispatchTable",
    "WeightLayout",
    "apply_parts",
    "expand",
    "fused_linear",
    "select_backend",
    "shrink",
    "shrink_parts",
]
