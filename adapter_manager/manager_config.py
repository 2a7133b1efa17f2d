"""What an `AdapterManager` is built from: one config, and the config of each component it builds."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from .policy.admission import SketchConfig
from .policy.prefetch import PrefetchConfig
from .registry import RegistryConfig
from .sources.hub import HubConfig
from .tiers.row_layout import RowOptions
from .tiers.row_writers import pins_host
from .tiers.slot_pool import SlotPoolConfig

_GIB = 1 << 30


@dataclass
class AdapterManagerConfig:
    """Everything the manager is built from."""

    max_slots: int | Literal["auto"] = 8  # pool rows for this many max-rank adapters; "auto": slot_memory_bytes
    rows: RowOptions = field(default_factory=RowOptions)  # what shapes the rows: R (the highest rank accepted), the
    # tensor-parallel plan (N sections per row, one per device), the vector and vocabulary columns; travels whole
    host_cache_bytes: int = 2 * _GIB  # byte bound of the host tier of prepared adapters
    device: torch.device | str = "cpu"  # serving device of the slot stacks: cpu, cuda[:i] or xla[:i]
    dtype: torch.dtype = torch.float32  # serving dtype of prepared weights and slots
    slot_memory_bytes: int | None = None  # with max_slots="auto": device bytes the row pool may take
    granule: int | None = None  # pool rows per unit (slot index step); None: min(8, rows.max_rank)
    prefetch_workers: int = 2  # prefetch threads; 0 turns prefetching off
    prefetch_depth: int = 16  # the most queued adapters not yet in a slot one prefetch call moves up the tiers
    prefetch_popular: int = 4  # the most popular adapters (TinyLFU) kept warm beside the queue; 0: none
    admission: Literal["tinylfu", "lru"] = "tinylfu"  # host/slot eviction and admission: popularity + recency, or LRU
    sketch: SketchConfig = field(default_factory=SketchConfig)  # the TinyLFU frequency sketch's size and aging
    base_model_mismatch: Literal["warn", "refuse"] = "warn"  # adapter trained on another base model
    allowed_local_roots: tuple[Path, ...] | None = None  # if set, local refs must lie under one of these
    hub: HubConfig = field(default_factory=HubConfig)  # how hub refs are downloaded (token, offline, cache, endpoint)
    state_dir: Path | None = None  # if set, registrations are stored durably here and restored when the manager starts
    disk_cache_bytes: int | None = None  # if set, byte bound on the manager's adapter repos in the HF cache (LRU)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        if self.admission not in ("tinylfu", "lru"):
            raise ValueError(f"admission must be 'tinylfu' or 'lru', got {self.admission!r}")
        if self.max_slots == "auto" and self.slot_memory_bytes is None:
            raise ValueError("max_slots='auto' needs slot_memory_bytes (the device bytes the slot stacks may take)")
        # Each component validates its own part; building them here reports a bad value before anything is made.
        self.pool_config()
        self.prefetch_config()
        self.registry_config()

    def pool_config(self) -> SlotPoolConfig:
        return SlotPoolConfig(self.max_slots, self.dtype, self.device, self.slot_memory_bytes, self.granule, self.rows)

    def prefetch_config(self) -> PrefetchConfig:
        return PrefetchConfig(self.prefetch_workers, self.prefetch_depth, self.prefetch_popular)

    def registry_config(self) -> RegistryConfig:
        return RegistryConfig(
            dtype=self.dtype,
            host_cache_bytes=self.host_cache_bytes,
            base_model_mismatch=self.base_model_mismatch,
            pin_memory=pins_host(self.device),
            allowed_local_roots=self.allowed_local_roots,
            hub=self.hub,
            state_dir=self.state_dir,
            disk_cache_bytes=self.disk_cache_bytes,
            rows=self.rows,
        )
