"""What the allocator hands out and reports: a batch's lease of pinned slots, and a plain copy of one range.

A `Residency` is the allocator's own record of one adapter's stay in one range (mutated only under its lock); a
`SlotLease` holds the residencies it pinned, and `SlotState` is a frozen copy for callers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..errors import AdapterNotPinnedError


@dataclass(eq=False)
class Residency:
    """One adapter's stay in one range of units, from reservation to the range being freed."""

    adapter_id: str
    slot: int  # first unit of the range
    rank: int  # rows the kernels read, from row slot * G on
    units: int  # units reserved: pool.units_for(rank)
    pins: int = 0  # leases holding it
    manual: bool = False  # operator pin
    ready: bool = False  # copy complete, published
    draining: bool = False  # unregistered while pinned or loading: freed at the last release
    nbytes: int = 0
    last_used: float = 0.0
    content: str = ""  # the content digest of the block loaded into it (`PreparedAdapter.digest`)
    vector: str | None = None  # how its vector row applies (`Variant.epilogue`: "bias", "scale"), None: no vector


@dataclass(frozen=True)
class SlotState:
    """A plain copy of one occupied range."""

    slot: int  # first unit; rows [slot * G, slot * G + rank)
    adapter_id: str
    state: Literal["loading", "ready", "draining"]
    units: int  # units the range takes (a power of two)
    rank: int  # rows the kernels read
    pins: int  # in-flight batches holding it
    manual: bool  # pinned by an operator
    nbytes: int  # bytes moved host -> slot when it was loaded
    last_used: float  # clock() of the last acquire or release


@dataclass(frozen=True, eq=False)
class SlotLease:
    """The pinned slots of one batch; hand it back to `SlotAllocator.release` exactly once."""

    lease_id: int
    slots: Mapping[str, int]  # adapter id -> slot, stable until released
    slot_rows: Mapping[int, int]  # slot -> the adapter's rank: rows [slot * G, slot * G + rank) hold it
    slot_vectors: Mapping[int, str]  # slot -> how its vector row applies ("bias", "scale"), for slots that have one
    _entries: tuple[Residency, ...] = field(repr=False)

    @property
    def contents(self) -> Mapping[str, str]:
        """Adapter id -> the content digest its pinned slot holds: what the batch's tokens are computed with."""
        return {r.adapter_id: r.content for r in self._entries}

    def slot_indices(
        self, adapter_ids: Sequence[str | None], pad_to: int | None = None, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Per-token slot indices, int32, -1 for tokens without an adapter (and for padding up to `pad_to`).

        Shape: adapter_ids [T]; returns [pad_to or T], built on the host and moved whole to `device`.
        """
        size = len(adapter_ids) if pad_to is None else pad_to
        if size < len(adapter_ids):
            raise ValueError(f"pad_to ({pad_to}) is smaller than the number of tokens ({len(adapter_ids)})")
        values = []
        for adapter_id in adapter_ids:
            if adapter_id is None:
                values.append(-1)
            elif adapter_id in self.slots:
                values.append(self.slots[adapter_id])
            else:
                raise AdapterNotPinnedError(adapter_id, f"not pinned by lease {self.lease_id}")
        indices = torch.tensor(values + [-1] * (size - len(values)), dtype=torch.int32)  # [T]
        return indices if device is None else indices.to(device)


def state_of(r: Residency) -> SlotState:
    state = "draining" if r.draining else "ready" if r.ready else "loading"
    return SlotState(r.slot, r.adapter_id, state, r.units, r.rank, r.pins, r.manual, r.nbytes, r.last_used)
