"""In-memory stand-ins for the tiers' inputs: prepared adapters built from a number, and a catalog of them that plays
the registry for a `SlotAllocator` (rank lookups, fetches, injected failures, a fetch delay)."""

from __future__ import annotations

import time

import torch

from adapter_manager import AdapterNotFoundError, BaseModelSpec, ModuleKey, RowOptions
from adapter_manager.tiers.allocator import SlotAllocator
from adapter_manager.tiers.prepare import ModuleWeights, PreparedAdapter
from adapter_manager.tiers.row_layout import RowLayout
from adapter_manager.tiers.slot_pool import SlotPool, SlotPoolConfig


def make_prepared(
    spec: BaseModelSpec,
    adapter_id: str,
    rank: int,
    value: float,
    modules: list[ModuleKey] | None = None,
    dtype: torch.dtype = torch.float32,
) -> PreparedAdapter:
    """An in-memory prepared adapter of rank `rank`: row i of every targeted A is `value + i/16`, of every Bt its
    negation; untargeted modules are zero (cheap to build, and a row or module mix-up shows)."""
    layout = RowLayout.of(spec)
    modules = spec.module_keys() if modules is None else modules
    storage = torch.zeros(rank, layout.width, dtype=dtype)  # [r, width]
    rows = (value + torch.arange(rank, dtype=torch.float64) / 16).to(dtype)[:, None]  # [r, 1]
    weights = {}
    for module in modules:
        a, bt = layout.a_view(storage, module), layout.bt_view(storage, module)
        a.copy_(rows.expand_as(a))
        bt.copy_(-rows.expand_as(bt))
        weights[module] = ModuleWeights(a=a, bt=bt, rank=rank)
    return PreparedAdapter(adapter_id, f"sha-{adapter_id}", weights, storage)


def prepared(key: str, nbytes: int) -> PreparedAdapter:
    """A prepared adapter that is only its size (no modules): what the host tier counts."""
    return PreparedAdapter(key, "sha", {}, torch.zeros(1, nbytes, dtype=torch.uint8))  # [1, nbytes]


class Catalog:
    """In-memory prepared adapters by id; `rank_of` reads their rank; `fail` makes the next fetch of an id raise."""

    def __init__(self, spec) -> None:
        self.spec = spec
        self.adapters: dict[str, PreparedAdapter] = {}
        self.ranks: dict[str, int] = {}
        self.fail: set[str] = set()
        self.fetches: list[str] = []
        self.delay = 0.0

    def add(self, *ids: str, rank: int = 4) -> None:
        for i, adapter_id in enumerate(ids, start=len(self.adapters) + 1):
            self.adapters[adapter_id] = make_prepared(self.spec, adapter_id, rank, float(i))
            self.ranks[adapter_id] = rank

    def rank_of(self, adapter_id: str) -> int:
        if adapter_id not in self.ranks:
            raise AdapterNotFoundError(adapter_id, "not registered")
        return self.ranks[adapter_id]

    def __call__(self, adapter_id: str) -> PreparedAdapter:
        self.fetches.append(adapter_id)
        time.sleep(self.delay)
        if adapter_id in self.fail:
            self.fail.discard(adapter_id)
            raise OSError(f"injected failure reading {adapter_id}")
        return self.adapters[adapter_id]

    def stage(self, adapter_id: str, keep=(), ceiling=None, wait: bool = True) -> bool:
        """The registry's `stage` over the catalog: always room, one fetch."""
        self(adapter_id)
        return True


def allocator_for(spec, catalog, slots: int = 2, granule: int = 4) -> SlotAllocator:
    """max_rank 4; granule 4: every rank takes one unit; granule 1: ranks 1, 2, 3-4 take 1, 2, 4 units."""
    pool = SlotPool(spec, SlotPoolConfig(max_slots=slots, rows=RowOptions(max_rank=4), granule=granule))
    return SlotAllocator(pool, catalog, catalog.rank_of)
