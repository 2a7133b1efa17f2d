"""The row layout shared by prepared adapters and the slot pool: one rank row of an adapter holds every module.

Row ``i`` of an adapter is one flat run of ``width`` elements: for each layer, the i-th row of ``A`` of every
projection, then the i-th row of ``Bt`` of every projection (projections in `PROJECTIONS` order, so the parts of a
fused base linear — q/k/v, gate/up — sit side by side)::

    row i = [ L0: A_q[i] A_k[i] A_v[i] A_o[i] A_gate[i] A_up[i] A_down[i]  Bt_q[i] Bt_k[i] ... Bt_down[i] | L1: ... ]

An adapter of rank r is an ``[r, width]`` block: it moves host -> slot as ONE contiguous copy, its memory is
proportional to its own rank, and each module's weights are strided views of it (row stride ``width``, inner stride
1): ``A = block[:, a_start : a_start + in]`` (Shape: [r, in]) and ``Bt = block[:, bt_start : bt_start + out]``
(Shape: [r, out]). The slot pool is the same layout with N rows: the rows of all resident adapters, one range each.

Over N tensor-parallel shards (:class:`sharding.TensorParallel`) a row is N equal **sections** side by side, section
s holding shard s's pieces in the same order: column-parallel modules' whole A and their Bt columns of shard s,
row-parallel modules' A columns of shard s and their whole Bt. A device holds its section of every row (the pool's
row tensor is split by sections), and each module's views gain the section axis: ``A [r, N, in_s]``,
``Bt [r, N, out_s]``. A prepared block over N sections is section-major in memory (``[N, r, W_s]``, seen as
``[r, N, W_s]``: :meth:`RowLayout.block`), so the piece one device receives is one contiguous copy.

With ``fully_sharded_loras`` (:class:`sharding.TensorParallel`) section s holds the column-parallel modules' A columns
of its hidden slice and the row-parallel ones' Bt columns of it as well: 1/N of the row each.

An adapter with a per-output vector on each module (DoRA's scale, LoRA's bias: `sources.peft_format.Variant`) holds
it in a **vector row** of ``vector_width`` elements, in the same order and sections as the Bt pieces of a row::

    vector row = [ L0: v_q v_k v_v v_o v_gate v_up v_down | L1: ... ]     (v_p: out_p elements)

The pool keeps one vector row per slot beside its rows (`slot_pool.SlotPool.vectors`): half a row's width, so an
adapter's rows stay its rank's power-of-two units, and the parts of a fused linear are adjacent there as well.

With the **vocabulary columns** on (``vocab``: embedding and lm_head LoRA, trainable tokens; one device only) a row
ends with the two vocabulary modules, after the last layer::

    row i = [ L0 ... | L_last ... | A_embed[i] (V) Bt_embed[i] (H) A_head[i] (H) Bt_head[i] (V) ]

(V the vocabulary, H the hidden size): ``2·(V + H)`` more elements per row, for every adapter. They have no vector.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..base_model import MAX_RANK, PROJECTIONS, BaseModelSpec, ModuleKey
from ..sharding import TensorParallel


@dataclass(frozen=True)
class ModuleColumns:
    """Where one module's A and Bt pieces lie inside a row's section (the whole row when unsharded)."""

    a_start: int
    in_features: int  # the section's A width: a row-parallel module's shard of its input features
    bt_start: int
    out_features: int  # the section's Bt width: a column-parallel module's shard of its output features
    vector_start: int  # where its vector (out_features wide) lies inside a vector row's section; -1: it has none


@dataclass(frozen=True)
class RowLayout:
    """Column ranges of every module in one row's section; build it with :meth:`of`."""

    columns: Mapping[ModuleKey, ModuleColumns]  # offsets inside a section, the section's (local) widths
    width: int  # elements of one row: every section's
    sections: int  # N tensor-parallel shards, one section each; 1: the unsharded layout
    section_width: int  # elements of one section: sum over modules of (in_s + out_s)
    tensor_parallel: TensorParallel  # the plan the sections follow
    vector_width: int  # elements of one vector row: every section's (sum over modules of out_s, times N)
    vocab: bool = False  # the row ends with the vocabulary modules' columns (embed_tokens, lm_head)

    def __post_init__(self) -> None:
        if self.sections != self.tensor_parallel.size or self.width != self.sections * self.section_width:
            raise ValueError(
                f"{self.sections} sections (tensor_parallel.size {self.tensor_parallel.size}) of {self.section_width} "
                f"elements make a row of {self.sections * self.section_width}, got width {self.width}"
            )

    @classmethod
    def of(cls, spec: BaseModelSpec, tp: TensorParallel | None = None, vocab: bool = False) -> RowLayout:
        """The layout of ``spec``'s projections over ``tp``'s sections; ``vocab``: with the vocabulary columns (one
        section only, and a spec that knows its vocabulary)."""
        tp = tp or TensorParallel()
        tp.check(spec)
        if vocab and (tp.size > 1 or spec.vocab_size <= 0):
            raise ValueError(
                f"the vocabulary columns need one section and a known vocabulary: got tensor_parallel_size {tp.size}, "
                f"vocab_size {spec.vocab_size}"
            )
        columns: dict[ModuleKey, ModuleColumns] = {}
        offset = vector_offset = 0
        for layer in range(spec.num_layers):
            shapes = [tp.lora_local_shape(spec, proj) for proj in PROJECTIONS]
            a_starts, bt_starts = [], []
            for fan_in, _ in shapes:
                a_starts.append(offset)
                offset += fan_in
            for _, fan_out in shapes:
                bt_starts.append(offset)
                offset += fan_out
            for i, proj in enumerate(PROJECTIONS):
                fan_in, fan_out = shapes[i]
                key = ModuleKey(layer, proj)
                columns[key] = ModuleColumns(a_starts[i], fan_in, bt_starts[i], fan_out, vector_offset)
                vector_offset += fan_out
        for key in spec.vocab_keys() if vocab else ():
            fan_in, fan_out = spec.projection_shape(key.proj)
            columns[key] = ModuleColumns(offset, fan_in, offset + fan_in, fan_out, -1)
            offset += fan_in + fan_out
        return cls(columns, offset * tp.size, tp.size, offset, tp, vector_offset * tp.size, vocab)

    def a_view(self, rows: torch.Tensor, key: ModuleKey) -> torch.Tensor:
        """Module ``key``'s A rows of a ``[n, width]`` tensor. Shape: [n, in] (over N sections [n, N, in_s]), a
        strided view."""
        c = self.columns[key]
        return self._sectioned(rows)[..., c.a_start : c.a_start + c.in_features]

    def bt_view(self, rows: torch.Tensor, key: ModuleKey) -> torch.Tensor:
        """Module ``key``'s Bt rows of a ``[n, width]`` tensor. Shape: [n, out] (over N sections [n, N, out_s]), a
        strided view."""
        c = self.columns[key]
        return self._sectioned(rows)[..., c.bt_start : c.bt_start + c.out_features]

    def vector_view(self, vectors: torch.Tensor, key: ModuleKey) -> torch.Tensor:
        """Module ``key``'s vector of a ``[n, vector_width]`` tensor of vector rows. Shape: [n, out] (over N
        sections [n, N, out_s]), a strided view."""
        c = self.columns[key]
        if c.vector_start < 0:
            raise ValueError(f"{key.module_name} has no vector")
        sectioned = vectors if self.sections == 1 else vectors.view(vectors.shape[0], self.sections, -1)
        return sectioned[..., c.vector_start : c.vector_start + c.out_features]

    def _sectioned(self, rows: torch.Tensor) -> torch.Tensor:
        if self.sections == 1 or rows.dim() == 3:  # a prepared block over N sections is [n, N, W_s] already
            return rows
        return rows.view(rows.shape[0], self.sections, self.section_width)

    def block_shape(self, rows: int) -> tuple[int, ...]:
        """A prepared block's shape: ``[r, width]``; over N sections ``[r, N, section_width]`` (:meth:`block`)."""
        return (rows, self.width) if self.sections == 1 else (rows, self.sections, self.section_width)

    def block(self, memory: torch.Tensor) -> torch.Tensor:
        """A prepared block of ``r`` rows over ``memory``, a contiguous ``[r, width]`` tensor: itself, or over N
        sections the ``[r, N, section_width]`` view of it as section-major memory (section s, ``block[:, s]``, is one
        contiguous ``[r, section_width]`` piece: what one device receives)."""
        if self.sections == 1:
            return memory
        return memory.view(self.sections, memory.shape[0], self.section_width).transpose(0, 1)

    def row_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one row, every section."""
        return self.width * dtype.itemsize

    def section_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one device's section of a row."""
        return self.section_width * dtype.itemsize


