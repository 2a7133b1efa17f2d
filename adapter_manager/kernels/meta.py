"""Per-step batch metadata shared by every LoRA layer of one forward pass (vLLM's ``LoRAKernelMeta``): what every
backend shares here; each executor's step state in its own class (:mod:`kernels.eager_meta`: the form and its
tables; :mod:`kernels.traced_meta`: the compact table's lane owners), which :meth:`LoRAKernelMeta.make` picks from
the backend's executor."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Integral

import numpy as np
import torch

from adapter_manager.kernels.active_table import (
    CompactTable,
    bucket_for,
    check_active_buckets,
    default_active_buckets,
)
from adapter_manager.kernels.grouping import AdapterRows
from adapter_manager.kernels.protocol import KernelBackend

_log = logging.getLogger(__name__)
_HOST = torch.device("cpu")


@dataclass
class LoRAKernelMeta:
    """Fixed-shape batch metadata: made once per engine, prepared once per forward step, read by every LoRA layer.

    The LoRA weights of one (layer, projection) are row pools ``a_rows [N, in]`` and ``bt_rows [N, out]``,
    N = S·G + 1: slot s's adapter of rank r_s sits in rows ``[s·G, s·G + r_s)`` (G = granule; r_s > G spans several
    granules), rows past r_s may hold stale data, and the last row (``zero_row``) is all zeros.
    ``prepare(slot_indices, slot_rows)`` fills the metadata from the step's per-token slots (-1 = no adapter) and the
    active slots' ranks. Eager backends (:class:`kernels.eager_meta.EagerMeta`): one host sync (none when the
    indices are on the host), then the fast-path flags and the form. Traced ones (:class:`kernels.traced_meta.
    TracedMeta`): the indices must be on the host; the compact table is built there and moved whole, so the graph
    depends only on (T, A).

    Worked example, S = 6, G = 2, R = 4 (N = 13, zero_row = 12, active buckets (1, 4, 6)), slot_rows {0: 3, 3: 2},
    slot indices ``[3, -1, 0, 3, 3]``:
      pool rows: slot 0 -> rows 0..2 (spans granules 0 and 1; slot 1 is unused), slot 3 -> rows 6..7
      active_slots = (0, 3), k = 2 -> active_width A = 4, token_compact = [1, -1, 0, 1, 1]
      gather_rows [A·R] = [0, 1, 2, 12,  6, 7, 12, 12,  12, 12, 12, 12,  12, 12, 12, 12]
      lane_owner  [A·R] = [0, 0, 0, 0,  1, 1, 1, 1,  2, 2, 2, 2,  3, 3, 3, 3]
      eager: runs = slot 3 (0, 1), slot 0 (2, 1), slot 3 (3, 2) -> form segments on the torch backend.
    """

    backend: KernelBackend
    num_slots: int
    rank: int
    max_tokens: int
    device: torch.device
    granule: int
    """G, pool rows per slot id."""
    active_buckets: tuple[int, ...]
    """Ascending widths A of the compact active table."""
    vectors: bool = False
    """The pool keeps a vector row per slot (:mod:`kernels.vectors`): a traced step always carries the vector
    indices, so its graph has the epilogue whatever the step's adapters are."""
    num_tokens: int = field(init=False, default=0)
    active_adapters: tuple[AdapterRows, ...] = field(init=False, default=())
    """The step's distinct slots ≥ 0 with their pool rows, ascending by slot (compact id c = position here)."""
    active_width: int = field(init=False, default=0)
    """A, the smallest active bucket ≥ len(active_slots)."""
    gather_rows: torch.Tensor | None = field(init=False, default=None)
    """Shape: [A·R] int64 on ``device``: pool row of each lane (see :mod:`kernels.active_table`). Traced backends
    always; eager only for the grouped-padded and laned forms (they read the first k·R)."""
    token_compact: torch.Tensor | None = field(init=False, default=None)
    """Shape: [T] int32 on ``device``: each token's compact id, -1 = no adapter. Set with ``gather_rows``."""
    no_adapter: bool = field(init=False, default=False)
    """No token has an adapter: LoRA is skipped (eager; a traced step never skips it: its graph is fixed)."""
    bias_index: torch.Tensor | None = field(init=False, default=None)
    """Shape: [T] int64 on ``device``: the vector row each token adds to a linear's output (its slot where its
    adapter's vector is a bias, else the zero row S). None: no token's adapter has one (eager; traced: ``vectors``
    off)."""
    scale_index: torch.Tensor | None = field(init=False, default=None)
    """Shape: [T] int64 on ``device``: the vector row each token scales a linear's output by (``y += y ⊙ v``: its slot
    where its adapter's vector is DoRA's scale, else the zero row S). None as ``bias_index``."""
    executor: object = field(init=False, repr=False)
    """The backend's linear executor (``backend.executor_type``: :mod:`kernels.executor`), made once with the
    metadata: what every linear of a step calls."""

    @classmethod
    def make(
        cls,
        backend: KernelBackend,
        num_slots: int,
        rank: int,
        max_tokens: int,
        device: torch.device | str,
        *,
        granule: int | None = None,
        active_buckets: Sequence[int] | None = None,
        vectors: bool = False,
    ) -> LoRAKernelMeta:
        """Allocate the metadata for row pools of ``num_slots`` slot ids (``granule`` rows each, default ``rank``),
        adapters of rank ≤ ``rank`` and batches of ≤ ``max_tokens`` tokens; ``vectors``: the pool keeps vector rows."""
        granule = rank if granule is None else granule
        checks = (("num_slots", num_slots), ("rank", rank), ("max_tokens", max_tokens), ("granule", granule))
        for name, value in checks:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        buckets = default_active_buckets(num_slots) if active_buckets is None else check_active_buckets(active_buckets)
        kind = backend.executor_type.meta_type if cls is LoRAKernelMeta else cls  # the executor's step state
        return kind(backend, num_slots, rank, max_tokens, torch.device(device), granule, buckets, vectors)

    def __post_init__(self) -> None:
        self.executor = self.backend.executor_type(self.backend)

    @property
    def fused(self) -> bool:
        """Whether this step applies each fused linear's LoRA in one backend call (:func:`kernels.ops.apply_parts`;
        eager FUSED steps only)."""
        return False

    @property
    def num_rows(self) -> int:
        """N = S·G + 1, the rows of every pool tensor."""
        return self.num_slots * self.granule + 1

    @property
    def zero_row(self) -> int:
        """N - 1, the pool's all-zero row that pads every gather."""
        return self.num_slots * self.granule

    @property
    def active_slots(self) -> tuple[int, ...]:
        """The step's distinct slots ≥ 0, ascending."""
        return tuple(a.slot for a in self.active_adapters)

    @property
    def num_active(self) -> int:
        """k, the step's distinct active slots."""
        return len(self.active_adapters)

    def prepare(
        self, slot_indices: torch.Tensor, slot_rows: Mapping[int, int], slot_vectors: Mapping[int, str] | None = None
    ) -> None:
        """Fill the metadata for one step.

        ``slot_indices``: Shape: [T] int32, each in [-1, S); on the host for traced backends. ``slot_rows``: r_s for
        (at least) every slot in slot_indices, 1 ≤ r_s ≤ R. ``slot_vectors``: how each slot's vector row applies
        ("bias", "scale"), for the slots that have one.
        """
        slot_vectors = slot_vectors or {}
        if not set(slot_vectors.values()) <= {"bias", "scale"}:
            raise ValueError(f"slot_vectors must map slots to 'bias' or 'scale', got {dict(slot_vectors)}")
        if slot_indices.dim() != 1 or slot_indices.dtype != torch.int32:
            raise ValueError(
                f"slot_indices must be a 1-D int32 tensor, got shape {tuple(slot_indices.shape)} {slot_indices.dtype}"
            )
        num_tokens = slot_indices.shape[0]
        if not 1 <= num_tokens <= self.max_tokens:
            raise ValueError(f"slot_indices has {num_tokens} tokens, expected 1..max_tokens={self.max_tokens}")
        self._fill(slot_indices, slot_rows, slot_vectors)

    def _fill(self, slot_indices: torch.Tensor, slot_rows: Mapping[int, int], slot_vectors: Mapping[int, str]) -> None:
        """The step's state from its checked arguments: each executor's metadata class fills its own
        (:class:`kernels.eager_meta.EagerMeta`, :class:`kernels.traced_meta.TracedMeta`)."""
        raise NotImplementedError(f"{type(self).__name__} is the shared base: make it with LoRAKernelMeta.make")

    def _vector_indices(self, slots: list[int], slot_vectors: Mapping[int, str], wanted: bool, every: bool) -> None:
        """``bias_index`` and ``scale_index`` from the step's slots; ``every``: both kinds (traced), else only the
        kinds its adapters have."""
        self.bias_index = self.scale_index = self.vector_runs = None
        if not wanted:
            return
        for kind in ("bias", "scale"):
            if every or kind in slot_vectors.values():
                rows = [s if s >= 0 and slot_vectors.get(s) == kind else self.num_slots for s in slots]
                setattr(self, f"{kind}_index", torch.tensor(rows, dtype=torch.int64).to(self.device))

    def _check_range(self, low: int, high: int) -> None:
        if low < -1 or high >= self.num_slots:
            raise ValueError(
                f"slot_indices must lie in [-1, {self.num_slots}) for num_slots={self.num_slots}; "
                f"got values in [{low}, {high}]"
            )

    def _set_active(self, num_tokens: int, adapters: tuple[AdapterRows, ...]) -> None:
        self.num_tokens = num_tokens
        self.active_adapters = adapters
        self.active_width = bucket_for(len(adapters), self.active_buckets)
        self.gather_rows = self.token_compact = None

    def _adapters(self, active: tuple[int, ...], slot_rows: Mapping[int, int]) -> tuple[AdapterRows, ...]:
        adapters: list[AdapterRows] = []
        for slot in active:
            if slot not in slot_rows:
                raise ValueError(f"slot_rows has no entry for slot {slot}, which slot_indices uses")
            rows = slot_rows[slot]
            if not isinstance(rows, Integral) or isinstance(rows, bool) or not 1 <= rows <= self.rank:
                raise ValueError(f"slot_rows[{slot}] = {rows!r} is outside 1..rank={self.rank}")
            rows = int(rows)
            first = slot * self.granule
            if first + rows > self.zero_row:
                raise ValueError(
                    f"slot {slot} of rank {rows} needs rows [{first}, {first + rows}) but the pool has "
                    f"{self.zero_row} adapter rows (num_slots={self.num_slots}, granule={self.granule})"
                )
            if adapters and adapters[-1].first + adapters[-1].rank > first:
                prev = adapters[-1]
                raise ValueError(
                    f"slot {prev.slot} (rows [{prev.first}, {prev.first + prev.rank})) overlaps slot {slot} "
                    f"(rows [{first}, {first + rows})) with granule={self.granule}"
                )
            adapters.append(AdapterRows(slot, first, rows))
        return tuple(adapters)

    def _build_table(self, compact: np.ndarray, adapters: tuple[AdapterRows, ...]) -> None:
        table = CompactTable.build(compact, adapters, self.active_width, self.rank, self.zero_row)
        self.gather_rows = table.gather_rows.to(self.device)
        self.token_compact = table.token_compact.to(self.device)

    def active_gather_rows(self) -> torch.Tensor:
        """Shape: [k·R] int64: the compact table's rows of the k active slots (no bucket padding; eager forms)."""
        assert self.gather_rows is not None, "no compact table this step"
        return self.gather_rows[: self.num_active * self.rank]
