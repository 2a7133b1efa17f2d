"""Linear executors: how one backend runs a linear's base matmul and its LoRA for a step (vLLM's ``PunicaWrapper``).

Each backend names its executor (``executor_type``); the step's metadata holds the one of its backend
(:attr:`LoRAKernelMeta.executor`), so a layer calls ``step.executor.linear(x, weight, lora, step)`` and never branches
on the device or the form. An executor also names its step state (``meta_type``: the eager forms'
:class:`kernels.eager_meta.EagerMeta`, the traced compact table's :class:`kernels.traced_meta.TracedMeta`) and runs
the step's other LoRA terms: the vector epilogue (:meth:`vectors`) and the vocabulary modules' (:meth:`embed`,
:meth:`head`).

- :class:`LinearExecutor` (torch forms, reference, triton): the base matmul, then the step's form — one
  ``apply_parts`` per group on FUSED steps (the triton backend's BGMV / SGMV), else shrink / expand per part (fused
  shrink for adjacent parts), the LoRA written first and the base matmul added by one ``addmm_`` on a plain weight.
- ``kernels.cpu.backend.CpuExecutor``: first the cpu backend's one-call form (base matmul and LoRA in one C++ call
  for the weight's layout), else as above.
- :class:`TracedExecutor` (laned XLA, Pallas): the base matmul plus one laned shrink / expand per part, new tensors
  (static shapes, no in-place update); a linear sharded over devices runs :func:`kernels.sharded.sharded_linear`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from adapter_manager.kernels.eager_meta import EagerMeta
from adapter_manager.kernels.linear_lora import LinearLoRA, Stacks
from adapter_manager.kernels.meta import LoRAKernelMeta
from adapter_manager.kernels.ops import apply_parts, expand, shrink, shrink_parts
from adapter_manager.kernels.protocol import LinearWeight
from adapter_manager.kernels.sharded import process_fully_sharded, sharded_linear
from adapter_manager.kernels.traced_meta import TracedMeta
from adapter_manager.kernels.vectors import eager_vectors, gathered_vectors
from adapter_manager.kernels.vocab import eager_embed, eager_head, traced_embed, traced_head

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

    in_place = True
    """Ops write their output tensors in place (traced: each returns a new tensor)."""
    meta_type = EagerMeta
    """Its step state: the metadata class :meth:`LoRAKernelMeta.make` builds for a backend with this executor."""

    def __init__(self, backend: object | None = None) -> None:
        self.backend = backend

    def vectors(self, y: torch.Tensor, lora: LinearLoRA, meta: LoRAKernelMeta) -> torch.Tensor:
        """The step's vector epilogue on a linear's output (:func:`kernels.vectors.apply_vectors`): in place."""
        return eager_vectors(y, lora, meta)

    def embed(
        self, h: torch.Tensor, tokens: torch.Tensor, stacks: Stacks, meta: LoRAKernelMeta, per_token: bool
    ) -> torch.Tensor:
        """The embedding's LoRA (:func:`kernels.vocab.embed_lora`): in place."""
        return eager_embed(h, tokens, stacks, meta, per_token)

    def head(
        self,
        logits: torch.Tensor,
        x: torch.Tensor,
        stacks: Stacks,
        meta: LoRAKernelMeta,
        logits_index: torch.Tensor | None,
        per_token: bool,
    ) -> torch.Tensor:
        """The head's LoRA (:func:`kernels.vocab.head_lora`): in place."""
        return eager_head(logits, x, stacks, meta, logits_index, per_token)

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
        return y if meta.bias_index is None and meta.scale_index is None else self.vectors(y, lora, meta)

    def _with_lora(
        self, x: torch.Tensor, weight: LinearWeight, lora: LinearLoRA, meta: LoRAKernelMeta, step: LinearStep
    ) -> torch.Tensor:
        if lora.shards.local > 1:
            raise ValueError(
                f"a linear holding {lora.shards.local} shards side by side runs on a traced backend (one SPMD "
                f"program); {type(self).__name__} runs one device's shard"
            )
        if lora.shards.fully_sharded:  # one process per shard: this process's section, its shrinks summed over them
            return process_fully_sharded(x, weight, lora, meta, step.kernels.linear)
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


class TracedExecutor(LinearExecutor):
    """The traced backends' (laned XLA, Pallas): the base matmul plus one laned shrink / expand per part, each a new
    tensor; the graph depends only on (token bucket, active bucket)."""

    in_place = False
    meta_type = TracedMeta

    def vectors(self, y: torch.Tensor, lora: LinearLoRA, meta: LoRAKernelMeta) -> torch.Tensor:
        """A gather per part, a new tensor."""
        return gathered_vectors(y, lora, meta)

    def embed(
        self, h: torch.Tensor, tokens: torch.Tensor, stacks: Stacks, meta: LoRAKernelMeta, per_token: bool
    ) -> torch.Tensor:
        """Laned over the compact active table, a new tensor (one path whatever the mode)."""
        return traced_embed(h, tokens, stacks, meta)

    def head(
        self,
        logits: torch.Tensor,
        x: torch.Tensor,
        stacks: Stacks,
        meta: LoRAKernelMeta,
        logits_index: torch.Tensor | None,
        per_token: bool,
    ) -> torch.Tensor:
        """Laned over the compact active table, a new tensor."""
        return traced_head(logits, x, stacks, meta, logits_index)

    def _with_lora(
        self, x: torch.Tensor, weight: LinearWeight, lora: LinearLoRA, meta: LoRAKernelMeta, step: LinearStep
    ) -> torch.Tensor:
        if lora.shards.local > 1:
            return sharded_linear(x, weight, lora, meta, step.kernels.linear, self.backend)
        y = step.kernels.linear(x, weight)
        if len(lora.out_features) == 1:
            stacks = lora.parts[0]
            return y if stacks is None else expand(y, shrink(x, stacks.a, meta), stacks.bt, meta)
        parts = list(y.split(lora.out_features, dim=-1))
        for index, stacks in enumerate(lora.parts):
            if stacks is not None:
                parts[index] = expand(parts[index], shrink(x, stacks.a, meta), stacks.bt, meta)
        return torch.cat(parts, dim=-1)
