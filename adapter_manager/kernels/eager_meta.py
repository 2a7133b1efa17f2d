"""An eager backend's step state (:class:`EagerMeta`): the form each step takes and its tables."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from adapter_manager.kernels.active_table import compact_ids
from adapter_manager.kernels.config import LoRAForm
from adapter_manager.kernels.grouping import AdapterRows, Segment, SlotGrouping, group_by_slot, slot_runs
from adapter_manager.kernels.meta import LoRAKernelMeta
from adapter_manager.kernels.protocol import EagerBackend

_log = logging.getLogger("adapter_manager.kernels.meta")  # the metadata's one logger, whichever class


@dataclass
class EagerMeta(LoRAKernelMeta):
    """:class:`LoRAKernelMeta` of an eager backend (torch forms, reference, cpu, triton): one host sync a step for
    the slots, then the form the backend chooses (none, single, segments, grouped, laned, fused) and its tables."""

    token_slots: torch.Tensor | None = field(init=False, default=None)
    """Eager only. Shape: [T] int32 on ``device``: the step's slot per token, -1 = no adapter."""
    host_slots: list[int] | None = field(init=False, default=None)
    """Eager only: the step's slot per token as host ints (what the vocabulary LoRA groups tokens by,
    :mod:`kernels.vocab`)."""
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
    vector_runs: tuple[tuple[int, int, int, str], ...] | None = field(init=False, default=None)
    """Eager only, with ``bias_index`` or ``scale_index``: (token start, token count, slot, "bias" or "scale") of each
    run of tokens whose adapter has a vector row, the epilogue's alternative to the gathers where runs are few."""
    _logged_forms: set[tuple[int, LoRAForm]] = field(init=False, default_factory=set, repr=False)

    def _fill(self, slot_indices: torch.Tensor, slot_rows: Mapping[int, int], slot_vectors: Mapping[int, str]) -> None:
        """One host sync, then the form the backend chooses and its tables."""
        slots = slot_indices.tolist()  # the step's one host sync
        self.host_slots = slots
        self._prepare_eager(slot_indices, slots, slot_rows)
        self._vector_indices(slots, slot_vectors, any(a.slot in slot_vectors for a in self.active_adapters), False)
        if self.bias_index is not None or self.scale_index is not None:
            runs = slot_runs(slots)[1]
            self.vector_runs = tuple((a, n, s, slot_vectors[s]) for s, a, n in runs if s in slot_vectors)

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
