"""Tensor-parallel linears: those of one SPMD program over S devices (XLA), whose tensors hold the S shards side by
side while GSPMD keeps each shard on its device (:func:`sharded_linear`), and one process's shard of a fully sharded
linear (one process per shard, CPU: :func:`process_fully_sharded`).

Semantics (S shards, every part's rows ``A [N, S, in_s]``, ``Bt [N, S, out_s]``, laned over the active table)::

    column-parallel (q/k/v, gate/up): y = x @ W.T                  # [T, S, sum(out_s)], shard-major
        y[:, s, part p] += lanes(x @ A_p[:, s].T) @ Bt_p[:, s]      # each shard expands only its columns
    row-parallel (o, down): x = x.view(T, S, in_s)                  # each shard holds its input features
        y = sum over s of (x_s @ W_s.T + lanes(x_s @ A[:, s].T) @ Bt[:, s])   # partials joined, then ONE sum

The sum over s is the layer's one all-reduce: the LoRA joins the base before it, so it adds no collective. Fully
sharded (:attr:`LinearShards.fully_sharded`): each shard's A covers its slice of the input, so the shrink outputs
``h = sum over s of x_s @ A[:, s].T`` (each token's own [r] per part, every part at once) are one all-reduce per
linear; then
column-parallel shards expand their output columns as above, and row-parallel ones their hidden slice of the output
(``Bt [N, S, hidden / S]``), added into their own partial output before the layer's all-reduce.

Two forms of the same math: the laned einsums (the xla backend's), which GSPMD partitions like any op; and the
backend's own shrink / expand run per shard under manual sharding (:class:`kernels.linear_lora.ShardHooks`), for
kernels GSPMD cannot partition (the Pallas backend's: ``per_shard``), each device calling them at its shard's shapes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from adapter_manager.kernels.linear_lora import LinearLoRA, ShardHooks
from adapter_manager.kernels.meta import LoRAKernelMeta
from adapter_manager.kernels.ops import expand, shrink
from adapter_manager.kernels.protocol import LinearWeight


def sharded_linear(
    x: torch.Tensor,
    weight: LinearWeight,
    lora: LinearLoRA,
    meta: LoRAKernelMeta,
    base: Callable[[torch.Tensor, LinearWeight], torch.Tensor],
    backend: object,
) -> torch.Tensor:
    """The module docstring's semantics over ``lora.shards`` (one SPMD program: its marks); ``base`` is the device's
    matmul (``x @ W.T``), ``backend`` the step's. Shape: x [T, in]; returns a new [T, sum(out)]."""
    split, tokens = lora.shards, x.shape[0]
    marks, shards = split.spmd, split.local
    assert marks is not None, "sharded_linear runs the linears of one SPMD program"
    form = _PerShard(marks, backend, meta) if getattr(backend, "per_shard", False) else _Laned(meta)
    with_lora = [index for index, stacks in enumerate(lora.parts) if stacks is not None]
    if split.row_parallel:
        x3 = x.view(tokens, shards, -1)  # [T, S, in_s]
        w3 = weight.tensor.view(weight.tensor.shape[0], shards, -1)  # [out, S, in_s]
        y3 = torch.einsum("tsi,osi->tso", x3, w3)  # the shards' partial outputs
        if not with_lora:
            return y3.sum(dim=1)
        stacks = lora.parts[0]
        if not split.fully_sharded:
            return form.lanes(y3, x3, stacks).sum(dim=1)  # x3 split: each shard its input features
        (h,) = form.summed_shrinks(x3, [stacks])
        z = form.expand(h, stacks, y3.new_zeros(tokens, shards, y3.shape[2] // shards))  # [T, S, hidden / S]
        # Shard s adds its slice into its own partial output (zero in the others' slices), so the layer's one
        # all-reduce joins them: z [T, S, 1, hidden / S] times the identity over (s, slice) -> [T, S, S, hidden / S].
        own_slice = torch.eye(shards, dtype=x.dtype, device=x.device)[:, :, None]
        y4 = y3.view(tokens, shards, shards, -1) + z[:, :, None, :] * own_slice
        return y4.sum(dim=1).reshape(tokens, -1)
    y3 = base(x, weight).view(tokens, shards, -1)  # [T, S, sum(out_s)]
    pieces = list(y3.split([out // shards for out in lora.out_features], dim=2))
    if split.fully_sharded:
        # Pinned whole on every device, each reading its slice: left to the partitioner, the slices the shrink reads
        # split the norm and the residual by hidden, and x was all-gathered before every column-parallel linear.
        x = marks.pin(x, None)
        hs = form.summed_shrinks(x.view(tokens, shards, -1), [lora.parts[index] for index in with_lora])
        for index, h in zip(with_lora, hs, strict=True):
            pieces[index] = form.expand(h, lora.parts[index], pieces[index])
    else:
        for index in with_lora:
            pieces[index] = form.lanes(pieces[index], x, lora.parts[index])  # x [T, in]: every shard reads all of it
    return torch.cat(pieces, dim=2).reshape(tokens, -1)


def process_fully_sharded(
    x: torch.Tensor,
    weight: LinearWeight,
    lora: LinearLoRA,
    meta: LoRAKernelMeta,
    base: Callable[[torch.Tensor, LinearWeight], torch.Tensor],
) -> torch.Tensor:
    """One process's shard of a fully sharded linear (one process per shard, ``lora.shards.process`` of G): the module
    docstring's semantics on this process's section, the shrink outputs summed over the processes (one all-reduce per
    linear, every part's together); a row-parallel output's LoRA goes into this process's hidden slice of its
    partial output, which the layer's all-reduce then joins.

    Shape: x [T, in] (column-parallel: the whole input, this process's A covers its slice ``in / G``; row-parallel:
    this process's input features); returns a new [T, sum(out)].
    """
    split = lora.shards
    group = split.process
    assert group is not None and split.fully_sharded, "process_fully_sharded runs a fully sharded linear's process"
    y = base(x, weight)
    with_lora = [index for index, stacks in enumerate(lora.parts) if stacks is not None]
    if not split.row_parallel:
        width = x.shape[1] // group.size
        x = x[:, group.rank * width : (group.rank + 1) * width].contiguous()
    hs = [shrink(x, lora.parts[index].a, meta) for index in with_lora]  # type: ignore[union-attr]
    joined = group.all_reduce(torch.cat(hs, dim=1) if len(hs) > 1 else hs[0])
    hs = list(joined.split([h.shape[1] for h in hs], dim=1))
    if split.row_parallel:
        width = y.shape[1] // group.size
        own = y[:, group.rank * width : (group.rank + 1) * width]  # zero in the other processes' partial outputs
        expand(own, hs[0], lora.parts[0].bt, meta, accumulate=True)  # type: ignore[union-attr]
        return y
    parts = list(y.split(lora.out_features, dim=1)) if len(lora.out_features) > 1 else [y]
    for index, h in zip(with_lora, hs, strict=True):
        expand(parts[index], h.contiguous(), lora.parts[index].bt, meta, accumulate=True)  # type: ignore[union-attr]
    return y


class _Laned:
    """The laned einsums over the shard axis: GSPMD partitions them like the base's matmuls."""

    def __init__(self, meta: LoRAKernelMeta) -> None:
        self.rank = meta.rank
        self.token_compact, self.gather_rows, lane_owner = meta.args()
        self.own = self.token_compact[:, None] == lane_owner[None, :]  # [T, A·R]: a token's own lanes

    def lanes(self, y3: torch.Tensor, x: torch.Tensor, stacks) -> torch.Tensor:  # noqa: ANN001
        """``y3 + lanes(x_s @ A.T) @ Bt`` per shard. Shape: y3 [T, S, out_s]; x [T, S, in_s] (each shard its input
        features) or [T, in] (every shard all of it)."""
        x3 = x if x.dim() == 3 else x.unsqueeze(1).expand(x.shape[0], y3.shape[1], x.shape[1])
        a, bt = stacks.a.index_select(0, self.gather_rows), stacks.bt.index_select(0, self.gather_rows)
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        h = torch.where(self.own[:, None, :], torch.einsum("tsi,lsi->tsl", x3, a), zero)
        return y3 + torch.einsum("tsl,lso->tso", h, bt)

    def summed_shrinks(self, x3: torch.Tensor, parts: list) -> list[torch.Tensor]:
        """Each part's lanes summed over the shards (one all-reduce for every part): [T, A·R] each."""
        rows = [stacks.a.index_select(0, self.gather_rows) for stacks in parts]  # [A·R, S, in_s]
        h = torch.cat([torch.einsum("tsi,lsi->tsl", x3, a) for a in rows], dim=2)  # [T, S, P·A·R], partial
        return _summed_own_lanes(h, self.own, len(parts), self.rank)

    def expand(self, h: torch.Tensor, stacks, y3: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        """``y3 + h @ Bt`` per shard, h whole. Shape: h [T, A·R], y3 [T, S, out_s]."""
        return y3 + torch.einsum("tl,lso->tso", h, stacks.bt.index_select(0, self.gather_rows))


class _PerShard:
    """The backend's shrink / expand on each device's shard, between manual-sharding marks."""

    def __init__(self, spmd: ShardHooks, backend: object, meta: LoRAKernelMeta) -> None:
        self.spmd, self.backend = spmd, backend
        token_compact, _, lane_owner = meta.args()
        self.own = token_compact[:, None] == lane_owner[None, :]  # [T, A·R]: a token's own lanes
        self.rank = meta.rank
        # The step's operands whole on each device, cloned first: marking lane_owner (kept per active width across
        # steps) in place changed its sharding between steps, and a graph traced before the mark compiled again.
        self.meta = meta.on_shard(lambda t: spmd.local(t.clone(), None))

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:  # [N, S, F] -> this device's [N, F]
        return self.spmd.local(rows, 1).view(rows.shape[0], -1)

    def lanes(self, y3: torch.Tensor, x: torch.Tensor, stacks) -> torch.Tensor:  # noqa: ANN001
        tokens = y3.shape[0]
        x_s = self.spmd.local(x, 1).view(tokens, -1) if x.dim() == 3 else self.spmd.local(x, None)
        y_s = self.spmd.local(y3, 1).view(tokens, -1)
        h = self.backend.shrink(x_s, self._rows(stacks.a), self.meta)  # type: ignore[attr-defined]
        y_s = self.backend.expand(y_s, h, self._rows(stacks.bt), self.meta)  # type: ignore[attr-defined]
        return self.spmd.join(y_s.view(tokens, 1, -1), 1, tuple(y3.shape))

    def summed_shrinks(self, x3: torch.Tensor, parts: list) -> list[torch.Tensor]:
        tokens, shards, _ = x3.shape
        x_s = self.spmd.local(x3, 1).view(tokens, -1)
        shrink = self.backend.shrink  # type: ignore[attr-defined]
        h_s = torch.cat([shrink(x_s, self._rows(p.a), self.meta) for p in parts], dim=1)  # [T, P·A·R], partial
        h = self.spmd.join(h_s.view(tokens, 1, -1), 1, (tokens, shards, h_s.shape[1]))
        return _summed_own_lanes(h, self.own, len(parts), self.rank)

    def expand(self, h: torch.Tensor, stacks, y3: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        tokens = y3.shape[0]
        y_s, h_s = self.spmd.local(y3, 1).view(tokens, -1), self.spmd.local(h, None)
        y_s = self.backend.expand(y_s, h_s, self._rows(stacks.bt), self.meta)  # type: ignore[attr-defined]
        return self.spmd.join(y_s.view(tokens, 1, -1), 1, tuple(y3.shape))


def _summed_own_lanes(h: torch.Tensor, own: torch.Tensor, parts: int, rank: int) -> list[torch.Tensor]:
    """The shards' partial laned shrink outputs ``h [T, S, P·A·R]`` summed over S, each part's as ``[T, A·R]``.

    A token's rows are one adapter's R lanes, so each part's lanes are first folded to the token's own R (a masked
    sum over A, on each device), the ``[T, P, R]`` summed over the shards (the one all-reduce: the floor's bytes, not
    A times them), then put back in the token's lanes for the laned expand. ``own [T, A·R]``: a token's lanes."""
    tokens, shards, _ = h.shape
    lanes = own.shape[1]
    own4 = own.view(tokens, 1, lanes // rank, rank).to(h.dtype)  # [T, 1, A, R]
    folded = (h.view(tokens, shards, parts, lanes // rank, rank) * own4[:, None]).sum(dim=3)  # [T, S, P, R]
    summed = folded.sum(dim=1)  # [T, P, R]: the all-reduce
    return list((summed[:, :, None, :] * own4).reshape(tokens, parts, lanes).unbind(1))
