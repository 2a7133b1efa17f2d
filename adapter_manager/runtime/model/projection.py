"""A (possibly fused) linear layer with per-token LoRA through the slot stacks: ``y = x @ W.T + expand(shrink(x))``."""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple, Protocol

import torch
from torch import nn

from adapter_manager.kernels import (
    LinearWeight,
    LoRAGroups,
    LoRAKernelMeta,
    WeightLayout,
    apply_parts,
    base_linear,
    choose_weight_layout,
    expand,
    fused_linear,
    pack_weight,
    plain_matmul,
    quantize_weight,
    shrink,
    shrink_parts,
    unpack_weight,
)


class Stacks(Protocol):
    """One module's LoRA rows (``adapter_manager.tiers.slot_pool.SlotStacks``)."""

    @property
    def a(self) -> torch.Tensor: ...  # Shape: [N, in]

    @property
    def bt(self) -> torch.Tensor: ...  # Shape: [N, out]


class _FusedParts(NamedTuple):
    """Consecutive parts whose A rows are adjacent column blocks of one pool tensor: one fused shrink for all."""

    first: int
    """The first part's index."""
    a_parts: torch.Tensor
    """Shape: [N, P, in], a view of the pool (no copy): ``a_parts[:, i]`` is part ``first + i``'s A rows."""

    @property
    def parts(self) -> range:
        return range(self.first, self.first + self.a_parts.shape[1])


class _Group(NamedTuple):
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


def _fused_runs(a_rows: list[torch.Tensor | None]) -> tuple[_FusedParts, ...]:
    """The runs of ≥ 2 consecutive parts whose A rows (``[N, in]`` each, None = no LoRA) are adjacent column blocks
    of one tensor, each as one ``[N, P, in]`` view. Eager devices only: on XLA the pool hands out fresh views per
    step, and a view kept across steps would be materialised as a copy of its own."""
    runs, part = [], 0
    while part < len(a_rows):
        first = last = a_rows[part]
        end = part + 1
        if first is not None and first.device.type != "xla":
            while end < len(a_rows) and (nxt := a_rows[end]) is not None and _adjacent(last, nxt):
                last, end = nxt, end + 1
        if first is not None and end - part >= 2:
            count, (rows, features), (row_stride, col_stride) = end - part, first.shape, first.stride()
            view = first.as_strided((rows, count, features), (row_stride, features * col_stride, col_stride))
            runs.append(_FusedParts(part, view))
        part = end
    return tuple(runs)


