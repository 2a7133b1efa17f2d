"""Linear executors: how one backend runs a linear's base matmul and its LoRA for a step (vLLM's ``PunicaWrapper``).

Each backend names its executor (``executor_type``); the step's metadata holds the one of its backend
(:attr:`LoRAKernelMeta.executor`), so a layer calls ``step.executor.linear(x, weight, lora, step)`` and never branches
on the device or the form:

- :class:`LinearExecutor` (torch forms, reference, triton): the base matmul, then the step's form — one
  ``apply_parts`` per group on FUSED steps (the triton backend's BGMV / SGMV), else shrink / expand per part (fused
  shrink for adjacent parts), the LoRA written first and the base matmul added by one ``addmm_`` on a plain weight.
- :class:`CpuExecutor`: first the cpu backend's one-call form (base matmul and LoRA in one C++ call for the weight's
  layout), else as above.
- :class:`TracedExecutor` (laned XLA, Pallas): the base matmul plus one laned shrink / expand per part, new tensors
  (static shapes, no in-place update).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from adapter_manager.kernels.linear_lora import LinearLoRA
from adapter_manager.kernels.meta import LoRAKernelMeta
from adapter_manager.kernels.ops import apply_parts, expand, shrink, shrink_parts
from adapter_manager.kernels.protocol import LinearWeight, WeightLayout
from adapter_manager.kernels.vectors import apply_vectors

if TYPE_CHECKING:
    from adapter_manager.kernels.device_kernels import LayerKernels


class LinearStep(NamedTuple):
    """What every linear of one forward step shares."""

    executor: LinearExecutor
    meta: LoRAKernelMeta | None
    """The step's LoRA metadata; None: the base model only."""
    kernels: LayerKernels
    """The device's base matmuls (:func:`kernels.layer_ops.layer_kernels`)."""
    fast: bool
    """The device's compiled decode glue is on: a plain weight may take the decode linear and the one-call forms."""

    @classmethod
    def make(cls, meta: LoRAKernelMeta | None, kernels: LayerKernels, fast: bool) -> LinearStep:
        return cls(LinearExecutor() if meta is None else meta.executor, meta, kernels, fast)


class LinearExecutor:
    """The eager composition (torch forms, reference, triton); also the base-only executor of a step without LoRA."""

    def __init__(self, backend: object | None = None) -> None:
        self.backend = backend

    def linear(self, x: torch.Tensor, weight: LinearWeight, lora: LinearLoRA | None, step: LinearStep) -> torch.Tensor:
        """Semantics::

            y = x @ W.T                                         # all parts in one matmul, W in its layout
            for each part p with rows (A_p, Bt_p), unless step.meta is None or meta.no_adapter:
                y[:, part p] += x[t] @ A_p[rows of slot[t]].T @ Bt_p[rows of slot[t]]  per token t
            then each part's vector epilogue (:func:`kernels.vectors.apply_vectors`: DoRA's scale, LoRA's bias)

        Shape: x [T, in]; returns a new [T, sum(out)]."""
        meta = step.meta
        if lora is None or meta is None or meta.no_adapter:
            return step.kernels.linear(x, weight, step.fast)
        y = self._with_lora(x, weight, lora, meta, step)
        return y if meta.bias_index is None and meta.scale_index is None else apply_vectors(y, lora, meta)

    def _with_lora(
        self, x: torch.Tensor, weight: LinearWeight, lora: LinearLoRA, meta: LoRAKernelMeta, step: LinearStep
    ) -> torch.Tensor:
        if lora.shards > 1:
            raise ValueError(
                f"a linear sharded {lora.shards} ways runs on a traced backend (one SPMD program); "
                f"{type(self).__name__} runs one device's shard"
            )
        if meta.fused:  # the backend applies each group's LoRA in one call, onto the base output
            y = step.kernels.linear(x, weight)
            for group in lora.groups:
                apply_parts(y if group.whole else y[:, group.columns], x, group.a_parts, group.bt_parts, meta)
            return y
        packed = not step.kernels.plain_matmul(x, weight)  # a packed / oneDNN matmul writes y, the LoRA adds onto it
        y = step.kernels.linear(x, weight) if packed else x.new_empty(x.shape[0], sum(lora.out_features))
        parts = list(y.split(lora.out_features, dim=-1)) if len(lora.out_features) > 1 else [y]
        h: dict[int, torch.Tensor] = {}  # part -> its shrink output [T, R]
        for run in lora.fused if lora.fuse_shrink else ():
            h.update(zip(run.parts, shrink_parts(x, run.a_parts, meta), strict=True))  # [P, T, R]
        for index, stacks in enumerate(lora.parts):
            if stacks is None:
                if not packed:
                    parts[index].zero_()
            else:
                part_h = h[index] if index in h else shrink(x, stacks.a, meta)
                expand(parts[index], part_h, stacks.bt, meta, accumulate=packed)  # packed: onto the base output
        if not packed:
            y.addmm_(x, weight.tensor.t())  # y = LoRA terms + x @ W.T, one pass
        return y


