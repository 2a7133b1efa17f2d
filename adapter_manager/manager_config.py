"""What an `AdapterManager` is built from: one config, and the config of each component it builds."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from .base_model import MAX_RANK
from .policy.admission import SketchConfig
from .policy.prefetch import PrefetchConfig
from .registry import RegistryConfig
from .sources.hub import HubConfig
from .tiers.row_writers import pins_host
from .tiers.slot_pool import SlotPoolConfig

_GIB = 1 << 30


@dataclass
class AdapterManagerConfig:
    """Everything the manager is built from."""

    max_slots: int | Literal["auto"] = 8  # pool rows for this many max-rank adapters; "auto": slot_memory_bytes
    max_rank: int = MAX_RANK  # R: highest rank accepted; an adapter takes pool rows in proportion to its own rank
    host_cache_bytes: int = 2 * _GIB  # byte bound of the host tier of prepared adapters
    device: torch.device | str = "cpu"  # serving device of the slot stacks: cpu, cuda[:i] or xla[:i]
    dtype: torch.dtype = torch.float32  # serving dtype of prepared weights and slots
    slot_memory_bytes: int | None = None  # with max_slots="auto": device bytes the row pool may take
    granule: int | None = None  # pool rows per unit (slot index step); None: min(8, max_rank)
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
    tensor_parallel_size: int = 1  # N: the pool's rows split in N sections, one per device (the model's N-way TP)
    lora_vectors: bool = True  # a vector row per slot: DoRA and lora_bias adapters are served (not with N > 1)
    lora_vocab: bool = False  # the rows' vocabulary columns: embedding / lm_head LoRA, trainable tokens (N = 1 only)
    fully_sharded_loras: bool = False  # N > 1: every A and Bt split N ways too, one all-reduce per linear (vLLM's name)

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
        return SlotPoolConfig(
            self.max_slots,
            self.max_rank,
            self.dtype,
            self.device,
            self.slot_memory_bytes,
            self.granule,
            self.tensor_parallel_size,
            self.lora_vectors,
            self.lora_vocab,
            self.fully_sharded_loras,
        )

    def prefetch_config(self) -> PrefetchConfig:
        return PrefetchConfig(self.prefetch_workers, self.prefetch_depth, self.prefetch_popular)

    def registry_config(self) -> RegistryConfig:
        return RegistryConfig(
            max_rank=self.max_rank,
            dtype=self.dtype,
            host_cache_bytes=self.host_cache_bytes,
            base_model_mismatch=self.base_model_mismatch,
            pin_memory=pins_host(self.device),
            allowed_local_roots=self.allowed_local_roots,
            hub=self.hub,
            state_dir=self.state_dir,
            disk_cache_bytes=self.disk_cache_bytes,
            tensor_parallel_size=self.tensor_parallel_size,
            lora_vectors=self.lora_vectors,
            lora_vocab=self.lora_vocab,
            fully_sharded_loras=self.fully_sharded_loras,
        )
