"""Adapter lifecycle: hub resolution, PEFT validation, host preparation, host tier, slot pool and allocator,
prefetcher, metrics, local hub. The Prometheus collector is in `adapter_manager.prometheus` (it imports
prometheus_client, which the rest does not need)."""

from .admission import FrequencySketch, SketchConfig
from .allocator import SlotAllocator, SlotLease, SlotState
from .base_model import PROJECTIONS, BaseModelSpec, ModuleKey
from .disk_tier import DiskTier, DiskUsage
from .errors import (
    AdapterAccessError,
    AdapterConfigError,
    AdapterConflictError,
    AdapterError,
    AdapterFormatError,
    AdapterNotFoundError,
    AdapterNotPinnedError,
    AdapterRevisionNotFoundError,
    BaseModelMismatchError,
    CorruptWeightsError,
    HubUnavailableError,
    InvalidAdapterRefError,
    NonFiniteWeightsError,
    PickleRefusedError,
    RankTooLargeError,
    SlotLoadError,
    SlotsExhaustedError,
    TensorKeyError,
    TensorShapeError,
    UnsupportedAdapterError,
)
from .host_tier import HostTier
from .hub import AdapterFiles, AdapterRef, HubConfig, is_local_ref
from .local_hub import HubFault, LocalHub
from .manager import AdapterManager, AdapterManagerConfig
from .metrics import AdapterMove, AdapterResidency, MetricsSnapshot, Move, MoveStats, SwapMetrics, Tier, WaitStats
from .peft_format import LoraAdapterConfig, ModuleLora
from .prefetch import PrefetchConfig, Prefetcher
from .prepare import ModuleWeights, PreparedAdapter, prepare_adapter
from .registry import (
    AdapterRecord,
    AdapterRegistry,
    RegisterResult,
    RegistryConfig,
    check_adapter_id,
)
from .row_layout import ModuleColumns, RowLayout
from .slot_pool import SlotPool, SlotPoolConfig, SlotStacks, bytes_needed, units_for
from .state_store import Registration, StateStore, UnrestoredAdapter
from .synthetic import write_synthetic_adapter
from .workers import background_executor

__all__ = [
    "FrequencySketch",
    "SketchConfig",
    "PROJECTIONS",
    "AdapterAccessError",
    "AdapterConfigError",
    "AdapterConflictError",
    "AdapterError",
    "AdapterFiles",
    "AdapterFormatError",
    "AdapterManager",
    "AdapterManagerConfig",
    "AdapterMove",
    "AdapterNotFoundError",
    "AdapterNotPinnedError",
    "AdapterRecord",
    "AdapterRef",
    "AdapterRegistry",
    "AdapterResidency",
    "AdapterRevisionNotFoundError",
    "BaseModelMismatchError",
    "BaseModelSpec",
    "CorruptWeightsError",
    "DiskTier",
    "DiskUsage",
    "HostTier",
    "HubConfig",
    "HubFault",
    "HubUnavailableError",
    "InvalidAdapterRefError",
    "LocalHub",
    "LoraAdapterConfig",
    "MetricsSnapshot",
    "ModuleKey",
    "ModuleLora",
    "ModuleColumns",
    "ModuleWeights",
    "Move",
    "MoveStats",
    "NonFiniteWeightsError",
    "PickleRefusedError",
    "PrefetchConfig",
    "Prefetcher",
    "PreparedAdapter",
    "RankTooLargeError",
    "RegisterResult",
    "Registration",
    "RowLayout",
    "RegistryConfig",
    "SlotAllocator",
    "SlotLease",
    "SlotLoadError",
    "SlotPool",
    "SlotPoolConfig",
    "SlotStacks",
    "SlotState",
    "SlotsExhaustedError",
    "StateStore",
    "SwapMetrics",
    "TensorKeyError",
    "TensorShapeError",
    "Tier",
    "UnrestoredAdapter",
    "UnsupportedAdapterError",
    "WaitStats",
    "background_executor",
    "bytes_needed",
    "check_adapter_id",
    "is_local_ref",
    "prepare_adapter",
    "units_for",
    "write_synthetic_adapter",
]
