"""A (possibly fused) linear layer with per-token LoRA through the slot stacks: ``y = x @ W.T + expand(shrink(x))``."""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from adapter_manager.kernels import (
    LinearLoRA,
    LinearShards,
    LinearStep,
    LinearWeight,
    Stacks,
    WeightLayout,
    choose_weight_layout,
    pack_weight,
    platform_for,
    quantize_weight,
    unpack_weight,
)

from .shard_plan import ShardPlan


class LoRALinear(nn.Module):
    """One base matmul for one or more projections that share an input (q/k/v, gate/up), each with its own LoRA.

    The base weight of the fused parts is one ``[sum(out), in]`` matrix (gpt-fast's ``wqkv``); the LoRA stacks stay
    per projection, as the slot pool owns them: each part's rows ``A [N, in]`` and ``Bt [N, out]``, strided views of
    the pool's row tensor. They are attached by reference: a slot load, which writes the pool in place, is seen by
    the next forward without re-attaching.

    How a step runs the layer is its executor's business (:mod:`kernels.executor`: the step's backend's): the layer
    hands it the weight in its layout and its LoRA (:class:`kernels.LinearLoRA`: each part's rows, the runs of
    adjacent A rows one fused shrink serves, the groups one ``apply_parts`` or one-call form takes), and never
    branches on the device or the form. ``fuse_shrink = False`` forces one shrink per part and ``one_call = False``
    the base matmul before the step's own LoRA form (benchmarks compare them).

    Packed weight: :meth:`pack` replaces the plain ``weight`` by the copy its device's kernels read fastest
    (:func:`kernels.pack_weight`; CPU only, one copy in memory: ``weight`` becomes None): on CPU fp32 in our blocked
    layout, bf16 in oneDNN's. :meth:`unpack` undoes it. Every base matmul is :func:`kernels.base_linear` of the
    weight in its layout: the kernels pick the implementation.
    ``state_dict`` still holds the plain weight (made on demand); loading into a packed layer is refused; pickling and
    ``deepcopy`` carry the weight plain and pack it again.

    Bias (``bias=True``: Qwen2's q/k/v, Llama's attention_bias and mlp_bias): one ``[sum(out)]`` vector added to the
    output after the LoRA, as ``nn.Linear`` + PEFT compute it; a row-parallel layer's is added by the first shard
    only (the shards' outputs are summed after it).

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
        plan: ShardPlan | None = None,
        row_parallel: bool = False,
        bias: bool = False,
    ) -> None:
        """``plan``: the model's shards (:class:`.shard_plan.ShardPlan`; None: unsharded), whose split of this layer
        (:meth:`.shard_plan.ShardPlan.linear`) it keeps as :attr:`shards`: the layer holds its ``shards.local`` side by
        side, split by output features (column-parallel) or, ``row_parallel``, by input features; one process per
        shard holds its own alone."""
        super().__init__()
        self.shards: LinearShards = (plan or ShardPlan()).linear(row_parallel)
        """How the layer and its LoRA are split over the tensor-parallel shards (the plan's, made once)."""
        shards, process = self.shards.local, self.shards.process
        if in_features <= 0 or not out_features or min(out_features) <= 0:
            raise ValueError(f"in_features ({in_features}) and every out_features {out_features} must be positive")
        sharded = [in_features] if row_parallel else list(out_features)
        if any(width % shards for width in sharded):
            raise ValueError(f"{sharded} cannot be sharded {shards} ways ({'row' if row_parallel else 'column'})")
        self.in_features = in_features
        self.out_features = tuple(out_features)
        self.weight = nn.Parameter(torch.empty(sum(out_features), in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(sum(out_features), device=device, dtype=dtype)) if bias else None
        self._adds_bias = bias and not (row_parallel and process is not None and process.rank != 0)
        self._parts: list[Stacks | None] = [None] * len(out_features)
        self._lora: LinearLoRA | None = None  # built from _parts at each attach
        self._packed: LinearWeight | None = None  # the packed weight (kernels.pack_weight) once packed
        self._fuse_shrink = True
        self._one_call = True

    @property
    def row_parallel(self) -> bool:
        """The layer's input is split over the shards (o, down); False: its output (column-parallel)."""
        return self.shards.row_parallel

    @property
    def fuse_shrink(self) -> bool:
        """Shrink adjacent parts (q/k/v, gate/up) in one call on eager steps (False: one shrink per part)."""
        return self._fuse_shrink

    @fuse_shrink.setter
    def fuse_shrink(self, value: bool) -> None:
        if value != self._fuse_shrink:
            self._fuse_shrink = value
            self._rebuild()

    @property
    def one_call(self) -> bool:
        """Offer the step's backend the base matmul and the LoRA as one call where it has a form for the weight's
        layout and the step; False forces the base matmul, then the step's form (the same values within fp32
        rounding; benchmarks compare the two)."""
        return self._one_call

    @one_call.setter
    def one_call(self, value: bool) -> None:
        if value != self._one_call:
            self._one_call = value
            self._rebuild()

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

    def plain_weight(self) -> torch.Tensor:
        """The base weight as served, plain: the parameter's data, or a packed / int8 one unpacked (a new tensor).
        Shape: [sum(out), in]."""
        return self.weight.detach() if self._packed is None else unpack_weight(self._packed)

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

    def _weight(self) -> LinearWeight:
        """The base weight in its layout."""
        if self._packed is not None:
            return self._packed
        return LinearWeight(WeightLayout.PLAIN, self.weight, self.out_total)

    def attach(self, part: int, stacks: Stacks) -> None:
        """Route part ``part``'s LoRA through the pool's rows ``stacks.a`` [N, in] and ``stacks.bt`` [N, out], read at
        every forward (the pool may hand out fresh views of the same rows). Split as :attr:`shards` says (the plan's
        :class:`sharding.TensorParallel`): over S shards of one program ``[N, S, in_s]``, ``[N, S, out_s]``, the base's
        split or the fully sharded one; one process per shard, fully sharded, its section ``[N, in / G]`` or
        ``[N, out / G]``."""
        a_rows, bt_rows = stacks.a, stacks.bt
        a_shape, bt_shape = self._rows_shapes(part)
        if tuple(a_rows.shape[1:]) != a_shape:
            raise ValueError(f"a_rows must have shape [N, {', '.join(map(str, a_shape))}], got {tuple(a_rows.shape)}")
        if tuple(bt_rows.shape) != (a_rows.shape[0], *bt_shape):
            raise ValueError(
                f"bt_rows must have shape [{a_rows.shape[0]}, {', '.join(map(str, bt_shape))}], got "
                f"{tuple(bt_rows.shape)}"
            )
        if a_rows.dtype != self.weight_dtype or bt_rows.dtype != self.weight_dtype:
            raise ValueError(f"rows are {a_rows.dtype}/{bt_rows.dtype}, the layer is {self.weight_dtype}")
        self._parts[part] = stacks
        self._rebuild()

    def _rows_shapes(self, part: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A part's rows' shapes past N: ``(in,), (out,)`` unsharded; ``(S, in_s), (S, out_s)`` over S shards, where
        fully sharded splits a column-parallel A by input and a row-parallel Bt by output too; one process per shard,
        fully sharded, that A or Bt is this process's section of G."""
        out, split = self.out_features[part], self.shards
        shards, full = split.local, split.fully_sharded
        if shards == 1:
            if full:  # one process per shard: this process's section, A or Bt split over the processes
                size = split.size
                if self.row_parallel:
                    return (self.in_features,), (out // size,)
                return (self.in_features // size,), (out,)
            return (self.in_features,), (out,)
        if self.row_parallel:
            return (shards, self.in_features // shards), (shards, out // shards if full else out)
        return (shards, self.in_features // shards if full else self.in_features), (shards, out // shards)

    def _rebuild(self) -> None:
        if any(stacks is not None for stacks in self._parts):
            parts = tuple(self._parts)
            keeps_views = platform_for(next(p.a.device for p in parts if p is not None)).keeps_views
            flags = (self._fuse_shrink, self._one_call)
            self._lora = LinearLoRA.build(self.out_features, parts, *flags, self.shards, keeps_views)

    def detach(self) -> None:
        """Drop every part's stacks: the layer is its base matmul again."""
        self._parts = [None] * len(self.out_features)
        self._lora = None

    @property
    def fused_parts(self) -> tuple[tuple[int, ...], ...]:
        """The groups of parts an eager forward shrinks with one fused call, e.g. ``((0, 1, 2),)`` for q/k/v."""
        return () if self._lora is None else tuple(tuple(run.parts) for run in self._lora.fused)

    @property
    def has_lora(self) -> bool:
        return self._lora is not None

    def forward(self, x: torch.Tensor, step: LinearStep) -> list[torch.Tensor]:
        """:meth:`output` split into one ``[T, out_p]`` per part (views of it)."""
        y = self.output(x, step)
        return list(y.split(self.out_features, dim=-1)) if len(self.out_features) > 1 else [y]

    def output(self, x: torch.Tensor, step: LinearStep) -> torch.Tensor:
        """The base projection(s) plus each token's adapter, run by the step's executor.

        Semantics::

            y = x @ W.T                                        # all parts in one matmul
            for each part p with rows (A_p, Bt_p), unless the step has no LoRA metadata or no adapter token:
                y_p += shrink / expand of x through A_p, Bt_p   # y_p[t] += x[t] @ A_p[rows of slot[t]].T @ ...
            y += bias                                          # where the layer has one

        Shape: x [T, in]; returns a new [T, sum(out)]."""
        y = step.executor.linear(x, self._weight(), self._lora, step)
        return y.add_(self.bias) if self._adds_bias else y

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
        layout = WeightLayout.PLAIN if choice is None else choice.layout
    packed = False
    for module in linears:
        packed |= module.pack(layout)
    return packed, choice


def quantize_linears(linears: list[LoRALinear]) -> int:
    """Quantize each of ``linears`` still holding a plain weight to int8 (:meth:`LoRALinear.quantize`); returns how
    many are int8."""
    return sum(module.quantize() for module in linears)
