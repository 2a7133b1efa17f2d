"""What a shrink/expand backend provides: the protocol the metadata, the ops and the seam all refer to."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from adapter_manager.kernels.config import LoRAForm


class KernelBackend(Protocol):
    """Every backend; ops in :mod:`kernels.ops` validate, then call these.

    ``a_rows [N, in]`` / ``bt_rows [N, out]`` are the row pools (see :class:`kernels.meta.LoRAKernelMeta`). ``meta``
    is the step's :class:`kernels.meta.LoRAKernelMeta`; it is typed ``object`` here because meta.py imports this
    module (the arrows run backends -> meta -> protocol, never back).

    Eager backends (:class:`EagerBackend`) also apply a fused linear's whole LoRA (``apply_parts``) and offer a
    one-call form of the base matmul and its LoRA (``fused_linear``). Which form a step takes is the backend's
    choice, never the model's.
    """

    traced: bool
    """True when the ops trace into a graph (XLA): static shapes, no host sync, expand returns a new tensor."""
    executor_type: type
    """Its linear executor's class (:mod:`kernels.executor`): how a layer's base matmul and LoRA run on it."""
    laned_output: bool
    """True when shrink's h is laned ``[T, A·R]`` (over the compact active table) rather than ``[T, R]``."""

    def shrink(self, x: torch.Tensor, a_rows: torch.Tensor, meta: object) -> torch.Tensor: ...

    def shrink_parts(self, x: torch.Tensor, a_parts: torch.Tensor, meta: object) -> torch.Tensor:
        """Shrink for P parts sharing x: ``a_parts [N, P, in]`` -> h ``[P, T, R]`` (laned: ``[P, T, A·R]``)."""
        ...

    def expand(
        self, y: torch.Tensor, h: torch.Tensor, bt_rows: torch.Tensor, meta: object, accumulate: bool
    ) -> torch.Tensor: ...


class EagerBackend(KernelBackend, Protocol):
    """A backend that runs op by op (``traced`` False): the metadata asks it which form each step takes."""

    def choose_form(self, num_tokens: int, active_slots: int, rank: int, runs: int) -> LoRAForm:
        """The form for a step of ``num_tokens`` tokens using ``active_slots`` ≥ 1 distinct slots (of padded rank
        ``rank``) in ``runs`` runs of equal slots (token order); never AUTO or NONE."""
        ...

    runs_every_step: bool
    """Every step with an adapter carries the C++ kernels' runs table (:attr:`LoRAKernelMeta.runs`), not only FUSED
    steps."""

    def apply_parts(
        self, y: torch.Tensor, x: torch.Tensor, a_parts: torch.Tensor, bt_parts: Sequence[torch.Tensor], meta: object
    ) -> torch.Tensor:
        """Semantics: :func:`kernels.ops.apply_parts` (operands checked): a fused linear's whole LoRA, in one call
        on FUSED steps where the backend has a kernel for it, else ``shrink_parts`` then one ``expand`` per part."""
        ...

    def fused_linear(
        self, x: torch.Tensor, weight: LinearWeight, groups: LoRAGroups, meta: object
    ) -> torch.Tensor | None:
        """The base matmul of ``weight`` and every one of its ``groups`` in one call where the backend has such a
        form for that weight's layout and that step, None otherwise (:func:`kernels.ops.fused_linear`)."""
        ...


class WeightLayout(enum.Enum):
    """How a linear's base weight ``W [out, in]`` is held, as a backend's :meth:`fused_linear` reads it."""

    PLAIN = "plain"
    """``[out, in]``, as ``nn.Linear`` holds it."""
    BLOCKED = "blocked"
    """Our fp32 blocked layout, ``[ceil(out / 32), in, 32]`` (:func:`kernels.cpu.linear_ops.block_weight`)."""
    ONEDNN = "onednn"
    """oneDNN's reordered copy (an opaque ``torch._mkldnn`` tensor: ``torch.ops.mkldnn._reorder_linear_weight``)."""
    INT8 = "int8"
    """Weight-only int8 with one scale per output row (:func:`kernels.quantize_weight`): ``W = q · scales[:, None]``;
    ``tensor`` is q, ``[out, in]`` int8, or on CPU in fp32 its blocked ``[ceil(out / 48), in, 48]``
    (:func:`kernels.cpu.linear_ops.q8_block`); ``scales`` ``[out]`` in the serving dtype."""


class LinearWeight(NamedTuple):
    """A linear's base weight in its layout: what a backend's one-call form needs to run ``x @ W.T``."""

    layout: WeightLayout
    tensor: torch.Tensor
    out_features: int
    """W's rows: the output's width (a blocked weight pads them to a multiple of 32)."""
    scales: torch.Tensor | None = None
    """INT8 only: one scale per output row ``[out_features]``, in the serving dtype."""


