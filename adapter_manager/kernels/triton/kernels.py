"""Triton shrink / expand over the row pool: BGMV (one token per program: decode) and SGMV (runs of equal slots:
prefill), all parts of a fused linear in one launch.

Every kernel reads each token's adapter rows in place (``first`` row, ``rank``) from the pool views; nothing is
gathered. Lanes past a token's rank are masked, and a (token, rank block) program whose block starts at or past the
rank returns at once: no bytes or FLOPs past a rank beyond the last partial block. Tokens with slot -1 have rank 0
(BGMV: their programs return; SGMV: they are in no run): h stays zero, y is untouched. Accumulation is fp32.

Two step tables drive them (built on the host per step by :mod:`kernels.triton.backend`):

- token table ``[2, T]`` int32: row 0 each token's first pool row, row 1 its rank (0: no adapter) - BGMV; its grid
  depends only on T, so a captured decode step (CUDA graph) replays with a new table copied into the same buffer;
- runs table ``[runs, 4]`` int32: (token start, token count, first row, rank) per run of equal slots - SGMV.

Expand takes the P parts' Bt as one base pointer plus each part's element offset from part 0 (views of one pool
tensor with one row stride, as the row layout gives); part p's output columns start at ``out_0 + ... + out_{p-1}``
of y. The kernel bodies are plain functions: :class:`TritonKernels` jit-decorates them when a backend is built, so
whether they run interpreted (``TRITON_INTERPRET=1``: numpy on CPU tensors) is decided then, not at import.

``UPCAST`` (SGMV): tl.dot on fp32 copies of the tiles. Triton 3.9's interpreter multiplies bf16 tiles as their
uint16 bit patterns in tl.dot (``np.matmul`` on the raw storage), so interpret mode upcasts bf16 tiles first (the
products of bf16 values are exact in fp32); compiled for a GPU, tl.dot takes the bf16 tiles.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import triton
import triton.language as tl


def _bgmv_shrink(
    x_ptr,
    a_ptr,
    h_ptr,
    tok_ptr,
    num_tokens,
    in_features,
    stride_xt,
    stride_an,
    stride_ap,
    stride_hp,
    stride_ht,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Grid (T, P, rank blocks · SPLIT_K): ``h[p, t, r] (+)= sum_k a[first + r, p, k] · x[t, k]``, r < rank."""
    t = tl.program_id(0)
    part = tl.program_id(1)
    block = tl.program_id(2)
    rank = tl.load(tok_ptr + num_tokens + t)
    r0 = (block // SPLIT_K) * BLOCK_R
    if r0 >= rank:
        return
    first = tl.load(tok_ptr + t)
    rows = r0 + tl.arange(0, BLOCK_R)
    row_mask = rows < rank
    a_base = a_ptr + (first + rows).to(tl.int64)[:, None] * stride_an + part * stride_ap
    x_base = x_ptr + t.to(tl.int64) * stride_xt
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range((block % SPLIT_K) * BLOCK_K, in_features, BLOCK_K * SPLIT_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_mask = cols < in_features
        x = tl.load(x_base + cols, mask=col_mask, other=0.0).to(tl.float32)
        a = tl.load(a_base + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    out = h_ptr + part * stride_hp + t.to(tl.int64) * stride_ht + rows
    if SPLIT_K == 1:
        tl.store(out, acc, mask=row_mask)
    else:
        tl.atomic_add(out, acc, mask=row_mask)


def _bgmv_expand(
    h_ptr,
    y_ptr,
    bt_ptr,
    tok_ptr,
    num_tokens,
    off1,
    off2,
    out0,
    out1,
    out2,
    stride_bn,
    stride_hp,
    stride_ht,
    stride_yt,
    BLOCKS0: tl.constexpr,
    BLOCKS1: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid (T, column blocks of all parts): ``y[t, col_p + n] += sum_r h[p, t, r] · bt_p[first + r, n]``."""
    t = tl.program_id(0)
    block = tl.program_id(1)
    rank = tl.load(tok_ptr + num_tokens + t)
    if rank == 0:
        return
    first = tl.load(tok_ptr + t)
    is1 = (block >= BLOCKS0) & (block < BLOCKS0 + BLOCKS1)
    is2 = block >= BLOCKS0 + BLOCKS1
    part = is1.to(tl.int32) + 2 * is2.to(tl.int32)
    column_block = block - tl.where(is1, BLOCKS0, 0) - tl.where(is2, BLOCKS0 + BLOCKS1, 0)
    out = tl.where(is2, out2, tl.where(is1, out1, out0))
    col0 = tl.where(is2, out0 + out1, tl.where(is1, out0, 0))
    offset = tl.where(is2, off2, tl.where(is1, off1, 0)).to(tl.int64)
    cols = column_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < out
    h_base = h_ptr + part * stride_hp + t.to(tl.int64) * stride_ht
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_mask = rows < rank
        h = tl.load(h_base + rows, mask=row_mask, other=0.0).to(tl.float32)
        bt_rows = bt_ptr + offset + (first + rows).to(tl.int64)[:, None] * stride_bn
        bt = tl.load(bt_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        acc += tl.sum(h[:, None] * bt.to(tl.float32), axis=0)
    y = y_ptr + t.to(tl.int64) * stride_yt + col0 + cols
    acc += tl.load(y, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(y, acc, mask=col_mask)


def _sgmv_shrink(
    x_ptr,
    a_ptr,
    h_ptr,
    runs_ptr,
    in_features,
    stride_xt,
    stride_an,
    stride_ap,
    stride_hp,
    stride_ht,
    RANK_BLOCKS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grid (runs, token blocks of the longest run, P · rank blocks): one [BLOCK_T, BLOCK_R] tile of h per program,
    ``x[run tokens] @ a[first + r, p].T`` by tl.dot over BLOCK_K slices of the input features."""
    run = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK_T
    part = tl.program_id(2) // RANK_BLOCKS
    r0 = (tl.program_id(2) % RANK_BLOCKS) * BLOCK_R
    count = tl.load(runs_ptr + run * 4 + 1)
    rank = tl.load(runs_ptr + run * 4 + 3)
    if (t0 >= count) | (r0 >= rank):
        return
    start = tl.load(runs_ptr + run * 4)
    first = tl.load(runs_ptr + run * 4 + 2)
    offs = t0 + tl.arange(0, BLOCK_T)
    tok_mask = offs < count
    toks = (start + offs).to(tl.int64)
    rows = r0 + tl.arange(0, BLOCK_R)
    row_mask = rows < rank
    a_base = a_ptr + (first + rows).to(tl.int64)[None, :] * stride_an + part * stride_ap  # [1, BLOCK_R]
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_mask = cols < in_features
        x_tile = x_ptr + toks[:, None] * stride_xt + cols[None, :]
        x = tl.load(x_tile, mask=tok_mask[:, None] & col_mask[None, :], other=0.0)  # zeros: no NaN x 0 past in
        a = tl.load(a_base + cols[:, None], mask=col_mask[:, None] & row_mask[None, :], other=0.0)  # [K, R]
        if UPCAST:
            acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, a, acc, input_precision=PRECISION)
    out = h_ptr + part * stride_hp + toks[:, None] * stride_ht + rows[None, :]
    tl.store(out, acc, mask=tok_mask[:, None] & row_mask[None, :])


def _sgmv_expand(
    h_ptr,
    y_ptr,
    bt_ptr,
    runs_ptr,
    off1,
    off2,
    out0,
    out1,
    out2,
    stride_bn,
    stride_hp,
    stride_ht,
    stride_yt,
    BLOCKS0: tl.constexpr,
    BLOCKS1: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grid (runs, token blocks of the longest run, column blocks of all parts): one [BLOCK_T, BLOCK_N] tile of y
    per program, ``y += h[p, run tokens, :rank] @ bt_p[first : first + rank]`` (h cast to Bt's dtype for tl.dot)."""
    run = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK_T
    block = tl.program_id(2)
    count = tl.load(runs_ptr + run * 4 + 1)
    if t0 >= count:
        return
    start = tl.load(runs_ptr + run * 4)
    first = tl.load(runs_ptr + run * 4 + 2)
    rank = tl.load(runs_ptr + run * 4 + 3)
    is1 = (block >= BLOCKS0) & (block < BLOCKS0 + BLOCKS1)
    is2 = block >= BLOCKS0 + BLOCKS1
    part = is1.to(tl.int32) + 2 * is2.to(tl.int32)
    column_block = block - tl.where(is1, BLOCKS0, 0) - tl.where(is2, BLOCKS0 + BLOCKS1, 0)
    out = tl.where(is2, out2, tl.where(is1, out1, out0))
    col0 = tl.where(is2, out0 + out1, tl.where(is1, out0, 0))
    offset = tl.where(is2, off2, tl.where(is1, off1, 0)).to(tl.int64)
    offs = t0 + tl.arange(0, BLOCK_T)
    tok_mask = offs < count
    toks = (start + offs).to(tl.int64)
    cols = column_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < out
    h_base = h_ptr + part * stride_hp + toks[:, None] * stride_ht  # [BLOCK_T, 1]
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_mask = rows < rank
        bt_rows = bt_ptr + offset + (first + rows).to(tl.int64)[:, None] * stride_bn
        bt = tl.load(bt_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        h = tl.load(h_base + rows[None, :], mask=tok_mask[:, None] & row_mask[None, :], other=0.0)
        if UPCAST:
            acc = tl.dot(h.to(tl.float32), bt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(h.to(bt.dtype), bt, acc, input_precision=PRECISION)
    y = y_ptr + toks[:, None] * stride_yt + col0 + cols[None, :]
    mask = tok_mask[:, None] & col_mask[None, :]
    acc += tl.load(y, mask=mask, other=0.0).to(tl.float32)
    tl.store(y, acc, mask=mask)


class InterpretModeError(ValueError):
    """``TRITON_INTERPRET`` now differs from what it was when triton was first imported."""


@dataclass
class TritonKernels:
    """The four kernels jit-decorated once, in the mode Triton's knob (``TRITON_INTERPRET``) has when this is built.

    The mode must equal the one triton was imported in: triton.language's own helpers (``tl.sum``...) were decorated
    at that import, and an interpreted kernel cannot call a compiled helper, nor the reverse; a mismatch raises
    :class:`InterpretModeError` naming the fix. One per backend: the decorated functions hold Triton's compile
    caches, so their lifetime is the backend's.
    """

    interpret: bool = field(init=False)
    """Whether the kernels run in Triton's interpreter (numpy, any device) instead of compiled for a GPU."""
    bgmv_shrink: object = field(init=False)
    bgmv_expand: object = field(init=False)
    sgmv_shrink: object = field(init=False)
    sgmv_expand: object = field(init=False)

    def __post_init__(self) -> None:
        self.interpret = interpret_mode()
        if self.interpret != imported_interpreting():
            now, then = ("set", "unset") if self.interpret else ("unset", "set")
            raise InterpretModeError(
                f"TRITON_INTERPRET is {now} now but was {then} when triton was first imported; set it (or unset it) "
                "before anything imports triton"
            )
        self.bgmv_shrink = triton.jit(_bgmv_shrink)
        self.bgmv_expand = triton.jit(_bgmv_expand)
        self.sgmv_shrink = triton.jit(_sgmv_shrink)
        self.sgmv_expand = triton.jit(_sgmv_expand)


def interpret_mode() -> bool:
    """Whether ``triton.jit`` decorates for the interpreter now (``TRITON_INTERPRET=1``, read at each call)."""
    return bool(triton.knobs.runtime.interpret)


def imported_interpreting() -> bool:
    """Whether triton was imported in interpret mode (its own ``tl.sum`` is then an interpreted function)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


def next_power_of_2(value: int) -> int:
    return triton.next_power_of_2(value)
