"""The CPU library's linear ops (:mod:`kernels.cpu.library` builds and loads them): a fused linear's LoRA
(``lora_apply``), a linear's base matmul with its LoRA in one call per weight layout (``lora_blocked`` on our
blocked fp32 layout, ``lora_onednn`` on oneDNN's, ``lora_linear`` on a plain fp32 weight at decode, ``fixed_linear``
in a fixed order), each ending with a LoRA variant's vector epilogue when given one (:class:`Epilogue`; alone:
``vector_epilogue``), and the base matmul on an int8 weight (``q8_linear``, blocked by :func:`q8_block`).
Call :func:`kernels.cpu.library.load` first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

_op = None  # torch.ops.adapter_manager.lora_apply.default, once resolved
_linear_op = None  # torch.ops.adapter_manager.lora_linear.default, once resolved
_onednn_op = None  # torch.ops.adapter_manager.lora_onednn.default, once resolved
_blocked_op = None  # torch.ops.adapter_manager.lora_blocked.default, once resolved
_q8_op = None  # torch.ops.adapter_manager.q8_linear.default, once resolved
_fixed_op = None  # torch.ops.adapter_manager.fixed_linear.default, once resolved
_epilogue_op = None  # torch.ops.adapter_manager.vector_epilogue.default, once resolved


def lora_apply(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bts: list[torch.Tensor], runs: torch.Tensor) -> None:
    """``y[:, part p's columns] += (x @ A_p[rows].T) @ Bt_p[rows]`` per run; see csrc/lora_apply.cpp. Load the
    library first."""
    global _op
    if _op is None:
        _op = torch.ops.adapter_manager.lora_apply.default  # resolved once: the namespace lookup costs per call
    _op(y, x, a, bts, runs)


class Epilogue(NamedTuple):
    """A LoRA variant's vector epilogue for a one-call linear to end with (:func:`vector_epilogue`'s semantics per
    group; kernels/vectors.py)."""

    vectors: Sequence[torch.Tensor]  # per group of adjacent parts: Shape: [S + 1, columns], unit inner stride
    starts: Sequence[int]  # each group's first column of y
    bias: torch.Tensor | None  # Shape: [T] int64: the vector row each token adds
    scale: torch.Tensor | None  # Shape: [T] int64: the vector row each token scales by


LINEAR_MAX_TOKENS = 16
"""The most tokens :func:`lora_linear` takes (kLinearTokens in the C++ source)."""

_NO_RUNS = torch.zeros(0, 4, dtype=torch.int64)
_NO_EPILOGUE = Epilogue((), (), None, None)


def lora_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    a_groups: Sequence[torch.Tensor],
    bts: Sequence[torch.Tensor],
    offsets: Sequence[int],
    runs: torch.Tensor | None,
    epilogue: Epilogue | None = None,
) -> torch.Tensor:
    """``y = x @ w.T`` with each group's LoRA added inside the same call (fp32, T <= :data:`LINEAR_MAX_TOKENS`): group
    g's parts ``a_groups[g]`` [N, P_g, in] and their Bt (``bts``, every group's parts in order) own y's columns from
    ``offsets[g]`` on; ``runs`` None or empty: the base matmul only. See its csrc/ source. Load the library first."""
    global _linear_op
    if _linear_op is None:
        _linear_op = torch.ops.adapter_manager.lora_linear.default
    return _linear_op(x, w, a_groups, bts, offsets, _NO_RUNS if runs is None else runs, *(epilogue or _NO_EPILOGUE))


def lora_onednn(
    x: torch.Tensor,
    packed: torch.Tensor,
    a_groups: Sequence[torch.Tensor],
    bts: Sequence[torch.Tensor],
    offsets: Sequence[int],
    runs: torch.Tensor,
    epilogue: Epilogue | None = None,
) -> torch.Tensor:
    """``y = x @ W.T`` through oneDNN's linear on the packed W (:func:`kernels.cpu.weights.packed_linear`), then each
    group's :func:`lora_apply` onto its columns (groups as :func:`lora_linear`'s), in one call: the same values as
    those calls one by one. Any number of tokens, the dtypes oneDNN packs. load the library first."""
    global _onednn_op
    if _onednn_op is None:
        _onednn_op = torch.ops.adapter_manager.lora_onednn.default
    return _onednn_op(x, packed, a_groups, bts, offsets, runs, *(epilogue or _NO_EPILOGUE))


def fixed_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    a_groups: Sequence[torch.Tensor],
    bts: Sequence[torch.Tensor],
    offsets: Sequence[int],
    runs: torch.Tensor | None,
    epilogue: Epilogue | None = None,
) -> torch.Tensor:
    """Semantics: ``y = x @ w.T`` plus each group's :func:`lora_apply` onto its columns (groups as
    :func:`lora_linear`'s; ``runs`` None or empty: the base matmul only), every token's outputs summed in one order
    fixed by the shapes alone (the deterministic mode: a token's result never depends on the other tokens of the call,
    their number, or the threads). Any number of tokens; fp32, bf16 or fp16 (x and w alike), fp32 accumulation rounded
    once. See its csrc/ source. Load the library first. Shape: x [T, in]; w [out, in] contiguous; returns a new
    [T, out]."""
    global _fixed_op
    if _fixed_op is None:
        _fixed_op = torch.ops.adapter_manager.fixed_linear.default
    return _fixed_op(x, w, a_groups, bts, offsets, _NO_RUNS if runs is None else runs, *(epilogue or _NO_EPILOGUE))


BLOCK = 32
"""Columns per block of :func:`block_weight`'s layout (kBlock in ``csrc/lora_blocked.cpp``)."""


