"""Per-step batch metadata shared by every LoRA layer of one forward pass (vLLM's ``LoRAKernelMeta``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import cast

import torch

from kernels.config import LoRAForm
from kernels.protocol import EagerBackend, KernelBackend

_log = logging.getLogger(__name__)


_MAX_PADDING_WASTE = 1.5
"""Padded grouping is used while A·C ≤ this × the assigned tokens."""


@dataclass(frozen=True)
class SlotGrouping:
    """Tokens sorted by slot once per step, padded per active slot for batched matmuls (eager backends).

    Worked example, S = 4, slot indices ``[2, -1, 0, 2, 2]`` (T = 5):
      counts per slot      ``[1, 0, 3, 0]``  -> active slots ``(0, 2)``, C = max count = 3
      gather_index [2, 3]  ``[[2, 2, 2], [0, 3, 4]]``   (row per active slot; padding repeats a real token)
      valid        [2, 3]  ``[[T, F, F], [T, T, T]]``   (padding rows are zeroed before anything is added)
    Token 1 (slot -1) appears nowhere, so it receives exactly nothing.
    """

    active_slots: torch.Tensor
    """Shape: [A] int64, the slots that have at least one token, ascending."""
    gather_index: torch.Tensor
    """Shape: [A·C] int64, token of each (active slot, position) cell; padding cells repeat a token of that slot."""
    valid: torch.Tensor
    """Shape: [A, C, 1] bool: True for real cells, False for padding."""
    capacity: int
    """C, the largest token count of any active slot."""
    segments: tuple[tuple[int, int, int], ...]
    """(slot, start, count) per active slot, into the slot-sorted token order ``order``."""
    order: torch.Tensor
    """Shape: [N] int64, the tokens with a slot, sorted by slot (stable): N = sum of counts."""
    padded: bool
    """Use the padded batched form; False when padding would waste too much (skewed mixes): per-slot matmuls."""


@dataclass
class LoRAKernelMeta:
    """Fixed-shape batch metadata: made once per engine, prepared once per forward step, read by every LoRA layer.

    ``make`` allocates; ``prepare(slot_indices)`` fills it from the step's per-token slot indices (int32, -1 = no
    adapter); the backend ops read it through :meth:`args`. On eager devices ``prepare`` performs the step's single
    host sync (one ``bincount`` brought to the host) and derives the fast-path flags and the grouping; on traced
    (XLA) devices it performs none: the indices, already padded to a token bucket with -1 on the host, move whole.

    Worked example, S = 4, R = 2, slot indices ``[2, -1, 0, 2, 2]``:
      slot_counts = (1, 0, 3, 0), no_adapter = False, single_slot = None, all_assigned = False,
      runs = ((2, 0, 1), (0, 2, 1), (2, 3, 2)) -> form = segments (few runs) on the torch backend,
      lane_slot (traced)  = [0, 0, 1, 1, 2, 2, 3, 3]  (slot of each of the S·R lanes),
      lane_mask[1] = all False, lane_mask[0] = True only on lanes 4, 5 (slot 2).
    """

    backend: KernelBackend
    num_slots: int
    rank: int
    max_tokens: int
    device: torch.device
    token_slots: torch.Tensor = field(init=False)
    """Shape: [T] int32 on ``device``: the step's slot per token, -1 = no adapter."""
    lane_slot: torch.Tensor = field(init=False)
    """Shape: [S·R] int32 on ``device``: the slot owning each lane of the laned form."""
    num_tokens: int = field(init=False, default=0)
    slot_counts: tuple[int, ...] | None = field(init=False, default=None)
    """Eager only: tokens per slot (host ints); None on traced devices."""
    no_adapter: bool = field(init=False, default=False)
    """Eager only: no token has an adapter, LoRA is skipped."""
    single_slot: int | None = field(init=False, default=None)
    """Eager only: the one slot used when every adapter token uses the same slot."""
    all_assigned: bool = field(init=False, default=False)
    """Eager only: no token has slot -1 (no row needs zeroing)."""
    segments: tuple[tuple[int, int, int], ...] | None = field(init=False, default=None)
    """Eager only: (slot, start, count) per run of equal slots in token order, when the batch is grouped by slot
    (an engine that orders its batch by adapter gives one run per adapter): plain matmuls on row slices."""
    form: LoRAForm | None = field(init=False, default=None)
    """Eager only: the form this step takes (none, single, segments, grouped, laned); None on traced devices, whose
    backend has one static form. Each new (token count, form) pair is logged once at DEBUG."""
    use_laned: bool = field(init=False, default=False)
    """Eager only: the backend chose the dense laned form for this step."""
    grouping: SlotGrouping | None = field(init=False, default=None)
    lane_onehot: torch.Tensor | None = field(init=False, default=None)
    """Eager laned form only. Shape: [T, S, 1] bool, True where the token's slot is that slot."""
    _logged_forms: set[tuple[int, LoRAForm]] = field(init=False, default_factory=set, repr=False)

    @classmethod
    def make(
        cls, backend: KernelBackend, num_slots: int, rank: int, max_tokens: int, device: torch.device | str
    ) -> LoRAKernelMeta:
        """Allocate the metadata for stacks of ``num_slots`` slots of rank ``rank`` and batches of ≤ max_tokens."""
        for name, value in (("num_slots", num_slots), ("rank", rank), ("max_tokens", max_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        meta = cls(backend, num_slots, rank, max_tokens, torch.device(device))
        lanes = torch.arange(num_slots * rank, dtype=torch.int32) // rank
        meta.lane_slot = lanes.to(meta.device)
        meta.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=meta.device)
        return meta

    def prepare(self, slot_indices: torch.Tensor) -> None:
        """Fill the metadata for one step. ``slot_indices``: Shape: [T] int32, each in [-1, S)."""
        if slot_indices.dim() != 1 or slot_indices.dtype != torch.int32:
            raise ValueError(
                f"slot_indices must be a 1-D int32 tensor, got shape {tuple(slot_indices.shape)} {slot_indices.dtype}"
            )
        num_tokens = slot_indices.shape[0]
        if not 1 <= num_tokens <= self.max_tokens:
            raise ValueError(f"slot_indices has {num_tokens} tokens, expected 1..max_tokens={self.max_tokens}")
        self.num_tokens = num_tokens
        if self.backend.traced:
            self.token_slots = slot_indices.to(self.device)
            return
        self.token_slots = self._copy_slots(slot_indices)
        host = slot_indices.cpu()  # the step's one host sync (none when the engine passes host indices)
        low, high = int(host.min()), int(host.max())
        if low < -1 or high >= self.num_slots:
            raise ValueError(
                f"slot_indices must lie in [-1, {self.num_slots}) for num_slots={self.num_slots}; "
                f"got values in [{low}, {high}]"
            )
        counts = torch.bincount(host.long() + 1, minlength=self.num_slots + 1).tolist()
        self.slot_counts = tuple(counts[1:])
        active = [s for s, c in enumerate(self.slot_counts) if c > 0]
        self.all_assigned = counts[0] == 0
        self.segments = None
        self.use_laned = False
        self.grouping = None
        self.lane_onehot = None
        self.single_slot = None
        if not active:
            form = LoRAForm.NONE
        else:
            runs = _runs(host)
            form = cast(EagerBackend, self.backend).choose_form(
                num_tokens, self.num_slots, self.rank, len(active), len(runs)
            )
            assert form is not LoRAForm.SINGLE or len(active) == 1, f"single-slot form for {len(active)} slots"
            if form is LoRAForm.SINGLE:
                self.single_slot = active[0]
            elif form is LoRAForm.SEGMENTS:
                self.segments = runs
            elif form is LoRAForm.LANED:
                self.use_laned = True
                onehot = self.token_slots[:, None].long() == torch.arange(self.num_slots, device=self.device)[None, :]
                self.lane_onehot = onehot[:, :, None]
            else:
                assert form is LoRAForm.GROUPED, f"backend chose {form!r}"
                self.grouping = self._group(active)
        self.form = form
        self.no_adapter = form is LoRAForm.NONE
        if (num_tokens, form) not in self._logged_forms:
            self._logged_forms.add((num_tokens, form))
            _log.debug("LoRA form %s for steps of %d tokens (%d active slots)", form.value, num_tokens, len(active))

    def _copy_slots(self, slot_indices: torch.Tensor) -> torch.Tensor:
        if slot_indices.device == self.device:
            return slot_indices
        return slot_indices.to(self.device, non_blocking=True)

    def _group(self, active: list[int]) -> SlotGrouping:
        counts = [self.slot_counts[s] for s in active]  # type: ignore[index]
        capacity = max(counts)
        slots = self.token_slots.long()
        # stable sort puts each slot's tokens together in token order; -1 tokens are pushed to the end
        order = torch.argsort(torch.where(slots < 0, self.num_slots, slots), stable=True)
        starts, offset = [], 0
        for c in counts:
            starts.append(offset)
            offset += c
        assigned = offset
        padded = capacity * len(counts) <= _MAX_PADDING_WASTE * assigned
        count_t = torch.tensor(counts, device=self.device)[:, None]
        pos = torch.arange(capacity, device=self.device)[None, :]
        valid = pos < count_t  # [A, C]
        sorted_pos = torch.tensor(starts, device=self.device)[:, None] + torch.minimum(pos, count_t - 1)
        return SlotGrouping(
            active_slots=torch.tensor(active, device=self.device),
            gather_index=order[sorted_pos].reshape(-1),
            valid=valid[:, :, None],
            capacity=capacity,
            segments=tuple(zip(active, starts, counts, strict=True)),
            order=order[:assigned],
            padded=padded,
        )

    def args(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The traced kernels' operands: ``(token_slots [T] int32, lane_slot [S·R] int32)``."""
        return self.token_slots, self.lane_slot


def _runs(host: torch.Tensor) -> tuple[tuple[int, int, int], ...]:
    """(slot, start, count) of each maximal run of one slot (>= 0) in token order; -1 runs are left out.

    Example: ``[2, 2, -1, 0, 0, 0, 2]`` -> ``((2, 0, 2), (0, 3, 3), (2, 6, 1))``.
    """
    starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.nonzero(host[1:] != host[:-1]).flatten() + 1])
    ends = torch.cat([starts[1:], torch.tensor([host.shape[0]])])
    slots = host[starts]
    return tuple(
        (slot, start, end - start)
        for slot, start, end in zip(slots.tolist(), starts.tolist(), ends.tolist(), strict=True)
        if slot >= 0
    )
