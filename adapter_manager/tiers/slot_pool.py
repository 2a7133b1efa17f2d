"""The slot pool: one preallocated device tensor of rank rows, ``rows [N, width]``, in the row layout of prepared
adapters (`row_layout.RowLayout`), and per module the strided views the kernels read.

Rows are handed out in units of ``granule`` rows. A slot is the index of a unit: slot ``s`` starts at row
``s * granule``; an adapter of rank r loaded there takes rows ``[s*G, s*G + r)`` and, for allocation, the
``units_for(r)`` units from ``s`` on (a power of two, so a buddy allocator packs them). Which slots hold which
adapter, and when a slot may be published to the kernels, is the allocator's business (`allocator.py`). The last row
(``zero_row``) is never written: it stays zero, for the kernels to pad gathers with.

    Worked example, G = 8, 4 units (N = 33 rows): a rank-16 adapter at slot 0 (rows 0-15, units 0-1), a rank-8 one
    at slot 2 (rows 16-23), a rank-3 one at slot 3 (rows 24-26; rows 27-31 unused), row 32 the zero row.

`SlotPool.load(slot, prepared)` is one contiguous copy of the adapter's block into its rows, in place, and returns
once the copy has completed on the device. A variant's vector row (DoRA, LoRA bias) goes into ``vectors[slot]`` in
the same load: one vector row per unit, ``vectors [S + 1, vector_width]``, the last one zero (the epilogue's
identity for tokens whose adapter has none).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..base_model import BaseModelSpec, ModuleKey
from ..errors import SlotLoadError
from ..sharding import TensorParallel
from .prepare import PreparedAdapter
from .row_layout import RowLayout, RowOptions, checked_layout
from .row_writers import check_device, row_writer

_GIB = 1 << 30


def units_for(rank: int, granule: int) -> int:
    """Units an adapter of rank ``rank`` takes: ceil(rank / granule) rounded up to a power of two."""
    units = -(-rank // granule)
    return 1 << (units - 1).bit_length()


def bytes_needed(
    spec: BaseModelSpec, rows: int, dtype: torch.dtype, tensor_parallel_size: int = 1, vocab: bool = False
) -> int:
    """Device bytes of ``rows`` rank rows (one row holds every module's A and Bt row; ``vocab``: and the vocabulary
    modules'), over every device: with N-way tensor parallelism each device holds one section of each row (1/N)."""
    return rows * RowLayout.of(spec, TensorParallel(tensor_parallel_size), vocab).row_bytes(dtype)


@dataclass
class SlotPoolConfig:
    """Size, granule, dtype and device of the row pool, and what shapes its rows."""

    max_slots: int | Literal["auto"] = 8  # rows for this many adapters at max_rank; "auto": memory_budget_bytes
    dtype: torch.dtype = torch.float32  # serving dtype; prepared adapters must match it
    device: torch.device | str = "cpu"  # cpu, cuda[:i] or xla[:i]
    memory_budget_bytes: int | None = None  # with max_slots="auto": device bytes the rows may take
    granule: int | None = None  # rows per unit (slot index step); None: min(8, max_rank)
    rows: RowOptions = field(default_factory=RowOptions)  # R, the sections (one per device), vector / vocab columns

    def __post_init__(self) -> None:
        if self.max_slots == "auto":
            if not isinstance(self.memory_budget_bytes, int) or self.memory_budget_bytes <= 0:
                raise ValueError(
                    f"max_slots='auto' needs a positive memory_budget_bytes, got {self.memory_budget_bytes!r}"
                )
        elif not isinstance(self.max_slots, int) or isinstance(self.max_slots, bool) or self.max_slots <= 0:
            raise ValueError(f"max_slots must be a positive int or 'auto', got {self.max_slots!r}")
        if not isinstance(self.rows, RowOptions):
            raise TypeError(f"rows must be a RowOptions (max_rank, tensor_parallel, ...), got {self.rows!r}")
        max_rank = self.rows.max_rank
        if self.granule is None:
            self.granule = min(8, max_rank)
        if not isinstance(self.granule, int) or not 0 < self.granule <= max_rank:
            raise ValueError(f"granule must be an int in 1..max_rank ({max_rank}), got {self.granule!r}")
        if not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point dtype, got {self.dtype}")
        self.device = torch.device(self.device)
        check_device(self.device)

    @property
    def max_units(self) -> int:
        """Units of an adapter at max_rank: the largest block the allocator hands out."""
        assert self.granule is not None
        return units_for(self.rows.max_rank, self.granule)

    def resolve_units(self, layout: RowLayout) -> int:
        """Units in the pool: ``max_slots`` max-rank blocks, or as many whole max-rank blocks of ``layout``'s rows
        (the layout of :attr:`rows`) as fit in the budget."""
        assert self.granule is not None
        if self.max_slots != "auto":
            return self.max_slots * self.max_units
        assert self.memory_budget_bytes is not None
        vector = layout.vector_width * self.dtype.itemsize if self.rows.has_vectors else 0  # one per unit
        row = layout.row_bytes(self.dtype)
        block = self.max_units * self.granule * row + self.max_units * vector
        zero_row = row + vector
        if self.memory_budget_bytes < block + zero_row:
            raise ValueError(
                f"memory_budget_bytes ({self.memory_budget_bytes / _GIB:.3f} GiB) is smaller than one adapter at "
                f"max_rank {self.rows.max_rank} in {self.dtype} ({block / _GIB:.3f} GiB)"
            )
        return (self.memory_budget_bytes - zero_row) // block * self.max_units


class SlotStacks:
    """One module's rows, as the kernels take them: strided views of the pool's row tensor.

    On eager devices the two views are made once. On XLA each access makes a fresh view, so a step's graph always
    slices the pool's row tensor (device data after every load): a view kept alive across syncs would be
    materialised as a copy of its own, and a slot load would then switch the step between two graphs.
    """

    def __init__(
        self, rows: torch.Tensor, layout: RowLayout, key: ModuleKey, vectors: torch.Tensor | None, fresh: bool = False
    ) -> None:
        self._rows, self._layout, self._key, self._vectors = rows, layout, key, vectors
        self._fresh = fresh  # the row writer's `fresh_views` (XLA)
        self._a, self._bt = layout.a_view(rows, key), layout.bt_view(rows, key)
        self._vector = None if vectors is None or key.is_vocab else layout.vector_view(vectors, key)
        self.held: set[int] | None = set() if key.is_vocab else None
        """A vocabulary module's: the slots whose adapter (loaded there last) has rows in it; the eager kernels skip
        the others' (zero) rows. None for the projections."""

    @property
    def a(self) -> torch.Tensor:
        """Shape: [N, in]; over S tensor-parallel sections [N, S, in_s]."""
        return self._layout.a_view(self._rows, self._key) if self._fresh else self._a

    @property
    def bt(self) -> torch.Tensor:
        """Shape: [N, out]; over S tensor-parallel sections [N, S, out_s]."""
        return self._layout.bt_view(self._rows, self._key) if self._fresh else self._bt

    @property
    def vector(self) -> torch.Tensor | None:
        """Shape: [S + 1, out]: each slot's vector of this module (the last row zero); None: the pool has none."""
        if self._vectors is None or not self._fresh or self._key.is_vocab:
            return self._vector
        return self._layout.vector_view(self._vectors, self._key)


class SlotPool:
    """The row pool on one device, allocated once (zero-filled), written one adapter range at a time in place.

    `load` is safe to call from several threads for *disjoint* ranges (the allocator guarantees a range has one
    writer); on XLA loads are serialised, as lazy-tensor tracing of one tensor from two threads is not.
    """

    def __init__(
        self, spec: BaseModelSpec, config: SlotPoolConfig | None = None, layout: RowLayout | None = None
    ) -> None:
        self.spec = spec
        self.config = config or SlotPoolConfig()
        self.tensor_parallel = self.config.rows.tensor_parallel
        self.layout = checked_layout(spec, self.config.rows, layout)
        """The rows' layout: the manager's one (its registry prepares blocks in the same object)."""
        self.granule: int = self.config.granule  # type: ignore[assignment]
        self.num_units = self.config.resolve_units(self.layout)
        self.max_units = self.config.max_units
        self.max_rank = self.config.rows.max_rank
        self.dtype = self.config.dtype
        self.device = torch.device(self.config.device)
        self.num_rows = self.num_units * self.granule + 1  # N, the last one the zero row
        self._writer = row_writer(self.device, self.tensor_parallel)  # how rows reach this device (`row_writers`)
        self.rows = self._writer.zeros((self.num_rows, self.layout.width), self.dtype, sectioned=True)  # [N, width]
        self.vectors: torch.Tensor | None = None
        """Shape: [S + 1, vector_width]: slot s's vector row (`row_layout`), the last one zero; None: none kept."""
        if self.config.rows.has_vectors:
            self.vectors = self._writer.zeros((self.num_units + 1, self.layout.vector_width), self.dtype)
        fresh = self._writer.fresh_views
        self._stacks = {k: SlotStacks(self.rows, self.layout, k, self.vectors, fresh) for k in self.layout.columns}
        sizes = [1 << k for k in range(min(self.max_units, self.num_units).bit_length())]  # units of each size class
        self._writer.warm_up(self.rows, self.vectors, self.granule, sizes)

    @property
    def num_slots(self) -> int:
        """Slot indices 0 <= s < num_slots (one per unit): the most adapters the pool can hold at once."""
        return self.num_units

    @property
    def zero_row(self) -> int:
        return self.num_rows - 1

    @property
    def device_lock(self) -> threading.RLock:
        """XLA: serialises lazy-tensor tracing and syncs on the device. A sync cuts the graph of *every* live tensor,
        so a step traced in one thread must not interleave with a slot load in another: the engine holds this lock
        while it traces and syncs a step; `load` holds it on XLA."""
        return self._writer.lock

    @property
    def shared_rows(self) -> str | None:
        """Where another process maps :attr:`rows` (CPU over N > 1 tensor-parallel shards, one process each: each
        reads its own section of every row, so a load is one copy for all); None: the rows are this process's."""
        return self._writer.shared_path

    @property
    def stacks(self) -> Mapping[ModuleKey, SlotStacks]:
        """Every module's row views, layer-major; the tensors never change identity, only their contents."""
        return self._stacks

    @property
    def nbytes(self) -> int:
        """Device bytes of the rows and the vector rows."""
        vectors = 0 if self.vectors is None else self.vectors.numel() * self.vectors.element_size()
        return self.rows.numel() * self.rows.element_size() + vectors

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one plain adapter at max_rank: its rows (a variant's vector row adds ``vector_width`` elements)."""
        return self.max_rank * self.layout.row_bytes(self.dtype)

    @property
    def section_nbytes(self) -> int:
        """Bytes of one device's share of the pool (its section of every row): ``nbytes / N`` over N shards."""
        return self.num_rows * self.layout.section_bytes(self.dtype)

    def units_for(self, rank: int) -> int:
        """Units an adapter of rank ``rank`` takes in this pool."""
        return units_for(rank, self.granule)

    def load(self, slot: int, prepared: PreparedAdapter) -> None:
        """Copy `prepared`'s block into rows ``[slot * G, slot * G + r)`` in place: one contiguous copy.

        Semantics:
            rows[slot * G : slot * G + r] = prepared.storage      # [r, width]; the other rows are untouched
        Over N tensor-parallel sections the block is ``[r, N, W_s]`` and each device's section one contiguous piece
        (`RowLayout.block`): on XLA each device receives only its own.
        Returns once the copy has completed on the device. Raises `SlotLoadError` (naming the adapter) on a bad
        slot, rank, dtype or width before writing anything; if a copy itself fails the range may be partly written
        and must not be published.
        """
        if not 0 <= slot < self.num_units:
            raise SlotLoadError(prepared.adapter_id, f"slot {slot} is outside 0..{self.num_units - 1}")
        storage, row_shape = prepared.storage, self.layout.block_shape(0)[1:]
        if tuple(storage.shape[1:]) != row_shape or storage.dtype != self.dtype:
            raise SlotLoadError(
                prepared.adapter_id,
                f"prepared block is {list(storage.shape)} {storage.dtype}, the pool holds rows of "
                f"{' x '.join(map(str, row_shape))} in {self.dtype}",
            )
        rank, vector = storage.shape[0], prepared.vector
        if not 0 < rank <= self.max_rank:
            raise SlotLoadError(prepared.adapter_id, f"rank {rank} is outside 1..max_rank {self.max_rank}")
        if not prepared.complete:
            raise SlotLoadError(prepared.adapter_id, f"a {prepared.variant.value} adapter prepared without its vector")
        if vector is not None and (
            self.vectors is None or vector.shape != self.vectors.shape[1:] or vector.dtype != self.dtype
        ):
            kept = "none" if self.vectors is None else f"rows of {self.layout.vector_width} in {self.dtype}"
            raise SlotLoadError(
                prepared.adapter_id, f"its {prepared.variant.value} vector row is {list(vector.shape)} "
                f"{vector.dtype}, the pool keeps {kept}"
            )  # fmt: skip
        end_unit = slot + self.units_for(rank)
        if end_unit > self.num_units:
            raise SlotLoadError(
                prepared.adapter_id, f"rank {rank} at slot {slot} needs units up to {end_unit}, the pool has "
                f"{self.num_units}"
            )  # fmt: skip
        start = slot * self.granule
        padded_rows = self.units_for(rank) * self.granule
        self._writer.write(self.rows, start, storage, padded_rows, self.vectors, slot, vector)
        for key in self.spec.vocab_keys() if self.layout.vocab else ():
            held = self._stacks[key].held
            assert held is not None
            held.add(slot) if key in prepared.modules else held.discard(slot)
