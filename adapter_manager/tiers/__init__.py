"""The tiers an adapter lives in, bottom up: its repo in the HF cache (`disk`), prepared once into one row block
(`prepare`, `row_layout`) kept in the byte-bounded host tier (`host`), and the device row pool (`slot_pool`) whose
units the allocator hands out (`row_space`, `placement`, `lease`, `allocator`)."""

from .allocator import SlotAllocator
from .disk import DiskTier, DiskUsage
from .host import HostTier
from .lease import SlotLease, SlotState
from .prepare import ModuleWeights, PreparedAdapter, prepare_adapter
from .row_layout import ModuleColumns, RowLayout, RowOptions
from .row_space import Block, RowSpace
from .row_writers import map_shared
from .slot_pool import SlotPool, SlotPoolConfig, SlotStacks, bytes_needed, units_for

__all__ = [
    "Block",
    "DiskTier",
    "DiskUsage",
    "HostTier",
    "ModuleColumns",
    "ModuleWeights",
    "PreparedAdapter",
    "RowLayout",
    "RowOptions",
    "RowSpace",
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
]