class CpuExecutor(LinearExecutor):
    """The cpu backend's: the base matmul, the step's LoRA and a LoRA variant's vector epilogue in one C++ call where
    its backend has a form for the weight's layout and the step (``fused_linear``), else the eager composition and
    the epilogue in one C++ call per group of adjacent parts."""

    def linear(self, x: torch.Tensor, weight: LinearWeight, lora: LinearLoRA | None, step: LinearStep) -> torch.Tensor:
        meta = step.meta
        if lora is None or meta is None or meta.no_adapter:
            return step.kernels.linear(x, weight, step.fast)
        backend = self.backend
        vectors = meta.bias_index is not None or meta.scale_index is not None
        epilogue = backend.epilogue(lora, meta) if vectors else None  # type: ignore[union-attr]
        offered = weight.layout is not WeightLayout.PLAIN or step.fast  # a plain weight only with the decode glue on
        if lora.one_call and lora.unit_groups and offered and (epilogue is not None or not vectors):
            y = backend.fused_linear(x, weight, lora.kernel_groups, meta, epilogue)  # type: ignore[union-attr]
            if y is not None:
                return y
        y = self._with_lora(x, weight, lora, meta, step)
        if not vectors:
            return y
        if epilogue is not None and y.device.type == "cpu" and y.stride(1) == 1:
            backend.vectors(y, epilogue)  # type: ignore[union-attr]
            return y
        return apply_vectors(y, lora, meta)


class TracedExecutor(LinearExecutor):
    """The traced backends' (laned XLA, Pallas): the base matmul plus one laned shrink / expand per part, each a new
    tensor; the graph depends only on (token bucket, active bucket)."""

    def _with_lora(
        self, x: torch.Tensor, weight: LinearWeight, lora: LinearLoRA, meta: LoRAKernelMeta, step: LinearStep
    ) -> torch.Tensor:
        if lora.shards > 1:
            return _sharded(x, weight, lora, meta, step)
        y = step.kernels.linear(x, weight)
        if len(lora.out_features) == 1:
            stacks = lora.parts[0]
            return y if stacks is None else expand(y, shrink(x, stacks.a, meta), stacks.bt, meta)
        parts = list(y.split(lora.out_features, dim=-1))
        for index, stacks in enumerate(lora.parts):
            if stacks is not None:
                parts[index] = expand(parts[index], shrink(x, stacks.a, meta), stacks.bt, meta)
        return torch.cat(parts, dim=-1)


