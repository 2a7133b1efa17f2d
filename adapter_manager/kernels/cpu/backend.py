"""The cpu backend: the torch forms, plus one C++ kernel call per fused linear for steps of few tokens.

At decode the LoRA work of a step is a few tokens against each active adapter's rows: bandwidth-bound, but as MKL
matmuls per run of tokens it is one small call per (run, part, layer), each far from the memory bound (measured:
2.5–2.8× the byte floor with 8 adapters). The FUSED form applies a fused linear's whole LoRA (every part: q/k/v or
gate/up; every run of equal slots) in one call of ``torch.ops.adapter_manager.lora_apply``
(:mod:`kernels.cpu.linear_ops`), which reads each active adapter's pool rows once, in place: the call count per step
does not grow with the number of distinct adapters, and its bytes are the active adapters' bytes. Steps of more tokens
(prefill) take the torch forms, whose matmuls per run are compute-efficient there, except in a layer held in our
blocked fp32 layout: every step with an adapter carries the runs table on this backend
(:attr:`kernels.meta.LoRAKernelMeta.runs`), and such a layer takes any step in one ``lora_blocked`` call, a
prefill's long runs with their LoRA inside its GEMM (csrc/lora_blocked.cpp).

Which one-call kernel a linear takes is this backend's choice (:meth:`CpuFusedBackend.fused_linear`, reached
through its executor, :class:`CpuExecutor`): the model only says how its weight is held (:class:`LinearWeight`).

``shrink`` / ``expand`` on a FUSED step run the torch segments path over the same runs (the metadata sets both), so
every op keeps its semantics whichever form the step took.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from adapter_manager.kernels.config import LoRAForm
from adapter_manager.kernels.cpu.library import load, unavailable_reason
from adapter_manager.kernels.cpu.linear_ops import (
    LINEAR_MAX_TOKENS,
    Epilogue,
    fixed_linear,
    lora_apply,
    lora_blocked,
    lora_linear,
    lora_onednn,
    vector_epilogue,
)
from adapter_manager.kernels.dispatch_table import TorchDispatchTable
from adapter_manager.kernels.executor import LinearExecutor, LinearStep
from adapter_manager.kernels.linear_lora import LinearLoRA
from adapter_manager.kernels.meta import LoRAKernelMeta
from adapter_manager.kernels.ops import compose_parts
from adapter_manager.kernels.protocol import LinearWeight, LoRAGroups, WeightLayout
from adapter_manager.kernels.torch_eager import TorchEagerBackend


class CpuExecutor(LinearExecutor):
    """The cpu backend's: the base matmul, the step's LoRA and a LoRA variant's vector epilogue in one C++ call where
    its backend has a form for the weight's layout and the step (``fused_linear``), else the eager composition and
    the epilogue in one C++ call per group of adjacent parts."""

    backend: CpuFusedBackend

    def linear(self, x: torch.Tensor, weight: LinearWeight, lora: LinearLoRA | None, step: LinearStep) -> torch.Tensor:
        meta = step.meta
        if lora is None or meta is None or meta.no_adapter:
            return step.kernels.linear(x, weight, step.fast)
        backend = self.backend
        vectors = meta.bias_index is not None or meta.scale_index is not None
        epilogue = backend.epilogue(lora, meta) if vectors else None
        offered = weight.layout is not WeightLayout.PLAIN or step.fast  # a plain weight only with the decode glue on
        offered = offered and not lora.shards.fully_sharded  # a process's section: its shrinks summed between calls
        if lora.one_call and lora.unit_groups and offered and (epilogue is not None or not vectors):
            y = backend.fused_linear(x, weight, lora.kernel_groups, meta, epilogue)
            if y is not None:
                return y
        y = self._with_lora(x, weight, lora, meta, step)
        if not vectors:
            return y
        if epilogue is not None and y.stride(1) == 1:  # a CPU tensor: the backend runs on CPU tensors only
            backend.vectors(y, epilogue)
            return y
        return self.vectors(y, lora, meta)


class CpuFusedBackend(TorchEagerBackend):
    """:class:`TorchEagerBackend` whose steps of ≤ ``fused_max_tokens`` tokens take the FUSED form."""

    executor_type = CpuExecutor
    runs_every_step = True
    """Every step with an adapter carries the C++ kernels' runs table (:attr:`kernels.meta.LoRAKernelMeta.runs`)."""

    def __init__(
        self,
        table: TorchDispatchTable,
        max_segment_runs: int = 16,
        form: LoRAForm = LoRAForm.AUTO,
        fused_max_tokens: int = 128,
        deterministic: bool = False,
    ) -> None:
        """``form``: AUTO, or a forced FUSED / SEGMENTS / GROUPED / LANED for every step with an adapter.
        ``fused_max_tokens``: AUTO takes FUSED for steps of at most this many tokens (0: never); the default 128 is
        where MKL's matmul per run caught up with one adapter on the bench model (8 adapters: still 2x apart).
        ``deterministic``: every step with an adapter takes the FUSED form through ``fixed_linear`` on plain weights
        (each token's result summed in an order fixed by the shapes: the engine's deterministic mode); a forced
        ``form`` other than FUSED is refused."""
        if fused_max_tokens < 0:
            raise ValueError(f"fused_max_tokens must be >= 0, got {fused_max_tokens}")
        if not load():
            raise ValueError(f"the CPU LoRA kernel cannot be built here: {unavailable_reason()}")
        if deterministic and form not in (LoRAForm.AUTO, LoRAForm.FUSED):
            raise ValueError(f"the deterministic mode applies the LoRA in the fused form only, got form={form.value!r}")
        super().__init__(table, max_segment_runs, LoRAForm.AUTO if form is LoRAForm.FUSED else form)
        self.form = LoRAForm.FUSED if deterministic else form
        self.fused_max_tokens = fused_max_tokens
        self.deterministic = deterministic

    def choose_form(self, num_tokens: int, active_slots: int, rank: int, runs: int) -> LoRAForm:
        if self.form is LoRAForm.FUSED or (self.form is LoRAForm.AUTO and num_tokens <= self.fused_max_tokens):
            return LoRAForm.FUSED
        return super().choose_form(num_tokens, active_slots, rank, runs)

    def apply_parts(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        a_parts: torch.Tensor,
        bt_parts: Sequence[torch.Tensor],
        meta: LoRAKernelMeta,
    ) -> torch.Tensor:
        """Semantics: :func:`kernels.ops.apply_parts`. FUSED steps: one kernel call; other forms: shrink_parts, then
        one expand per part. Shape: y [T, sum(out)] (updated in place, returned); x [T, in]; a_parts [N, P, in];
        bt_parts P × [N, out_p]."""
        unit = a_parts.stride(2) == 1 and y.stride(1) == 1 and all(bt.stride(1) == 1 for bt in bt_parts)
        if self.deterministic and not unit:  # lora_apply's loops are per token, the other forms are not
            raise ValueError("the deterministic mode applies the LoRA on rows of unit inner stride (the pool's layout)")
        if meta.form is LoRAForm.FUSED and unit:
            assert meta.runs is not None
            lora_apply(y, x if x.stride(1) == 1 else x.contiguous(), a_parts, bt_parts, meta.runs)
            return y
        return compose_parts(y, x, a_parts, bt_parts, meta)

    def fused_linear(
        self,
        x: torch.Tensor,
        weight: LinearWeight,
        groups: LoRAGroups,
        meta: LoRAKernelMeta,
        epilogue: Epilogue | None = None,
    ) -> torch.Tensor | None:
        """Semantics: :func:`kernels.ops.fused_linear`, then ``epilogue`` (a LoRA variant's vectors,
        :func:`kernels.vectors.apply_vectors`) where given. One C++ call for the base matmul and the step's LoRA:
        ``lora_blocked`` for our blocked layout on any step with an adapter (a prefill's runs of 16+ tokens take
        their LoRA inside its GEMM), and on FUSED steps ``lora_onednn`` for oneDNN's layout and ``lora_linear`` for a
        plain fp32 weight of at most ``LINEAR_MAX_TOKENS`` tokens. None otherwise (x without unit inner stride, a
        step without the runs table, a plain weight at prefill). Shape: x [T, in]; returns a new [T, out] or None."""
        runs = meta.runs
        if runs is None or x.stride(1) != 1:  # runs: set on every step with an adapter on this backend
            return None
        a_groups, bts, offsets = groups
        w = weight.tensor
        if self.deterministic:
            if weight.layout is not WeightLayout.PLAIN:
                raise ValueError(f"the deterministic mode reads plain weights, not {weight.layout.value} ones")
            return fixed_linear(x, w, a_groups, bts, offsets, runs, epilogue)
        if weight.layout is WeightLayout.INT8:  # its matmul, then the LoRA (kernels.base_linear, apply_parts)
            return None
        if weight.layout is WeightLayout.BLOCKED:  # any step with an adapter: prefill too
            return lora_blocked(x, w, weight.out_features, a_groups, bts, offsets, runs, epilogue)
        if meta.form is not LoRAForm.FUSED:
            return None
        if weight.layout is WeightLayout.ONEDNN:
            return lora_onednn(x, w, a_groups, bts, offsets, runs, epilogue)
        fits = x.shape[0] <= LINEAR_MAX_TOKENS and x.dtype == w.dtype == torch.float32 and w.is_contiguous()
        return lora_linear(x, w, a_groups, bts, offsets, runs, epilogue) if fits else None

    def epilogue(self, lora: LinearLoRA, meta: LoRAKernelMeta) -> Epilogue | None:
        """The step's vector epilogue for a linear (its `LinearLoRA.vector_args` and the step's indices) as the C++
        ops take it, or None where they cannot (a group without unit inner stride)."""
        args = lora.vector_args
        return None if args is None else Epilogue(args[0], args[1], meta.bias_index, meta.scale_index)

    def vectors(self, y: torch.Tensor, epilogue: Epilogue) -> None:
        """``epilogue`` on y alone, one C++ call per group (``vector_epilogue``: fp32, rounded once, per token).
        Shape: y [T, sum(out)], unit inner stride."""
        for vectors, start in zip(epilogue.vectors, epilogue.starts, strict=True):
            vector_epilogue(y, start, vectors, epilogue.bias, epilogue.scale)