class LoRAGroups(NamedTuple):
    """A linear's LoRA as the one-call forms take it: groups of parts sharing x, each one ``apply_parts``' worth."""

    a_groups: tuple[torch.Tensor, ...]
    """Per group ``[N, P, in]``: a view of the pool's A rows (unit inner stride)."""
    bts: tuple[torch.Tensor, ...]
    """Every group's parts' Bt rows in order, ``[N, out_p]`` each (views of the pool, unit inner stride)."""
    offsets: tuple[int, ...]
    """Per group, its first column of the linear's output (ascending, groups not overlapping)."""


class LayoutReport(Protocol):
    """A layout chosen for a model's base weights and how (the cpu room's ``LayoutChoice``)."""

    layout: WeightLayout

    def describe(self) -> str: ...


@runtime_checkable
class DecodeOps(Protocol):
    """A backend's fused decode glue (:func:`kernels.layer_ops.decode_ops`: the cpu room's C++ ops); the torch forms
    with the same signatures are :mod:`kernels.layer_reference`."""

    compiled: bool
    """The device's compiled glue (its decode-only attention beats the model's batched attention); False: the torch
    forms."""

    def decode_attention(
        self,
        qkv: torch.Tensor,
        rope_table: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
    ) -> torch.Tensor:
        """RoPE, paged KV cache write and causal GQA attention of a step's tokens, in one call.

        Semantics (D = head dim, BS = block size, q/k/v the column blocks of qkv, cos/sin = rope_table[positions] in
        qkv's dtype; ``at(t, p)`` = block ``block_tables[rows[t], p // BS]``, offset ``p % BS``)::

            q, k = rope(q, cos, sin), rope(k, cos, sin)             # HF's rotate_half pairing, i with i + D/2
            K[at(t, positions[t])] = k[t];  V[at(t, positions[t])] = v[t]    for every t (all written first)
            out[t, h] = softmax(q[t, h] · K[at(t, j)][h // (H / KV)].T / √D  for j ≤ positions[t]) · V[same]

        Shape: qkv [T, (H + 2·KV)·D] (unit inner stride; the fused q|k|v output); rope_table [P, 2, D/2] fp32 (cos,
        sin); k_cache, v_cache [NB, BS, KV, D] contiguous, written in place; block_tables [R, MB] int64; rows (each
        token's table row), positions [T] int64. Returns a new [T, H·D]. Every token reads its row up to its own
        position: one sequence's decode token, or a chunk of them in order (each token then sees the chunk's earlier
        keys); rows may share blocks (a cached prefix).
        """
        ...

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """The residual add (in place) and the next RMSNorm, in one call.

        Semantics::

            h += delta                                      # when delta is given: h is the residual stream after it
            out = weight · (h / sqrt(mean(h², -1) + eps))   # computed in fp32, rounded to h's dtype before the weight

        Shape: h [T, H] (unit inner stride), written in place when ``delta`` [T, H] is given; weight [H]. Returns a
        new [T, H].
        """
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's activation over the fused gate|up output.

        Semantics: ``gate, up = gate_up.chunk(2, -1); out = silu(gate) · up`` (silu rounded to the dtype first).

        Shape: gate_up [T, 2·I] (unit inner stride); returns a new [T, I].
        """
        ...

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU's activation over the fused gate|up output (Gemma).

        Semantics: ``gate, up = gate_up.chunk(2, -1); out = gelu(gate, approximate="tanh") · up`` (gelu rounded to
        the dtype first).

        Shape: gate_up [T, 2·I] (unit inner stride); returns a new [T, I].
        """
        ...


@runtime_checkable
class DecodeCapture(Protocol):
    """A backend whose decode steps a CUDA graph may capture (the triton backend): what the graph keeps static.

    A captured step's LoRA launches read the step's adapters from one static tensor of the backend's making, so one
    graph per token bucket serves any mix of adapters: before each replay the caller copies the step's inputs
    (:meth:`step_inputs`) into the bucket's static tensor (:meth:`static_inputs`), which the metadata points the
    kernels at (:meth:`bind_inputs`). The model and the pool need nothing else of the backend.
    """

    capture_max_tokens: int
    """The most tokens a captured step may have (its kernels' grid must depend on T alone)."""

    def static_inputs(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        """A new static input tensor for steps of ``num_tokens`` tokens on ``device``, all padding (no adapter)."""
        ...

    def step_inputs(self, meta: object, num_tokens: int) -> torch.Tensor:
        """The host tensor to copy into a static input of ``num_tokens`` tokens for the step ``meta`` was prepared
        for (``meta.num_tokens`` <= num_tokens; the rest padding)."""
        ...

    def bind_inputs(self, meta: object, static: torch.Tensor) -> None:
        """Point ``meta``'s (just prepared) step at ``static``: its kernels read the step's adapters from it."""
        ...
