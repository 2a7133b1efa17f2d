"""Paged decode attention in Triton (CUDA; Triton's interpreter on CPU tensors for the tests): each token reads its
sequence's keys and values in place through its block table, no gather.

Semantics (the torch form: ``runtime.model.kv_cache.KVCache.attend_static``; BS = block size, G = H / KV)::

    at(t, j) = block tables[rows[t], j // BS], offset j % BS
    out[t, h] = softmax(q[t, h] · K[at(t, j)][h // G] / √D  for j ≤ positions[t]) · V[at(t, j)][h // G]

Grid (T, KV): one program per (token, KV head) serves the G query heads sharing that KV head, so every key and value
row is read once per token. It walks the token's blocks up to its own position (a loop bound read from memory: the
grid depends on T alone, so a captured decode step replays with new tables and positions), with an online softmax
in fp32 (scores, running max and sum, the accumulator), and writes the output in q's dtype. Products are broadcast
sums, not ``tl.dot``: a GQA group is 1..8 heads, under tl.dot's 16-row minimum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from adapter_manager.kernels.triton.kernels import InterpretModeError, imported_interpreting, interpret_mode


def _paged_decode(
    q_ptr,
    k_ptr,
    v_ptr,
    tab_ptr,
    rows_ptr,
    pos_ptr,
    o_ptr,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_tr,
    stride_ot,
    stride_oh,
    scale,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    t = tl.program_id(0)
    kv = tl.program_id(1)
    row = tl.load(rows_ptr + t).to(tl.int64)
    count = tl.load(pos_ptr + t).to(tl.int32) + 1  # keys 0 .. position
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    s = tl.arange(0, BLOCK_S)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv * GROUP + g
    q = tl.load(
        q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)  # [G, D]
    m = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for b in range(0, tl.cdiv(count, BLOCK_SIZE)):
        block = tl.load(tab_ptr + row * stride_tr + b).to(tl.int64)
        key_mask = (s < BLOCK_SIZE) & (b * BLOCK_SIZE + s < count)
        offsets = block * stride_kb + s[:, None] * stride_ks + kv * stride_kh + d[None, :]
        kv_mask = key_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)  # [S, D]
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, S]
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        v = tl.load(v_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)  # [S, D]
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / total[:, None]
    tl.store(
        o_ptr + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=g_mask[:, None] & d_mask[None, :],
    )


@dataclass
class PagedAttention:
    """The paged decode attention kernel, jit-decorated once in the mode Triton was imported in (as
    :class:`kernels.triton.kernels.TritonKernels`: a mismatch raises :class:`InterpretModeError`)."""

    interpret: bool = field(init=False)
    kernel: object = field(init=False)

    def __post_init__(self) -> None:
        self.interpret = interpret_mode()
        if self.interpret != imported_interpreting():
            raise InterpretModeError("TRITON_INTERPRET changed since triton was imported; set it before importing")
        self.kernel = triton.jit(_paged_decode)

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """Semantics: the module's. Shape: q [T, H, D] (unit inner stride); k_cache, v_cache [NB, BS, KV, D]
        contiguous; tables [R, MB] int; rows, positions [T] int (every position < MB · BS). Returns a new
        [T, H, D] in q's dtype."""
        tokens, heads, dim = q.shape
        blocks, block_size, kv_heads, kv_dim = k_cache.shape
        if kv_dim != dim or heads % kv_heads or v_cache.shape != k_cache.shape:
            raise ValueError(f"q {tuple(q.shape)} and caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} differ")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(2) == 1 and tables.stride(1) == 1):
            raise ValueError("the caches must be contiguous, q and tables of unit inner stride")
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if tokens == 0:
            return out
        group = heads // kv_heads
        self.kernel[(tokens, kv_heads)](
            q, k_cache, v_cache, tables, rows, positions, out,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
            out.stride(0), out.stride(1), 1.0 / math.sqrt(dim),
            GROUP=group, BLOCK_G=triton.next_power_of_2(group), HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim),
            BLOCK_SIZE=block_size, BLOCK_S=triton.next_power_of_2(block_size),
        )  # fmt: skip
        return out