class LoRALinear(nn.Module):
    """One base matmul for one or more projections that share an input (q/k/v, gate/up), each with its own LoRA.

    The base weight of the fused parts is one ``[sum(out), in]`` matrix (gpt-fast's ``wqkv``); the LoRA stacks stay
    per projection, as the slot pool owns them: each part's rows ``A [N, in]`` and ``Bt [N, out]``, strided views of
    the pool's row tensor. They are attached by reference: a slot load, which writes the pool in place, is seen by
    the next forward without re-attaching.

    Fused shrink: when consecutive parts' A rows are adjacent column blocks of one tensor (the pool's row layout puts
    A_q|A_k|A_v, and A_gate|A_up, side by side), attach records one ``[N, P, in]`` view of them and an eager forward
    runs one :func:`kernels.shrink_parts` for those parts instead of one shrink each. ``fuse_shrink = False`` forces
    the per-part path (benchmarks compare the two); traced backends always take it.

    Fused apply: on a step whose metadata is ``fused`` (the cpu backend's FUSED form) the base matmul writes the
    output and each group of parts (a fused run, or one part alone) gets its whole LoRA from one
    :func:`kernels.apply_parts` call, whatever the number of distinct adapters in the step.

    Packed weight: :meth:`pack` replaces the plain ``weight`` by the copy its device's kernels read fastest
    (:func:`kernels.pack_weight`; CPU only, one copy in memory: ``weight`` becomes None): on CPU fp32 in our blocked
    layout, bf16 in oneDNN's. :meth:`unpack` undoes it. Every base matmul is :func:`kernels.base_linear` of the
    weight in its layout: the kernels pick the implementation.
    ``state_dict`` still holds the plain weight (made on demand); loading into a packed layer is refused; pickling and
    ``deepcopy`` carry the weight plain and pack it again.

    Quantized weight: :meth:`quantize` replaces the plain weight by its int8 form (:func:`kernels.quantize_weight`,
    one scale per output row; any device), held like a packed one (``layout`` INT8); the LoRA stays in the serving
    dtype and adds onto the int8 matmul's output. ``state_dict`` and :meth:`unpack` give the dequantized weight;
    pickling carries the int8 form as it is.
    """

    def __init__(
        self,
        in_features: int,
        out_features: tuple[int, ...],
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if in_features <= 0 or not out_features or min(out_features) <= 0:
            raise ValueError(f"in_features ({in_features}) and every out_features {out_features} must be positive")
        self.in_features = in_features
        self.out_features = tuple(out_features)
        self.weight = nn.Parameter(torch.empty(sum(out_features), in_features, device=device, dtype=dtype))
        self._lora: list[Stacks | None] = [None] * len(out_features)
        self._fused: tuple[_FusedParts, ...] = ()
        self._groups: tuple[_Group, ...] = ()
        self._kernel_groups = LoRAGroups((), (), ())
        self._unit_groups = False  # every group's rows have unit inner stride (what the C++ kernels read)
        self._has_lora = False
        self._packed: LinearWeight | None = None  # the packed weight (kernels.pack_weight) once packed
        self.fuse_shrink = True
        self.one_call = True
        """Offer the step's backend the base matmul and the LoRA as one call (:func:`kernels.fused_linear`, where
        the backend has a form for the weight's layout and the step); False forces the base matmul, then the
        step's form (one ``apply_parts`` per group, or the torch forms at prefill: the same values within fp32
        rounding; benchmarks compare the two)."""

    @property
    def out_total(self) -> int:
        """The output's width: every part's out features."""
        return sum(self.out_features)

    @property
    def packed(self) -> bool:
        """Whether the base weight is held packed (our blocked layout, oneDNN's) or int8 (``weight`` is then None)."""
        return self._packed is not None

    @property
    def layout(self) -> WeightLayout:
        """How the base weight is held: plain, or packed in our blocked layout or oneDNN's."""
        return WeightLayout.PLAIN if self._packed is None else self._packed.layout

    @property
    def weight_dtype(self) -> torch.dtype:
        """The serving dtype of the layer's matmul (an int8 weight's: its scales')."""
        if self._packed is None:
            return self.weight.dtype
        return self._packed.scales.dtype if self._packed.scales is not None else self._packed.tensor.dtype

    def pack(self, layout: WeightLayout | None = None) -> bool:
        """Replace the plain weight by its packed copy in ``layout`` (:func:`kernels.pack_weight`; None: the lone
        weight's default, on CPU fp32 blocked, bf16 oneDNN's) where it applies; returns whether the layer is packed.
        Pack last: ``to()`` does not move or cast a packed weight."""
        if self._packed is None and self.weight is not None:
            self._packed = pack_weight(self.weight, layout)
            if self._packed is not None:
                self.weight = None  # the plain copy goes: one copy of the weight in memory
        return self._packed is not None

    def quantize(self) -> bool:
        """Replace the plain weight by its int8 form (:func:`kernels.quantize_weight`); returns whether the layer is
        int8 now (False where the weight is already packed: quantize before packing)."""
        if self._packed is None and self.weight is not None:
            self._packed = quantize_weight(self.weight)
            self.weight = None
        return self.layout is WeightLayout.INT8

    def unpack(self) -> None:
        """Back to a plain ``weight`` Parameter (same values; an int8 weight dequantized)."""
        if self._packed is not None:
            self.weight = nn.Parameter(unpack_weight(self._packed), requires_grad=False)
            self._packed = None

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:  # noqa: ANN001 - nn.Module's signature
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._packed is not None:
            destination[prefix + "weight"] = unpack_weight(self._packed)

    def __getstate__(self) -> dict:
        """Pickle / deepcopy (a oneDNN tensor has no storage to copy): a packed weight travels plain, repacked on
        arrival."""
        state = dict(super().__getstate__())
        if self._packed is not None and self._packed.layout is not WeightLayout.INT8:  # int8: plain tensors
            state["_packed"], state["_packed_plain"] = None, unpack_weight(self._packed)
            state["_packed_layout"] = self._packed.layout
        return state

    def __setstate__(self, state: dict) -> None:
        plain, layout = state.pop("_packed_plain", None), state.pop("_packed_layout", None)
        super().__setstate__(state)
        if plain is not None:
            self._packed = pack_weight(plain, layout)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        if self._packed is not None:
            raise RuntimeError(f"{prefix or 'layer'}: the weight is packed; unpack() before loading a state dict")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def base(self, x: torch.Tensor, kernel: bool = False) -> torch.Tensor:
        """Semantics: ``x @ W.T``, whichever layout W is held in (:func:`kernels.base_linear`). ``kernel``: the model's
        fused decode ops are on, so the kernels may take their decode linear for a plain weight. Shape: x [T, in];
        returns a new [T, sum(out)]."""
        return base_linear(x, self._weight(), kernel)

    def _weight(self) -> LinearWeight:
        """The base weight in its layout."""
        if self._packed is not None:
            return self._packed
        return LinearWeight(WeightLayout.PLAIN, self.weight, self.out_total)

    def _one_call_weight(self, kernel: bool) -> LinearWeight | None:
        """The weight as the backend's one-call form reads it: packed always, plain only with the model's fused
        decode ops on (``kernel``)."""
        if self._packed is not None:
            return self._packed  # the backend takes the layouts it has a form for (never INT8 today)
        return self._weight() if kernel and self.weight is not None else None

    def attach(self, part: int, stacks: Stacks) -> None:
        """Route part ``part``'s LoRA through the pool's rows ``stacks.a`` [N, in] and ``stacks.bt`` [N, out], read at
        every forward (the pool may hand out fresh views of the same rows)."""
        out = self.out_features[part]
        a_rows, bt_rows = stacks.a, stacks.bt
        if a_rows.dim() != 2 or a_rows.shape[1] != self.in_features:
            raise ValueError(f"a_rows must have shape [N, {self.in_features}], got {tuple(a_rows.shape)}")
        if bt_rows.shape != (a_rows.shape[0], out):
            raise ValueError(f"bt_rows must have shape [{a_rows.shape[0]}, {out}], got {tuple(bt_rows.shape)}")
        if a_rows.dtype != self.weight_dtype or bt_rows.dtype != self.weight_dtype:
            raise ValueError(f"rows are {a_rows.dtype}/{bt_rows.dtype}, the layer is {self.weight_dtype}")
        self._lora[part] = stacks
        self._has_lora = True
        self._fused = _fused_runs([None if s is None else s.a for s in self._lora])
        self._groups = self._apply_groups()
        groups = self._groups
        self._kernel_groups = LoRAGroups(
            tuple(g.a_parts for g in groups),
            tuple(bt for g in groups for bt in g.bt_parts),
            tuple(g.columns.start for g in groups),
        )
        self._unit_groups = all(g.a_parts.stride(2) == 1 and all(b.stride(1) == 1 for b in g.bt_parts) for g in groups)

    def _apply_groups(self) -> tuple[_Group, ...]:
        """The fused runs, and every other part with stacks on its own as a one-part view (eager devices)."""
        runs = {run.first: run for run in self._fused}
        groups, part, starts = [], 0, [sum(self.out_features[:p]) for p in range(len(self.out_features) + 1)]
        while part < len(self._lora):
            stacks = self._lora[part]
            if part in runs:
                run = runs[part]
                bts = tuple(self._lora[p].bt for p in run.parts)  # type: ignore[union-attr]
                columns = slice(starts[part], starts[run.parts.stop])
                groups.append(_Group(columns, run.a_parts, bts, columns == slice(0, starts[-1])))
                part = run.parts.stop
                continue
            if stacks is not None and stacks.a.device.type != "xla":
                columns = slice(starts[part], starts[part + 1])
                groups.append(_Group(columns, stacks.a.unsqueeze(1), (stacks.bt,), columns == slice(0, starts[-1])))
            part += 1
        return tuple(groups)

    def detach(self) -> None:
        """Drop every part's stacks: the layer is its base matmul again."""
        self._lora = [None] * len(self.out_features)
        self._has_lora = False
        self._fused = ()
        self._groups = ()
        self._kernel_groups = LoRAGroups((), (), ())
        self._unit_groups = False

    @property
    def fused_parts(self) -> tuple[tuple[int, ...], ...]:
        """The groups of parts an eager forward shrinks with one fused call, e.g. ``((0, 1, 2),)`` for q/k/v."""
        return tuple(tuple(run.parts) for run in self._fused)

    @property
    def has_lora(self) -> bool:
        return self._has_lora

    def forward(self, x: torch.Tensor, meta: LoRAKernelMeta | None = None) -> list[torch.Tensor]:
        """The base projection(s) plus each token's adapter.

        Semantics::

            y = x @ W.T                                        # all parts in one matmul
            for each part p with rows (A_p, Bt_p), unless meta is None or meta.no_adapter (eager fast path):
                y_p = expand(y_p, shrink(x, A_p, meta), Bt_p, meta)  # y_p[t] += x[t] @ A_p[rows of slot[t]].T @ ...
            return [y_p for each part]

        On eager backends with a plain weight the LoRA terms are written first (``expand(accumulate=False)``) and the
        base matmul is added on top by one ``addmm_``, so the output is never read back by a separate pass; with a
        packed weight the packed matmul writes the base output and each expand accumulates onto its part in place. The
        parts of a fused run share one ``shrink_parts`` call (its ``h[p]`` is part p's shrink); traced backends add
        the LoRA term to the base matmul's result, one shrink per part.

        Shape: x [T, in]; returns one [T, out_p] per part (views of one [T, sum(out)] on eager backends; new tensors
        on traced backends).
        """
        if meta is not None and not meta.no_adapter and self._has_lora and meta.backend.traced:
            y = self.base(x)
            parts = list(y.split(self.out_features, dim=-1)) if len(self.out_features) > 1 else [y]
            for index, stacks in enumerate(self._lora):
                if stacks is not None:
                    parts[index] = expand(parts[index], shrink(x, stacks.a, meta), stacks.bt, meta)
            return parts
        y = self.output(x, meta)
        return list(y.split(self.out_features, dim=-1)) if len(self.out_features) > 1 else [y]

    def output(self, x: torch.Tensor, meta: LoRAKernelMeta | None = None, kernel: bool = False) -> torch.Tensor:
        """:meth:`forward`'s parts as the one ``[T, sum(out)]`` tensor they are views of on eager backends (traced
        backends: their concatenation). Shape: x [T, in]; returns a new [T, sum(out)].

        ``kernel`` (the model's fused decode ops are on): a plain weight is offered to the backend's one-call form
        too, and its base matmul may take the kernels' decode linear. With an adapter in the step the layer first
        offers the step's backend its weight (:class:`LinearWeight`: our blocked layout, oneDNN's, or plain) and its
        LoRA groups: :func:`kernels.fused_linear` runs the base matmul and every group's LoRA in one call where the
        backend has a form for them; otherwise the base matmul, then one :func:`kernels.apply_parts` per group
        (FUSED steps) or shrink / expand per part."""
        if meta is None or meta.no_adapter or not self._has_lora:
            return self.base(x, kernel)  # [T, sum(out)]
        if meta.backend.traced:
            return torch.cat(self.forward(x, meta), dim=-1)
        if self.one_call and self._unit_groups:
            weight = self._one_call_weight(kernel)
            y = None if weight is None else fused_linear(x, weight, self._kernel_groups, meta)
            if y is not None:
                return y
        if meta.fused:  # the backend applies each group's LoRA in one call, onto the base output
            y = self.base(x)
            for group in self._groups:
                apply_parts(y if group.whole else y[:, group.columns], x, group.a_parts, group.bt_parts, meta)
            return y
        packed = not plain_matmul(x, self._weight())  # a packed / oneDNN matmul writes y, the LoRA adds onto it
        y = self.base(x) if packed else x.new_empty(x.shape[0], sum(self.out_features))  # [T, sum(out)]
        parts = list(y.split(self.out_features, dim=-1)) if len(self.out_features) > 1 else [y]
        h: dict[int, torch.Tensor] = {}  # part -> its shrink output [T, R]
        for run in self._fused if self.fuse_shrink else ():
            h.update(zip(run.parts, shrink_parts(x, run.a_parts, meta), strict=True))  # [P, T, R]
        for index, stacks in enumerate(self._lora):
            if stacks is None:
                if not packed:
                    parts[index].zero_()
            else:
                part_h = h[index] if index in h else shrink(x, stacks.a, meta)
                expand(parts[index], part_h, stacks.bt, meta, accumulate=packed)  # packed: onto the base output
        if not packed:
            y.addmm_(x, self.weight.t())  # y = LoRA terms + x @ W.T, one pass
        return y

    def extra_repr(self) -> str:
        extra = f"in_features={self.in_features}, out_features={self.out_features}, lora={self.has_lora}"
        return extra + (f", {self._packed.layout.value}" if self._packed is not None else "")


def pack_linears(linears: list[LoRALinear], layout: WeightLayout | None = None):
    """Pack each of ``linears`` still holding a plain weight (:meth:`LoRALinear.pack`) in ``layout``; None: the one
    :func:`kernels.choose_weight_layout` measures fastest here for their shapes. Returns (whether any is packed,
    the choice made: None when ``layout`` was given or nothing was plain)."""
    plain = [m for m in linears if m.weight is not None]
    choice = None
    if layout is None and plain:
        shapes = Counter((m.out_total, m.in_features) for m in plain)
        first = plain[0].weight
        choice = choose_weight_layout(first.dtype, [(o, i, n) for (o, i), n in shapes.items()], first.device)
        layout = choice.layout
    packed = False
    for module in linears:
        packed |= module.pack(layout)
    return packed, choice


def quantize_linears(linears: list[LoRALinear]) -> int:
    """Quantize each of ``linears`` still holding a plain weight to int8 (:meth:`LoRALinear.quantize`); returns how
    many are int8."""
    return sum(module.quantize() for module in linears)
