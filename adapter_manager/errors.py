"""Typed errors raised at the adapter manager's public boundaries.

Every error names the adapter it concerns; messages name the file, tensor key or field and show expected vs got.
"""

from __future__ import annotations


class AdapterError(Exception):
    """Base of every error about one adapter."""

    def __init__(self, adapter: str, message: str) -> None:
        super().__init__(f"adapter {adapter!r}: {message}")
        self.adapter = adapter


class InvalidAdapterRefError(AdapterError, ValueError):
    """The reference or id is malformed (bad characters, path traversal, bad revision)."""


class AdapterNotFoundError(AdapterError, LookupError):
    """No such adapter: not registered, not on the hub, or no such local directory."""


class AdapterRevisionNotFoundError(AdapterNotFoundError):
    """The repository exists but the requested revision (branch, tag or sha) does not."""


class AdapterAccessError(AdapterError, PermissionError):
    """The hub refused access (401/403): private or gated repository, bad or missing token."""


class HubUnavailableError(AdapterError, ConnectionError):
    """The hub could not be reached or kept failing (5xx, timeouts) after retries, or offline with a cold cache."""


class AdapterConflictError(AdapterError, ValueError):
    """The adapter id is already registered for a different source; unregister it first."""


class AdapterFormatError(AdapterError, ValueError):
    """The adapter's files are not a servable PEFT LoRA adapter. Subclasses say why."""


class PickleRefusedError(AdapterFormatError):
    """The adapter ships pickle weights (.bin/.pt); they are never unpickled."""


class AdapterConfigError(AdapterFormatError):
    """adapter_config.json is missing, not JSON, or has a field of the wrong type or value."""


class UnsupportedAdapterError(AdapterFormatError):
    """A valid PEFT adapter using a feature this server does not apply (DoRA, bias, embedding LoRA, ...)."""


class RankTooLargeError(AdapterFormatError):
    """A module's rank exceeds the manager's max_rank."""


class TensorKeyError(AdapterFormatError):
    """A tensor key is unknown or unexpected, or an expected lora_A/lora_B tensor is missing."""


class TensorShapeError(AdapterFormatError):
    """A tensor's shape or dtype does not fit the base model and the adapter's rank."""


class NonFiniteWeightsError(AdapterFormatError):
    """A tensor holds NaN or infinity."""


class CorruptWeightsError(AdapterFormatError):
    """adapter_model.safetensors is missing, truncated or not a safetensors file."""


class BaseModelMismatchError(AdapterFormatError):
    """The adapter was trained on a different base model and the policy is to refuse."""


class SlotsExhaustedError(AdapterError, RuntimeError):
    """A call needs more pool units than it can get: too few free plus evictable units, or enough in total but no
    free range large enough even after evicting every evictable adapter (fragmentation). Nothing was changed.

    The scheduler can act on it: run a smaller batch, or wait for in-flight batches to release their ranges.
    """

    def __init__(self, adapters: tuple[str, ...], needed: int, free: int, evictable: int, num_units: int) -> None:
        available = free + evictable
        if needed > available:
            why = (
                f"needs {needed} unit(s) but only {available} of {num_units} are free ({free}) or evictable "
                f"({evictable}); the others hold adapters pinned by in-flight batches or operators, wanted by this "
                "call, or loading"
            )
        else:
            why = (
                f"needs {needed} unit(s) and {available} of {num_units} are free ({free}) or evictable "
                f"({evictable}), but no free range is large enough even after evicting every evictable adapter "
                "(fragmentation: pinned or loading adapters split the free units)"
            )
        super().__init__(", ".join(adapters), why)
        self.adapters = adapters
        self.needed = needed
        self.free = free
        self.evictable = evictable
        self.available = available
        self.num_units = num_units

    @property
    def fragmented(self) -> bool:
        """Enough free plus evictable units in total, but no range large enough."""
        return self.needed <= self.available


class DiskTierFullError(AdapterError, RuntimeError):
    """The bounded disk tier has no room for the adapter's download: the rest is held by repos being read or
    downloaded. Nothing was downloaded; a later attempt may find room."""


class AdapterNotReadyError(AdapterError, RuntimeError):
    """The adapter is not prepared on the host: placing it now would mean a download or a preparation inside the
    engine step. The engine puts its request back to wait while the prefetcher prepares it; it never fails one."""


class SlotLoadError(AdapterError, RuntimeError):
    """Copying prepared weights into a device slot failed; the slot was left free, never published."""


class AdapterNotPinnedError(AdapterError, RuntimeError):
    """Unpin or release of an adapter (or lease) that is not pinned: a double release or a pin that never was."""