@dataclass(frozen=True)
class RowOptions:
    """What shapes an adapter's rows, chosen once and handed whole to the manager, the registry and the pool: the
    highest rank, the tensor-parallel plan the rows' sections follow, and the optional vector and vocabulary columns.
    :meth:`layout` is the one `RowLayout` they share. Each field's ``metadata`` is its serve flag (the CLI is made
    from it: `runtime.cli_args`)."""

    max_rank: int = field(
        default=MAX_RANK, metadata={"flag": "--max-rank", "help": "highest LoRA rank accepted, R (default %(default)s)"}
    )  # R: an adapter takes pool rows in proportion to its own rank, at most R
    tensor_parallel: TensorParallel = field(default_factory=TensorParallel)  # N sections per row, one per shard
    lora_vectors: bool = field(
        default=True,
        metadata={
            "flag": "--no-lora-vectors",
            "dest": "lora_vectors",
            "help": "no vector row per adapter slot (1/(2 x granule) of the pool's memory); DoRA and lora_bias "
            "adapters are then refused (default: served, docs/pool.md)",
        },
    )  # a vector row per slot: DoRA's scale and LoRA's bias served (not built with N > 1: no vector rows then)
    lora_vocab: bool = field(
        default=False,
        metadata={
            "flag": "--lora-vocab",
            "help": "give every adapter row vocabulary columns (2 x (vocab + hidden) elements more per row): adapters "
            "with embed_tokens / lm_head LoRA or trainable tokens are then served (default: refused, docs/pool.md)",
        },
    )  # the rows' vocabulary columns: embedding / lm_head LoRA and trainable tokens served (N = 1 only)

    def __post_init__(self) -> None:
        if not isinstance(self.max_rank, int) or isinstance(self.max_rank, bool) or self.max_rank <= 0:
            raise ValueError(f"max_rank must be a positive int, got {self.max_rank!r}")
        if not isinstance(self.tensor_parallel, TensorParallel):
            raise TypeError(f"tensor_parallel must be a TensorParallel, got {self.tensor_parallel!r}")
        if self.lora_vocab and self.tensor_parallel.size > 1:
            raise ValueError(f"lora_vocab with tensor_parallel_size {self.tensor_parallel.size} is not built")

    @property
    def has_vectors(self) -> bool:
        """Whether the pool keeps vector rows: ``lora_vectors`` without tensor parallelism."""
        return self.lora_vectors and self.tensor_parallel.size == 1

    def layout(self, spec: BaseModelSpec) -> RowLayout:
        """The rows' layout over ``spec``: ValueError if ``spec`` does not split ``tensor_parallel.size`` ways."""
        return RowLayout.of(spec, self.tensor_parallel, self.lora_vocab)


def checked_layout(spec: BaseModelSpec, rows: RowOptions, layout: RowLayout | None = None) -> RowLayout:
    """``layout`` (the one a manager derived from ``rows`` and hands its registry and pool), or for a component built
    on its own ``rows.layout(spec)``; ValueError if ``layout`` is not ``rows``' layout."""
    if layout is None:
        return rows.layout(spec)
    if layout.tensor_parallel != rows.tensor_parallel or layout.vocab != rows.lora_vocab:
        raise ValueError(
            f"a row layout over {layout.tensor_parallel} (vocab {layout.vocab}) for rows over {rows.tensor_parallel} "
            f"(vocab {rows.lora_vocab})"
        )
    return layout
