"""Shrink/expand LoRA kernels, their batch metadata, and the model's other ops: the model names an op, the step's
backend (or the room of the tensors' device) picks its implementation."""

from adapter_manager.kernels.active_table import bucket_for
from adapter_manager.kernels.backend import select_backend
from adapter_manager.kernels.config import BackendKind, KernelConfig, LoRAForm, PallasInterpret
from adapter_manager.kernels.cpu.machine import cpu_flags, cpu_model, has_fast_bf16
from adapter_manager.kernels.device_kernels import LayerKernels
from adapter_manager.kernels.dispatch_table import DispatchEntry, TorchDispatchTable
from adapter_manager.kernels.executor import LinearExecutor, LinearStep, TracedExecutor
from adapter_manager.kernels.grouping import AdapterRows, Segment, SlotGrouping
from adapter_manager.kernels.layer_ops import (
    base_linear,
    choose_weight_layout,
    decode_ops,
    layer_kernels,
    pack_weight,
    packs_by_default,
    paged_attention,
    plain_matmul,
    quantize_weight,
    unpack_weight,
)
from adapter_manager.kernels.linear_lora import LinearLoRA, LinearShards, ProcessShard, ShardForm, ShardHooks, Stacks
from adapter_manager.kernels.meta import LoRAKernelMeta
from adapter_manager.kernels.ops import apply_parts, expand, shrink, shrink_parts
from adapter_manager.kernels.platform import Platform, platform_for
from adapter_manager.kernels.protocol import (
    DecodeCapture,
    DecodeOps,
    EagerBackend,
    KernelBackend,
    LinearWeight,
    LoRAGroups,
    WeightLayout,
)
from adapter_manager.kernels.vocab import embed_lora, head_lora

__all__ = [
    "AdapterRows",
    "BackendKind",
    "DecodeCapture",
    "DecodeOps",
    "DispatchEntry",
    "EagerBackend",
    "KernelBackend",
    "KernelConfig",
    "LayerKernels",
    "LinearExecutor",
    "LinearLoRA",
    "LinearShards",
    "LinearStep",
    "LinearWeight",
    "LoRAForm",
    "LoRAGroups",
    "LoRAKernelMeta",
    "PallasInterpret",
    "Platform",
    "ProcessShard",
    "Segment",
    "ShardForm",
    "ShardHooks",
    "SlotGrouping",
    "Stacks",
    "TracedExecutor",
    "TorchDispatchTable",
    "WeightLayout",
    "apply_parts",
    "base_linear",
    "choose_weight_layout",
    "cpu_flags",
    "cpu_model",
    "bucket_for",
    "decode_ops",
    "embed_lora",
    "expand",
    "layer_kernels",
    "has_fast_bf16",
    "head_lora",
    "pack_weight",
    "packs_by_default",
    "paged_attention",
    "plain_matmul",
    "platform_for",
    "quantize_weight",
    "select_backend",
    "shrink",
    "shrink_parts",
    "unpack_weight",
]
