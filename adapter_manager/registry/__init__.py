"""What is registered: adapter records, the registry that validates and prepares them, and their durable store."""

from .records import AdapterRecord, RegisterResult, RegistryConfig, check_adapter_id
from .registry import AdapterRegistry
from .state_store import Registration, StateStore, UnrestoredAdapter

__all__ = [
    "AdapterRecord",
    "AdapterRegistry",
    "RegisterResult",
    "Registration",
    "RegistryConfig",
    "StateStore",
    "UnrestoredAdapter",
    "check_adapter_id",
]
