"""Adapter lifecycle, in rooms: `sources` (hub refs, the PEFT format, the local hub), `registry` (records, validation,
durable state), `tiers` (disk, host, the row pool and its allocator), `policy` (admission, prefetch, workers), and
`metrics`; `AdapterManager` is the facade over all of them. The Prometheus collector is in
`adapter_manager.prometheus` (it imports prometheus_client, which the rest does not need).

The names below load on first use (PEP 562), so importing the package (and the CLI, whose SIGTERM handler must be
in place before torch loads) costs nothing until one is used."""

# ruff: noqa: F401 - the imports under TYPE_CHECKING are for type checkers; the names load lazily below
from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy_names import lazy_names

if TYPE_CHECKING:
    from .base_model import PROJECTIONS, BaseModelSpec, ModuleKey
    from .errors import (
        AdapterAccessError,
        AdapterConfigError,
        AdapterConflictError,
        AdapterError,
        AdapterFormatError,
        AdapterNotFoundError,
        AdapterNotPinnedError,
        AdapterNotReadyError,
        AdapterRevisionNotFoundError,
        BaseModelMismatchError,
        CorruptWeightsError,
        DiskTierFullError,
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
    from .manager import AdapterManager
    from .manager_config import AdapterManagerConfig
    from .metrics import AdapterMove, AdapterResidency, MetricsSnapshot, Move, MoveStats, SwapMetrics, Tier, WaitStats
    from .policy import FrequencySketch, PrefetchConfig, Prefetcher, SketchConfig, background_executor
    from .registry import (
        AdapterRecord,
        AdapterRegistry,
        RegisterResult,
        Registration,
        RegistryConfig,
        StateStore,
        UnrestoredAdapter,
        check_adapter_id,
    )
    from .sharding import TensorParallel
    from .sources import (
        AdapterFiles,
        AdapterRef,
        HubConfig,
        HubFault,
        LocalHub,
        LoraAdapterConfig,
        ModuleLora,
        Variant,
        is_local_ref,
        write_synthetic_adapter,
    )
    from .tiers import (
        DiskTier,
        DiskUsage,
        HostTier,
        ModuleColumns,
        ModuleWeights,
        PreparedAdapter,
        RowLayout,
        RowOptions,
        SlotAllocator,
        SlotLease,
        SlotPool,
        SlotPoolConfig,
        SlotStacks,
        SlotState,
        bytes_needed,
        map_shared,
        prepare_adapter,
        units_for,
    )

_EXPORTS: dict[str, tuple[str, ...]] = {  # submodule -> the names it gives the package
    "base_model": ("PROJECTIONS", "BaseModelSpec", "ModuleKey"),
    "errors": (
        "AdapterAccessError",
        "AdapterConfigError",
        "AdapterConflictError",
        "AdapterError",
        "AdapterFormatError",
        "AdapterNotFoundError",
        "AdapterNotPinnedError",
        "AdapterNotReadyError",
        "AdapterRevisionNotFoundError",
        "BaseModelMismatchError",
        "CorruptWeightsError",
        "DiskTierFullError",
        "HubUnavailableError",
        "InvalidAdapterRefError",
        "NonFiniteWeightsError",
        "PickleRefusedError",
        "RankTooLargeError",
        "SlotLoadError",
        "SlotsExhaustedError",
        "TensorKeyError",
        "TensorShapeError",
        "UnsupportedAdapterError",
    ),
    "manager": ("AdapterManager",),
    "manager_config": ("AdapterManagerConfig",),
    "metrics": (
        "AdapterMove",
        "AdapterResidency",
        "MetricsSnapshot",
        "Move",
        "MoveStats",
        "SwapMetrics",
        "Tier",
        "WaitStats",
    ),
    "policy": ("FrequencySketch", "PrefetchConfig", "Prefetcher", "SketchConfig", "background_executor"),
    "registry": (
        "AdapterRecord",
        "AdapterRegistry",
        "RegisterResult",
        "Registration",
        "RegistryConfig",
        "StateStore",
        "UnrestoredAdapter",
        "check_adapter_id",
    ),
    "sharding": ("TensorParallel",),
    "sources": (
        "AdapterFiles",
        "AdapterRef",
        "HubConfig",
        "HubFault",
        "LocalHub",
        "LoraAdapterConfig",
        "ModuleLora",
        "Variant",
        "is_local_ref",
        "write_synthetic_adapter",
    ),
    "tiers": (
        "DiskTier",
        "DiskUsage",
        "HostTier",
        "ModuleColumns",
        "ModuleWeights",
        "PreparedAdapter",
        "RowLayout",
        "RowOptions",
        "SlotAllocator",
        "SlotLease",
        "SlotPool",
        "SlotPoolConfig",
        "SlotStacks",
        "SlotState",
        "bytes_needed",
        "map_shared",
        "prepare_adapter",
        "units_for",
    ),
}
__all__, __getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
