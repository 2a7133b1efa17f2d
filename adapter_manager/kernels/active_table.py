"""The compact active table: the step's distinct active slots renumbered 0..k-1 and padded to an active bucket A.

The traced kernels (and the eager grouped-padded and laned forms) never touch the whole row pool: they gather the
A·R rows of the active adapters (``gather_rows``) and address them by compact id (``token_compact``). A compact slot c
owns lanes ``[c·R, (c+1)·R)``; lanes past its rank, and every lane of a padding compact slot, gather the pool's zero
row. Built on the host; the traced graph depends only on (T, A).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from adapter_manager.kernels.grouping import AdapterRows


def default_active_buckets(num_slots: int) -> tuple[int, ...]:
    """Powers of 4 below ``num_slots``, then ``num_slots``: S = 256 -> (1, 4, 16, 64, 256); S = 6 -> (1, 4, 6)."""
    buckets, width = [], 1
    while width < num_slots:
        buckets.append(width)
        width *= 4
    return (*buckets, num_slots)


def check_active_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    """``buckets`` as a tuple, or ValueError unless they are positive ints, strictly ascending."""
    values = tuple(buckets)
    if not values or any(not isinstance(b, int) or b < 1 for b in values):
        raise ValueError(f"active_buckets must be positive ints, got {values!r}")
    if any(a >= b for a, b in zip(values, values[1:], strict=False)):
        raise ValueError(f"active_buckets must be strictly ascending, got {values!r}")
    return values


def bucket_for(num_active: int, buckets: tuple[int, ...]) -> int:
    """A, the smallest bucket ≥ ``num_active`` (the smallest bucket when no slot is active)."""
    for width in buckets:
        if width >= num_active:
            return width
    raise ValueError(f"the step has {num_active} active slots, more than the largest active bucket {buckets[-1]}")


@dataclass(frozen=True)
class CompactTable:
    """One step's compact table, on the host until the metadata moves it whole to the device."""

    gather_rows: torch.Tensor
    """Shape: [A·R] int64: ``s_c·G + j`` where j < r_{s_c}, else the zero row."""
    token_compact: torch.Tensor
    """Shape: [T] int32: each token's compact id, -1 for no adapter."""

    @classmethod
    def build(
        cls, token_compact: np.ndarray, adapters: tuple[AdapterRows, ...], width: int, rank: int, zero_row: int
    ) -> CompactTable:
        """``token_compact``: Shape: [T] int32; ``adapters``: the active slots, ascending, k ≤ ``width``."""
        gather = np.full((width, rank), zero_row, dtype=np.int64)
        for c, adapter in enumerate(adapters):
            gather[c, : adapter.rank] = np.arange(adapter.first, adapter.first + adapter.rank)
        return cls(torch.from_numpy(gather.reshape(-1)), torch.from_numpy(token_compact))


def compact_ids(host_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(active [k] slots ascending, their token counts [k], token_compact [T] int32) of slot indices [T] (host)."""
    values, inverse, counts = np.unique(host_slots, return_inverse=True, return_counts=True)
    skip = int(values[0] < 0)  # the -1 entry, if any, sorts first
    compact = (inverse.reshape(-1) - skip).astype(np.int32)  # -1 tokens map to -1, the rest to their compact id
    return values[skip:], counts[skip:], compact
