"""The cpu backend's room: the backend (the torch forms plus one C++ call per fused linear), its C++ library (built
and loaded on first use), the linear ops on each weight layout, the base weights' packing and the decode glue ops."""

from adapter_manager.kernels.cpu import decode_ops, layout_choice, weights
from adapter_manager.kernels.cpu.backend import CpuFusedBackend
from adapter_manager.kernels.cpu.library import cache_dir, load, unavailable_reason
from adapter_manager.kernels.cpu.linear_ops import (
    BLOCK,
    LINEAR_MAX_TOKENS,
    block_weight,
    fixed_linear,
    lora_apply,
    lora_blocked,
    lora_linear,
    lora_onednn,
    unblock_weight,
)

__all__ = [
    "BLOCK",
    "LINEAR_MAX_TOKENS",
    "CpuFusedBackend",
    "block_weight",
    "cache_dir",
    "decode_ops",
    "fixed_linear",
    "layout_choice",
    "load",
    "lora_apply",
    "lora_blocked",
    "lora_linear",
    "lora_onednn",
    "unavailable_reason",
    "unblock_weight",
    "weights",
]