def vector_epilogue(
    y: torch.Tensor, start: int, vectors: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None
) -> None:
    """``y[t, start + j] += vectors[bias[t], j]``, then ``y[t, start + j] += y[t, start + j] · vectors[scale[t], j]``
    (each skipped when its index is None), in fp32 rounded once; in place (csrc/vector_epilogue.cpp).

    Shape: y [T, out] (unit inner stride), vectors [S + 1, columns] (a strided view, unit inner stride), bias and
    scale [T] int64. Load the library first."""
    global _epilogue_op
    if _epilogue_op is None:
        _epilogue_op = torch.ops.adapter_manager.vector_epilogue.default
    _epilogue_op(y, start, vectors, bias, scale)


def block_weight(w: torch.Tensor) -> torch.Tensor:
    """W [N, in] in the blocked layout :func:`lora_blocked` streams: ``wb[b, k, c] = W[BLOCK·b + c, k]``, zero past N.
    Shape: w [N, in]; returns a new contiguous [ceil(N / BLOCK), in, BLOCK]."""
    n, k = w.shape
    padded = torch.nn.functional.pad(w.detach(), (0, 0, 0, -n % BLOCK))
    return padded.view(-1, BLOCK, k).transpose(1, 2).contiguous()


def unblock_weight(wb: torch.Tensor, n: int) -> torch.Tensor:
    """The plain [n, in] weight back from :func:`block_weight`'s layout."""
    return wb.transpose(1, 2).reshape(-1, wb.shape[1])[:n].contiguous()


def lora_blocked(
    x: torch.Tensor,
    wb: torch.Tensor,
    n: int,
    a_groups: Sequence[torch.Tensor],
    bts: Sequence[torch.Tensor],
    offsets: Sequence[int],
    runs: torch.Tensor | None,
    epilogue: Epilogue | None = None,
) -> torch.Tensor:
    """Semantics: ``y = x @ W.T`` for W [n, in] held as :func:`block_weight`'s ``wb``, plus each group's
    :func:`lora_apply` onto its columns (groups as :func:`lora_linear`'s; ``runs`` None or empty: the base matmul
    only), in one call. Any number of tokens, fp32: runs of 16+ tokens in a step of more than 16 (prefill) take their
    LoRA inside the GEMM, the others lora_apply's loops after it. See its csrc/ source. Load the library first.
    Shape: x [T, in]; returns a new [T, n]."""
    global _blocked_op
    if _blocked_op is None:
        _blocked_op = torch.ops.adapter_manager.lora_blocked.default
    runs = _NO_RUNS if runs is None else runs
    return _blocked_op(x, wb, n, a_groups, bts, offsets, runs, *(epilogue or _NO_EPILOGUE))


Q8_BLOCK = 48
"""Output columns per block of :func:`q8_block`'s layout (kQ8Block in ``csrc/q8_linear.cpp``)."""


def q8_block(q: torch.Tensor) -> torch.Tensor:
    """int8 q [N, in] in the blocked layout :func:`q8_linear` reads: ``qb[b, k, c] = q[Q8_BLOCK·b + c, k]``, zero past
    N. Returns a new contiguous [ceil(N / Q8_BLOCK), in, Q8_BLOCK]."""
    n, k = q.shape
    padded = torch.nn.functional.pad(q, (0, 0, 0, -n % Q8_BLOCK))
    return padded.view(-1, Q8_BLOCK, k).transpose(1, 2).contiguous()


def q8_unblock(qb: torch.Tensor, n: int) -> torch.Tensor:
    """The plain int8 [n, in] back from :func:`q8_block`'s layout."""
    return qb.transpose(1, 2).reshape(-1, qb.shape[1])[:n].contiguous()


def q8_linear(x: torch.Tensor, qb: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """Semantics: ``y = (x @ q.T) · scales`` for the int8 q [n, in] held as :func:`q8_block`'s ``qb`` (= ``x @ W.T``
    for the dequantized ``W = q · scales[:, None]``, within fp32 rounding). Any number of tokens, fp32 x and scales.
    See its csrc/ source. Load the library first. Shape: x [T, in]; scales [n]; returns a new [T, n]."""
    global _q8_op
    if _q8_op is None:
        _q8_op = torch.ops.adapter_manager.q8_linear.default
    return _q8_op(x, qb, scales, n)
