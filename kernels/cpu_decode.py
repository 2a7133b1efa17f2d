"""The decode step's glue on CPU: RoPE + KV write + GQA attention, residual add + RMSNorm, and SiLU·mul, one C++ call
each (``kernels/csrc/decode_cpu.cpp``, built with the LoRA kernel by :mod:`kernels.cpu_kernels`).

Between its weight matmuls an eager decode layer was ~35 small torch ops (views, the rotation, two ``index_put_``,
SDPA, norms, the residual adds), each a Python call, a dispatch and an allocation, and SDPA over 8 rows of 144 keys
took 3.4× the read of those keys. These ops do the same math in three calls per layer, and attention reads each
row's keys and values once. Each has a torch reference with the same signature (``*_reference``) that tests compare
it with; the model uses them on CPU steps where :func:`available` (fp32, bf16, fp16).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels import cpu_kernels

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available(x: torch.Tensor) -> bool:
    """Whether the C++ ops serve tensors like ``x``: a CPU tensor of a supported dtype, the library built."""
    return x.device.type == "cpu" and x.dtype in DTYPES and cpu_kernels.load()


def decode_attention(
    qkv: torch.Tensor,
    rope_table: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """RoPE, KV cache write and causal GQA attention of a step's tokens, in one call.

    Semantics (D = head dim, q/k/v the column blocks of qkv, cos/sin = rope_table[positions] cast to qkv's dtype)::

        q, k = rope(q, cos, sin), rope(k, cos, sin)                  # HF's rotate_half pairing, i with i + D/2
        K[rows[t], positions[t]] = k[t];  V[rows[t], positions[t]] = v[t]     for every t (all written first)
        out[t, h] = softmax(q[t, h] · K[rows[t], :positions[t] + 1, h // (H / KV)].T / √D) · V[rows[t], ..., same]

    Shape: qkv [T, (H + 2·KV)·D] (unit inner stride; the fused q|k|v output); rope_table [P, 2, D/2] fp32 (cos, sin);
    k_cache, v_cache [B, P, KV, D] contiguous, written in place; rows, positions [T] int64. Returns a new [T, H·D].
    Every token reads its whole row up to its own position: one sequence's decode token, or a chunk of them in
    order (each token then sees the chunk's earlier keys).
    """
    return torch.ops.adapter_manager.decode_attention.default(
        qkv, rope_table, k_cache, v_cache, rows, positions, num_heads, num_kv_heads
    )


def decode_attention_reference(
    qkv: torch.Tensor,
    rope_table: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """:func:`decode_attention` as torch ops, one SDPA per token (the runtime model's rope, cache update and
    ``attend_static`` semantics)."""
    tokens, dim = qkv.shape[0], k_cache.shape[3]
    half = dim // 2
    q, k, v = qkv.split([num_heads * dim, num_kv_heads * dim, num_kv_heads * dim], dim=-1)
    trig = rope_table[positions].to(qkv.dtype)  # [T, 2, D/2]
    cos, sin = trig[:, None, 0], trig[:, None, 1]

    def rope(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    q = rope(q.reshape(tokens, num_heads, dim))
    k_cache.index_put_((rows, positions), rope(k.reshape(tokens, num_kv_heads, dim)))
    v_cache.index_put_((rows, positions), v.reshape(tokens, num_kv_heads, dim))
    out = torch.empty(tokens, num_heads, dim, dtype=qkv.dtype)
    for t in range(tokens):
        end = int(positions[t]) + 1
        keys = k_cache[rows[t], :end].transpose(0, 1)  # [KV, end, D]
        values = v_cache[rows[t], :end].transpose(0, 1)
        attended = F.scaled_dot_product_attention(
            q[t][:, None].float(), keys.float(), values.float(), scale=1 / math.sqrt(dim), enable_gqa=True
        )  # [H, 1, D]
        out[t] = attended[:, 0].to(qkv.dtype)
    return out.reshape(tokens, num_heads * dim)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The residual add (in place) and the next RMSNorm, in one call.

    Semantics::

        h += delta                                   # when delta is given: h is the residual stream after it
        out = weight · (h / sqrt(mean(h², -1) + eps))   # computed in fp32, rounded to h's dtype before the weight

    Shape: h [T, H] (unit inner stride), written in place when ``delta`` [T, H] is given; weight [H]. Returns a new
    [T, H].
    """
    return torch.ops.adapter_manager.add_rms_norm.default(h, delta, weight, eps)


def add_rms_norm_reference(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """:func:`add_rms_norm` as torch ops (HF Llama's RMSNorm)."""
    if delta is not None:
        h += delta
    h32 = h.float()
    return weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation over the fused gate|up output.

    Semantics: ``gate, up = gate_up.chunk(2, -1); out = silu(gate) · up`` (silu rounded to the dtype first).

    Shape: gate_up [T, 2·I] (unit inner stride); returns a new [T, I].
    """
    return torch.ops.adapter_manager.silu_mul.default(gate_up)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`silu_mul` as torch ops."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