def _sharded(
    x: torch.Tensor, weight: LinearWeight, lora: LinearLoRA, meta: LoRAKernelMeta, step: LinearStep
) -> torch.Tensor:
    """A linear whose tensors hold S shards side by side (one SPMD program: GSPMD keeps each shard on its device).

    Semantics (S shards, every part's rows ``A [N, S, in_s]``, ``Bt [N, S, out_s]``, laned over the active table)::

        column-parallel (q/k/v, gate/up): y = x @ W.T                  # [T, S, sum(out_s)], shard-major
            y[:, s, part p] += lanes(x @ A_p[:, s].T) @ Bt_p[:, s]      # each shard expands only its columns
        row-parallel (o, down): x = x.view(T, S, in_s)                  # each shard holds its input features
            y = sum over s of (x_s @ W_s.T + lanes(x_s @ A[:, s].T) @ Bt[:, s])   # partials joined, then ONE sum

    The sum over s is the layer's one all-reduce: the LoRA joins the base before it, so it adds no collective.
    Fully sharded (:attr:`LinearLoRA.fully_sharded`): each shard's A covers its slice of the input, so the lanes
    ``h = sum over s of x_s @ A[:, s].T`` ([T, lanes] for every part at once) are one all-reduce per linear; then
    column-parallel shards expand their output columns as above, and row-parallel ones their hidden slice of the
    output (``Bt [N, S, hidden / S]``), added to the summed base output.
    Shape: x [T, in]; returns a new [T, sum(out)].
    """
    tokens, shards = x.shape[0], lora.shards
    token_compact, gather_rows, lane_owner = meta.args()
    own = token_compact[:, None] == lane_owner[None, :]  # [T, A·R]: a token's own lanes
    zero = torch.zeros((), dtype=x.dtype, device=x.device)

    def rows(stacks) -> tuple[torch.Tensor, torch.Tensor]:  # [A·R, S, in_s], [A·R, S, out_s]
        return stacks.a.index_select(0, gather_rows), stacks.bt.index_select(0, gather_rows)

    def lanes(x3: torch.Tensor, stacks) -> torch.Tensor:  # x3 [T, S, in_s] -> [T, S, out_s]
        a, bt = rows(stacks)
        h = torch.where(own[:, None, :], torch.einsum("tsi,lsi->tsl", x3, a), zero)
        return torch.einsum("tsl,lso->tso", h, bt)

    def summed_lanes(x3: torch.Tensor, parts: list) -> list[torch.Tensor]:  # fully sharded: each part's [T, A·R]
        h = torch.cat([torch.einsum("tsi,lsi->tsl", x3, rows(stacks)[0]) for stacks in parts], dim=2).sum(dim=1)
        return [torch.where(own, piece, zero) for piece in h.chunk(len(parts), dim=1)]  # one all-reduce above

    if lora.row_parallel:
        x3 = x.view(tokens, shards, -1)  # [T, S, in_s]
        w3 = weight.tensor.view(weight.tensor.shape[0], shards, -1)  # [out, S, in_s]
        y3 = torch.einsum("tsi,osi->tso", x3, w3)  # the shards' partial outputs
        stacks = lora.parts[0]
        if stacks is None:
            return y3.sum(dim=1)
        if not lora.fully_sharded:
            return (y3 + lanes(x3, stacks)).sum(dim=1)
        (h,) = summed_lanes(x3, [stacks])
        z = torch.einsum("tl,lso->tso", h, rows(stacks)[1])  # [T, S, hidden / S]: shard s's slice of the output
        # Shard s adds its slice into its own partial output (zero in the others' slices), so the layer's one
        # all-reduce joins them: z [T, S, 1, hidden / S] times the identity over (s, slice) -> [T, S, S, hidden / S].
        own_slice = torch.eye(shards, dtype=x.dtype, device=x.device)[:, :, None]
        y4 = y3.view(tokens, shards, shards, -1) + z[:, :, None, :] * own_slice
        return y4.sum(dim=1).reshape(tokens, -1)
    y3 = step.kernels.linear(x, weight).view(tokens, shards, -1)  # [T, S, sum(out_s)]
    pieces = list(y3.split([out // shards for out in lora.out_features], dim=2))
    with_lora = [index for index, stacks in enumerate(lora.parts) if stacks is not None]
    if lora.fully_sharded:
        # Pinned whole on every device, each reading its slice: left to the partitioner, the slices the shrink reads
        # split the norm and the residual by hidden, and x was all-gathered before every column-parallel linear.
        x = x if lora.pin is None else lora.pin(x, None)
        hs = summed_lanes(x.view(tokens, shards, -1), [lora.parts[index] for index in with_lora])
        for index, h in zip(with_lora, hs, strict=True):
            pieces[index] = pieces[index] + torch.einsum("tl,lso->tso", h, rows(lora.parts[index])[1])
    else:
        x3 = x.unsqueeze(1).expand(tokens, shards, x.shape[1])  # every shard reads all of x
        for index in with_lora:
            pieces[index] = pieces[index] + lanes(x3, lora.parts[index])
    return torch.cat(pieces, dim=2).reshape(tokens, -1)
