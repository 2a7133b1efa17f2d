"""A linear's LoRA as the executors read it: each part's pool rows, the runs of parts one fused shrink serves, and
the groups one ``apply_parts`` (or one-call) form takes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol

import torch

from adapter_manager.kernels.protocol import LoRAGroups


class Stacks(Protocol):
    """One module's LoRA rows (``adapter_manager.tiers.slot_pool.SlotStacks``)."""

    @property
    def a(self) -> torch.Tensor: ...  # Shape: [N, in]

    @property
    def bt(self) -> torch.Tensor: ...  # Shape: [N, out]

    @property
    def vector(self) -> torch.Tensor | None: ...  # Shape: [S + 1, out]: each slot's vector row piece; None: none


class ShardHooks(Protocol):
    """The SPMD program's marks a sharded linear needs (``adapter_manager.spmd.Shards``)."""

    size: int
    """N, the devices the program's tensors are split over."""

    def pin(self, tensor: torch.Tensor, dim: int | None) -> torch.Tensor:
        """``tensor`` marked split along ``dim`` over the devices (None: whole on every device); returns it."""
        ...

    def local(self, tensor: torch.Tensor, dim: int | None) -> torch.Tensor:
        """This device's piece of ``tensor`` split along ``dim`` (None: the whole, replicated), in manual sharding:
        what the ops after it see is one device's shape."""
        ...

    def join(self, tensor: torch.Tensor, dim: int | None, shape: tuple[int, ...]) -> torch.Tensor:
        """The devices' pieces ``tensor`` back as one tensor of ``shape`` split along ``dim``."""
        ...


