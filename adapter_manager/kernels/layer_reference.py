"""The torch forms of the model's ops besides its LoRA terms (:mod:`kernels.layer_ops`): the same signatures and
semantics as each backend's implementation (:class:`kernels.protocol.DecodeOps`), which the tests compare with them."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def decode_attention(
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
    """Semantics: :meth:`kernels.protocol.DecodeOps.decode_attention`, as torch ops, one SDPA per token (the runtime
    model's rope, paged cache update and ``attend_static`` semantics)."""
    tokens, block_size, dim = qkv.shape[0], k_cache.shape[1], k_cache.shape[3]
    half = dim // 2
    q, k, v = qkv.split([num_heads * dim, num_kv_heads * dim, num_kv_heads * dim], dim=-1)
    trig = rope_table[positions].to(qkv.dtype)  # [T, 2, D/2]
    cos, sin = trig[:, None, 0], trig[:, None, 1]

    def rope(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    q = rope(q.reshape(tokens, num_heads, dim))
    slots = block_tables[rows, positions // block_size] * block_size + positions % block_size
    k_cache.view(-1, num_kv_heads, dim).index_put_((slots,), rope(k.reshape(tokens, num_kv_heads, dim)))
    v_cache.view(-1, num_kv_heads, dim).index_put_((slots,), v.reshape(tokens, num_kv_heads, dim))
    out = torch.empty(tokens, num_heads, dim, dtype=qkv.dtype, device=qkv.device)
    for t in range(tokens):
        end = int(positions[t]) + 1
        blocks = block_tables[rows[t], : (end - 1) // block_size + 1]
        keys = k_cache[blocks].flatten(0, 1)[:end].transpose(0, 1)  # [KV, end, D]
        values = v_cache[blocks].flatten(0, 1)[:end].transpose(0, 1)
        attended = F.scaled_dot_product_attention(
            q[t][:, None].float(), keys.float(), values.float(), scale=1 / math.sqrt(dim), enable_gqa=True
        )  # [H, 1, D]
        out[t] = attended[:, 0].to(qkv.dtype)
    return out.reshape(tokens, num_heads * dim)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Semantics: :meth:`kernels.protocol.DecodeOps.add_rms_norm`, as torch ops (HF Llama's RMSNorm)."""
    if delta is not None:
        h += delta
    h32 = h.float()
    return weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Semantics: :meth:`kernels.protocol.DecodeOps.silu_mul`, as torch ops."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Semantics: :meth:`kernels.protocol.DecodeOps.gelu_tanh_mul`, as torch ops (HF Gemma's MLP)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def base_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Semantics: :func:`kernels.layer_ops.base_linear` on the plain weight. Shape: x [T, in]; weight [out, in];
    returns a new [T, out]."""
    return x @ weight.t()


class TorchDecodeOps:
    """:class:`DecodeOps` as torch ops (:mod:`kernels.layer_reference`), for a device without compiled decode glue.

    ``add_rms_norm`` keeps the model's RMSNorm rounding exactly (fp32 through ``F.rms_norm``)."""

    compiled = False
    """The ops are torch's (no decode-only attention op worth taking over the model's batched attention)."""
    decode_attention = staticmethod(decode_attention)
    silu_mul = staticmethod(silu_mul)
    gelu_tanh_mul = staticmethod(gelu_tanh_mul)

    @staticmethod
    def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Semantics: :meth:`DecodeOps.add_rms_norm`."""
        if delta is not None:
            h += delta
        if h.dtype == torch.float32:  # fp32: the same math as one fused op
            return F.rms_norm(h, weight.shape, weight, eps)
        return add_rms_norm(h, None, weight, eps)


class UnfusedDecodeOps(TorchDecodeOps):
    """:class:`TorchDecodeOps` with every norm in its unfused math (XLA's: ``F.rms_norm`` is not taken in a traced
    step)."""

    @staticmethod
    def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Semantics: :meth:`DecodeOps.add_rms_norm`."""
        if delta is not None:
            h += delta
        return add_rms_norm(h, None, weight, eps)


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Semantics: ``x @ weight.T``, one token per matmul: every call has the same shape whatever the step holds, so a
    token's result never depends on the others (the deterministic mode's torch form; slow: the weight is read once
    per token). Shape: x [T, in]; weight [out, in]; returns a new [T, out]."""
    if x.shape[0] == 0:
        return x.new_empty(0, weight.shape[0])
    return torch.cat([x[t : t + 1] @ weight.t() for t in range(x.shape[0])])


class RowwiseDecodeOps(TorchDecodeOps):
    """:class:`TorchDecodeOps` with the norms one token at a time (a reduction a device may split by the batch's shape,
    as CUDA's does): the deterministic mode's torch forms. Attention is per token already (``decode_attention``)."""

    @staticmethod
    def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Semantics: :meth:`DecodeOps.add_rms_norm`, each row alone."""
        if delta is not None:
            h += delta
        rows = [TorchDecodeOps.add_rms_norm(h[t : t + 1], None, weight, eps) for t in range(h.shape[0])]
        return torch.cat(rows) if rows else torch.empty_like(h)
