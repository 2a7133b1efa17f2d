"""Where adapters come from: hub refs and local directories (`hub`), the PEFT format read exactly as peft does
(`peft_format`), synthetic PEFT adapters for tests and benchmarks, and the local hub that serves a folder over the
Hub HTTP API on loopback."""

from .hub import AdapterFiles, AdapterRef, HubConfig, HubResolver, is_local_ref
from .local_hub import HubFault, LocalHub
from .peft_format import CONFIG_NAME, WEIGHTS_NAME, LoraAdapterConfig, ModuleLora, Variant
from .synthetic import write_synthetic_adapter

__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "AdapterFiles",
    "AdapterRef",
    "HubConfig",
    "HubFault",
    "HubResolver",
    "LocalHub",
    "LoraAdapterConfig",
    "ModuleLora",
    "Variant",
    "is_local_ref",
    "write_synthetic_adapter",
]
