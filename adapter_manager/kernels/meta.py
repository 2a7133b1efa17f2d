"""Per-step batch metadata shared by every LoRA layer of one forward pass (vLLM's ``LoRAKernelMeta``)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Integral
from typing import cast

import numpy as np
import torch

from adapter_manager.kernels.active_table import (
    CompactTable,
    bucket_for,
    check_active_buckets,
    compact_ids,
    default_active_buckets,
)
from adapter_manager.kernels.config import LoRAForm
from adapter_manager.kernels.grouping import AdapterRows, Segment, SlotGrouping, group_by_slot, slot_runs
from adapter_manager.kernels.protocol import EagerBackend, KernelBackend

_log = logging.getLogger(__name__)
_HOST = torch.device("cpu")


@dataclass
class LoRAKernelMeta:
    """Fixed-shape batch metadata: made once per engine, prepared once per forward step, read by every LoRA layer.

    The LoRA weights of one (layer, projection) are row pools ``a_rows [N, in]`` and ``bt_rows [N, out]``,
    N = S·G + 1: slot s's adapter of rank r_s sits in rows ``[s·G, s·G + r_s)`` (G = granule; r_s > G spans several
    granules), rows past r_s may hold stale data, and the last row (``zero_row``) is all zeros.
    ``prepare(slot_indices, slot_rows)`` fills the metadata from the step's per-token slots (-1 = no adapter) and the
    active slots' ranks. Eager devices: one host sync (none when the indices are on the host), then the fast-path
    flags and the form. Traced (XLA) devices: the indices must be on the host; the compact table is built there and
    moved whole, so the graph depends only on (T, A).

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
    lane_owner: torch.Tensor | None = field(init=False, default=None)
    """Traced only. Shape: [A·R] int32 on ``device``: ``lane // R``, made once per active width."""
    token_slots: torch.Tensor | None = field(init=False, default=None)
    """Eager only. Shape: [T] int32 on ``device``: the step's slot per token, -1 = no adapter."""
    host_slots: list[int] | None = field(init=False, default=None)
    """Eager only: the step's slot per token as host ints (what the vocabulary LoRA groups tokens by,
    :mod:`kernels.vocab`)."""
    no_adapter: bool = field(init=False, default=False)
    """Eager only: no token has an adapter, LoRA is skipped."""
    all_assigned: bool = field(init=False, default=False)
    """Eager only: no token has slot -1 (no row needs zeroing)."""
    single: AdapterRows | None = field(init=False, default=None)
    """Eager only: the one adapter, when every adapter token uses the same slot."""
    segments: tuple[Segment, ...] | None = field(init=False, default=None)
    """Eager only: one per run of equal slots in token order, when the batch is grouped by slot (an engine that
    orders its batch by adapter gives one run per adapter): plain matmuls on row slices."""
    grouping: SlotGrouping | None = field(init=False, default=None)
    runs: torch.Tensor | None = field(init=False, default=None)
    """Eager FUSED form, and every step with an adapter on the cpu backend (whose ``fused_linear`` takes a blocked
    linear's any step). Shape: [runs, 4] int64 on the host: (token start, token count, first pool row, rank) of each
    run of equal slots, the table the fused kernels walk."""
    step_tables: object | None = field(init=False, default=None)
    """Eager FUSED form only: the backend's own per-step device tables (the triton backend's token or runs table),
    built by the backend on first use from ``runs``; every prepare resets it. A captured step sets it to tables in
    static buffers (:mod:`runtime.engine.cuda_graphs`)."""
    lane_onehot: torch.Tensor | None = field(init=False, default=None)
    """Eager laned form only. Shape: [T, k, 1] bool, True where the token's compact id is c."""
    form: LoRAForm | None = field(init=False, default=None)
    """Eager only: the form this step takes (none, single, segments, grouped, laned); None on traced devices, whose
    backend has one static form. Each new (token count, form) pair is logged once at DEBUG."""
    bias_index: torch.Tensor | None = field(init=False, default=None)
    """Shape: [T] int64 on ``device``: the vector row each token adds to a linear's output (its slot where its
    adapter's vector is a bias, else the zero row S). None: no token's adapter has one (eager; traced: ``vectors``
    off)."""
    scale_index: torch.Tensor | None = field(init=False, default=None)
    """Shape: [T] int64 on ``device``: the vector row each token scales a linear's output by (``y += y ⊙ v``: its slot
    where its adapter's vector is DoRA's scale, else the zero row S). None as ``bias_index``."""
    vector_runs: tuple[tuple[int, int, int, str], ...] | None = field(init=False, default=None)
    """Eager only, with ``bias_index`` or ``scale_index``: (token start, token count, slot, "bias" or "scale") of each
    run of tokens whose adapter has a vector row, the epilogue's alternative to the gathers where runs are few."""
    executor: object = field(init=False, repr=False)
    """The backend's linear executor (``backend.executor_type``: :mod:`kernels.executor`), made once with the
    metadata: what every linear of a step calls."""
    _lane_owners: dict[int, torch.Tensor] = field(init=False, default_factory=dict, repr=False)
    _logged_forms: set[tuple[int, LoRAForm]] = field(init=False, default_factory=set, repr=False)

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
        return cls(backend, num_slots, rank, max_tokens, torch.device(device), granule, buckets, vectors)

    def __post_init__(self) -> None:
        self.executor = self.backend.executor_type(self.backend)

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
        self.executor.prepare(self, slot_indices, slot_rows, slot_vectors)

    def prepare_eager(
        self, slot_indices: torch.Tensor, slot_rows: Mapping[int, int], slot_vectors: Mapping[int, str]
    ) -> None:
        """:meth:`prepare` on an eager backend (its executor's): one host sync, the form and its tables."""
        slots = slot_indices.tolist()  # the step's one host sync
        self.host_slots = slots
        self._prepare_eager(slot_indices, slots, slot_rows)
        self._vector_indices(slots, slot_vectors, any(a.slot in slot_vectors for a in self.active_adapters), False)
        if self.bias_index is not None or self.scale_index is not None:
            runs = slot_runs(slots)[1]
            self.vector_runs = tuple((a, n, s, slot_vectors[s]) for s, a, n in runs if s in slot_vectors)

    def prepare_traced(
        self, slot_indices: torch.Tensor, slot_rows: Mapping[int, int], slot_vectors: Mapping[int, str]
    ) -> None:
        """:meth:`prepare` on a traced backend (its executor's): the compact table built on the host, moved whole;
        the vector indices always (the graph has the epilogue whatever the step's adapters)."""
        if slot_indices.device != _HOST:
            raise ValueError(
                f"slot_indices must be a CPU tensor on a traced backend (the compact table is built on the host), "
                f"got one on {slot_indices.device}"
            )
        if slot_vectors and not self.vectors:
            raise ValueError(f"slot_vectors {dict(slot_vectors)} on traced metadata made without vectors")
        host = slot_indices.numpy()
        self._check_range(int(host.min()), int(host.max()))
        active, _, compact = compact_ids(host)
        adapters = self._adapters(tuple(active.tolist()), slot_rows)
        self._set_active(host.shape[0], adapters)
        self._build_table(compact, adapters)
        self.lane_owner = self._lane_owner(self.active_width)
        self._vector_indices(host.tolist(), slot_vectors, self.vectors, True)

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
        self.gather_rows = self.token_compact = self.lane_owner = None

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

    def _lane_owner(self, width: int) -> torch.Tensor:
        if width not in self._lane_owners:
            lanes = torch.arange(width * self.rank, dtype=torch.int32) // self.rank
            self._lane_owners[width] = lanes.to(self.device)
        return self._lane_owners[width]

    def _prepare_eager(self, slot_indices: torch.Tensor, slots: list[int], slot_rows: Mapping[int, int]) -> None:
        """The eager metadata from the step's slots as host ints (plain Python over them: a step's host work is on
        its critical path, and numpy's per-call overhead was most of it)."""
        self._check_range(min(slots), max(slots))
        counts, runs = slot_runs(slots)
        adapters = self._adapters(tuple(sorted(counts)), slot_rows)
        self._set_active(len(slots), adapters)
        if slot_indices.device != self.device:
            slot_indices = torch.tensor(slots, dtype=torch.int32).to(self.device, non_blocking=True)
        self.token_slots = slot_indices
        self.all_assigned = sum(counts.values()) == len(slots)
        self.single = self.segments = self.grouping = self.lane_onehot = self.runs = self.step_tables = None
        if not adapters:
            form = LoRAForm.NONE
        else:
            form = cast(EagerBackend, self.backend).choose_form(self.num_tokens, len(adapters), self.rank, len(runs))
            assert form is not LoRAForm.SINGLE or len(adapters) == 1, f"single-slot form for {len(adapters)} slots"
            if form is LoRAForm.SINGLE:
                self.single = adapters[0]
            elif form in (LoRAForm.SEGMENTS, LoRAForm.FUSED):
                by_slot = {a.slot: a for a in adapters}
                self.segments = tuple(Segment(by_slot[slot], start, count) for slot, start, count in runs)
            elif form is LoRAForm.LANED:
                self._build_table(compact_ids(np.asarray(slots, dtype=np.int32))[2], adapters)
                assert self.token_compact is not None
                ids = torch.arange(len(adapters), device=self.device, dtype=torch.int32)
                self.lane_onehot = (self.token_compact[:, None] == ids[None, :])[:, :, None]
            else:
                assert form is LoRAForm.GROUPED, f"backend chose {form!r}"
                counts_by_slot = tuple(counts[a.slot] for a in adapters)
                self.grouping = group_by_slot(self.token_slots, adapters, counts_by_slot, self.num_slots)
                if self.grouping.padded:
                    self._build_table(compact_ids(np.asarray(slots, dtype=np.int32))[2], adapters)
            if form is LoRAForm.FUSED or cast(EagerBackend, self.backend).runs_every_step:  # the C++ kernels' runs
                rows = {a.slot: a for a in adapters}
                table = [(start, count, rows[slot].first, rows[slot].rank) for slot, start, count in runs]
                self.runs = torch.tensor(table, dtype=torch.int64)
        self.form = form
        self.no_adapter = form is LoRAForm.NONE
        if (self.num_tokens, form) not in self._logged_forms:
            self._logged_forms.add((self.num_tokens, form))
            _log.debug(
                "LoRA form %s for steps of %d tokens (%d active slots)", form.value, self.num_tokens, len(adapters)
            )

    @property
    def fused(self) -> bool:
        """Whether this step applies each fused linear's LoRA in one backend call (:func:`kernels.ops.apply_parts`)."""
        return self.form is LoRAForm.FUSED

    def active_gather_rows(self) -> torch.Tensor:
        """Shape: [k·R] int64: the compact table's rows of the k active slots (no bucket padding; eager forms)."""
        assert self.gather_rows is not None, "no compact table this step"
        return self.gather_rows[: self.num_active * self.rank]

    def on_shard(self, local: Callable[[torch.Tensor], torch.Tensor]) -> LoRAKernelMeta:
        """A copy of this step's metadata whose traced operands (:meth:`args`) are ``local(t)`` of this one's: what a
        backend called per shard under manual sharding reads (``kernels.sharded``)."""
        shard = copy.copy(self)
        shard.token_compact, shard.gather_rows, shard.lane_owner = (local(t) for t in self.args())
        return shard

    def args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The traced kernels' operands: ``(token_compact [T] int32, gather_rows [A·R] int64, lane_owner [A·R])``."""
        assert self.token_compact is not None and self.gather_rows is not None and self.lane_owner is not None
        return self.token_compact, self.gather_rows, self.lane_owner
