"""Adapter lifecycle: hub resolution, PEFT validation, host preparation, host tier, metrics, local hub."""

from .base_model import PROJECTIONS, BaseModelSpec, ModuleKey
from .errors import (
    AdapterAccessError,
    AdapterConfigError,
    AdapterConflictError,
    AdapterError,
    AdapterFormatError,
    AdapterNotFoundError,
    AdapterRevisionNotFoundError,
    BaseModelMismatchError,
    CorruptWeightsError,
    HubUnavailableError,
    InvalidAdapterRefError,
    NonFiniteWeightsError,
    PickleRefusedError,
    RankTooLargeError,
    TensorKeyError,
    TensorShapeError,
    UnsupportedAdapterError,
)
from .host_tier import HostTier
from .hub import AdapterFiles, AdapterRef, HubConfig
from .metrics import MetricsSnapshot, SwapMetrics, Tier, TierMove, TierStats
from .peft_format import LoraAdapterConfig, ModuleLora
from .prepare import ModuleWeights, PreparedAdapter, prepare_adapter
from .registry import AdapterRecord, AdapterRegistry, RegisterResult, RegistryConfig
from .synthetic import write_synthetic_adapter

__all__ = [
    "PROJECTIONS",
    "AdapterAccessError",
    "AdapterConfigError",
    "AdapterConflictError",
    "AdapterError",
    "AdapterFiles",
    "AdapterFormatError",
    "AdapterNotFoundError",
    "AdapterRecord",
    "AdapterRef",
    "AdapterRegistry",
    "AdapterRevisionNotFoundError",
    "BaseModelMismatchError",
    "BaseModelSpec",
    "CorruptWeightsError",
    "HostTier",
    "HubConfig",
    "HubUnavailableError",
    "InvalidAdapterRefError",
    "LoraAdapterConfig",
    "MetricsSnapshot",
    "ModuleKey",
    "ModuleLora",
    "ModuleWeights",
    "NonFiniteWeightsError",
    "PickleRefusedError",
    "PreparedAdapter",
    "RankTooLargeError",
    "RegisterResult",
    "RegistryConfig",
    "SwapMetrics",
    "TensorKeyError",
    "TensorShapeError",
    "Tier",
    "TierMove",
    "TierStats",
    "UnsupportedAdapterError",
    "prepare_adapter",
    "write_synthetic_adapter",
]