class ProcessShard(Protocol):
    """This process's place in a group of processes, one per shard (``runtime.model.shard_plan.ShardGroup``)."""

    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the shards, in place; returns it."""
        ...


ShardForm = Literal["none", "spmd", "processes"]


@dataclass(frozen=True)
class LinearShards:
    """How one linear's tensors are split over N tensor-parallel shards, made once by the model's shard plan
    (``runtime.model.shard_plan.ShardPlan.linear``); ``LinearShards()``: unsharded.

    Example, o_proj over 2 devices in one SPMD program: ``LinearShards(row_parallel=True, spmd=marks)`` (``marks.size``
    2): ``local`` 2, its input and ``A`` split by input features, ``Bt`` whole. The same layer with one process per
    shard: ``LinearShards(row_parallel=True, process=group)``: ``local`` 1, the process holds its own features alone.
    """

    row_parallel: bool = False
    """The linear's input is split (o, down): ``A`` by input features and ``Bt`` whole, the shards' partial outputs
    summed (one all-reduce); False: column-parallel (q/k/v, gate/up), ``A`` whole and ``Bt`` by output features."""
    fully_sharded: bool = False
    """``A`` (column-parallel) and ``Bt`` (row-parallel) split too, one ``1/N`` of each row per shard; the shards'
    shrink outputs are summed (one all-reduce per linear, each token's ``[r]`` a part). Needs N > 1."""
    spmd: ShardHooks | None = None
    """One SPMD program over ``spmd.size`` devices: its marks (pin an intermediate's sharding, run a backend's kernels
    per shard); the linear's tensors hold the N shards side by side."""
    process: ProcessShard | None = None
    """One process per shard: this process's place (its rank, the group's all-reduce); the linear's tensors hold its
    shard alone."""

    def __post_init__(self) -> None:
        if self.spmd is not None and self.process is not None:
            raise ValueError("a linear's shards run in one SPMD program or one process each, not both")
        if self.fully_sharded and self.size == 1:
            raise ValueError("fully_sharded splits A and Bt over N > 1 shards; this linear is unsharded")

    @property
    def form(self) -> ShardForm:
        """How the shards run: none (unsharded), one SPMD program, one process per shard."""
        if self.spmd is not None:
            return "spmd"
        return "none" if self.process is None else "processes"

    @property
    def size(self) -> int:
        """N, the shards."""
        if self.spmd is not None:
            return self.spmd.size
        return 1 if self.process is None else self.process.size

    @property
    def local(self) -> int:
        """S, the shards this process's tensors hold side by side: N in one SPMD program (the linear's output is then
        shard-major, ``[T, S, sum(out) / S]``, and every part's rows ``A [N, S, in_s]``, ``Bt [N, S, out_s]``), else
        1."""
        return self.size if self.spmd is not None else 1


class FusedParts(NamedTuple):
    """Consecutive parts whose A rows are adjacent column blocks of one pool tensor: one fused shrink for all."""

    first: int
    """The first part's index."""
    a_parts: torch.Tensor
    """Shape: [N, P, in], a view of the pool (no copy): ``a_parts[:, i]`` is part ``first + i``'s A rows."""

    @property
    def parts(self) -> range:
        return range(self.first, self.first + self.a_parts.shape[1])


class PartGroup(NamedTuple):
    """Consecutive parts with LoRA that one :func:`kernels.apply_parts` call serves (a fused run, or one part)."""

    columns: slice
    """The group's columns of the layer's output [T, sum(out)]."""
    a_parts: torch.Tensor
    """Shape: [N, P, in], a view of the pool."""
    bt_parts: tuple[torch.Tensor, ...]
    """P views [N, out_p] of the pool."""
    whole: bool
    """The group covers every column of the output (no slice to take)."""


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether b's columns start where a's end in the same storage, with the same shape and strides."""
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and b.data_ptr() == a.data_ptr() + a.shape[1] * a.stride(1) * a.element_size()
    )


def _fused_runs(a_rows: list[torch.Tensor | None]) -> tuple[FusedParts, ...]:
    """The runs of ≥ 2 consecutive parts whose A rows (``[N, in]`` each, None = no LoRA) are adjacent column blocks
    of one tensor, each as one ``[N, P, in]`` view (devices that keep views: :meth:`LinearLoRA.build`)."""
    runs, part = [], 0
    while part < len(a_rows):
        first = last = a_rows[part]
        end = part + 1
        if first is not None:
            while end < len(a_rows) and (nxt := a_rows[end]) is not None and _adjacent(last, nxt):
                last, end = nxt, end + 1
        if first is not None and end - part >= 2:
            count, (rows, features), (row_stride, col_stride) = end - part, first.shape, first.stride()
            view = first.as_strided((rows, count, features), (row_stride, features * col_stride, col_stride))
            runs.append(FusedParts(part, view))
        part = end
    return tuple(runs)


@dataclass
class LinearLoRA:
    """The LoRA of one linear of ``out_features`` parts (q/k/v, gate/up; one part for o, down), attached by reference
    to the pool's rows: a slot load, which writes the pool in place, is seen by the next step.

    Example, q/k/v with every part attached from the pool's row layout (A_q|A_k|A_v adjacent): ``fused`` is one
    run (0, [N, 3, in]), ``groups`` one group over every column, so an eager step shrinks q, k and v in one call.
    """

    out_features: tuple[int, ...]
    parts: tuple[Stacks | None, ...]
    """Each part's rows, None where the part has no LoRA."""
    fused: tuple[FusedParts, ...]
    groups: tuple[PartGroup, ...]
    """The fused runs, and every other part with rows on its own as a one-part view (eager devices)."""
    kernel_groups: LoRAGroups
    """``groups`` as the one-call forms take them."""
    unit_groups: bool
    """Every group's rows have unit inner stride (what the C++ kernels read)."""
    fuse_shrink: bool = True
    """Shrink a fused run's parts in one call (False: one shrink per part; benchmarks compare the two)."""
    one_call: bool = True
    """Offer the backend the base matmul and the LoRA as one call (False: the base matmul, then the step's form)."""
    shards: LinearShards = field(default_factory=LinearShards)
    """How the linear is split over the tensor-parallel shards (:class:`LinearShards`; the default: unsharded). With
    ``shards.fully_sharded`` and one process per shard the parts' rows are this process's section of them,
    ``A [N, in/G]`` or ``Bt [N, out/G]`` over G processes (``kernels.sharded.process_fully_sharded``)."""
    vector_groups: tuple[tuple[slice, torch.Tensor], ...] = ()
    """Eager devices: the parts' vector rows joined where adjacent in the pool (q|k|v, gate|up are), each as (the
    group's columns of the output, a ``[S + 1, columns]`` view): one gather or add per group, not per part."""
    vector_args: tuple[tuple[torch.Tensor, ...], tuple[int, ...]] | None = None
    """``vector_groups`` as the C++ epilogue takes them, made once: (each group's vectors, each group's first
    column); None where a group lacks unit inner stride (or there are none)."""

    @classmethod
    def build(
        cls,
        out_features: tuple[int, ...],
        parts: tuple[Stacks | None, ...],
        fuse_shrink: bool,
        one_call: bool,
        shards: LinearShards | None = None,
        keeps_views: bool = True,
    ) -> LinearLoRA:
        """``keeps_views``: views of the pool kept across steps stay views (eager devices: the platform's
        ``keeps_views``); False: no runs, groups or vector groups (XLA hands out fresh views per step, and a view
        kept across steps would be materialised as a copy of its own; its executor reads the parts)."""
        fused = _fused_runs([None if s is None else s.a for s in parts]) if keeps_views else ()
        groups = _groups(out_features, parts, fused) if keeps_views else ()
        kernel_groups = LoRAGroups(
            tuple(g.a_parts for g in groups),
            tuple(bt for g in groups for bt in g.bt_parts),
            tuple(g.columns.start for g in groups),
        )
        unit = all(g.a_parts.stride(2) == 1 and all(b.stride(1) == 1 for b in g.bt_parts) for g in groups)
        vectors = _vector_groups(out_features, parts) if keeps_views else ()
        args = None
        if vectors and all(v.stride(1) == 1 for _, v in vectors):
            args = (tuple(v for _, v in vectors), tuple(c.start for c, _ in vectors))
        split = shards or LinearShards()
        return cls(out_features, parts, fused, groups, kernel_groups, unit, fuse_shrink, one_call, split, vectors, args)


def _groups(
    out_features: tuple[int, ...], parts: tuple[Stacks | None, ...], fused: tuple[FusedParts, ...]
) -> tuple[PartGroup, ...]:
    runs = {run.first: run for run in fused}
    groups, part, starts = [], 0, [sum(out_features[:p]) for p in range(len(out_features) + 1)]
    while part < len(parts):
        stacks = parts[part]
        if part in runs:
            run = runs[part]
            bts = tuple(parts[p].bt for p in run.parts)  # type: ignore[union-attr]
            columns = slice(starts[part], starts[run.parts.stop])
            groups.append(PartGroup(columns, run.a_parts, bts, columns == slice(0, starts[-1])))
            part = run.parts.stop
            continue
        if stacks is not None:
            columns = slice(starts[part], starts[part + 1])
            groups.append(PartGroup(columns, stacks.a.unsqueeze(1), (stacks.bt,), columns == slice(0, starts[-1])))
        part += 1
    return tuple(groups)


def _vector_groups(
    out_features: tuple[int, ...], parts: tuple[Stacks | None, ...]
) -> tuple[tuple[slice, torch.Tensor], ...]:
    """Runs of consecutive parts whose vector rows (``[S + 1, out_p]`` each) are adjacent columns of one tensor, each
    as (its output columns, one ``[S + 1, columns]`` view) (devices that keep views: :meth:`LinearLoRA.build`)."""
    groups: list[tuple[slice, torch.Tensor]] = []
    start = 0
    for out, stacks in zip(out_features, parts, strict=True):
        vector = None if stacks is None else stacks.vector
        if vector is not None:
            if groups and _adjacent_columns(groups[-1][1], vector) and groups[-1][0].stop == start:
                columns, joined = groups[-1]
                wider = joined.as_strided((joined.shape[0], joined.shape[1] + out), joined.stride())
                groups[-1] = (slice(columns.start, start + out), wider)
            else:
                groups.append((slice(start, start + out), vector))
        start += out
    return tuple(groups)


def _adjacent_columns(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether b's columns start where a's end in the same storage, with the same row stride and unit columns."""
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.shape[0] == b.shape[0]
        and a.stride() == b.stride()
        and a.stride(1) == 1
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and b.data_ptr() == a.data_ptr() + a.shape[1] * a.element_size()
    )
