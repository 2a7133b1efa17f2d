"""The decode step's glue on CPU: RoPE + KV write + GQA attention, residual add + RMSNorm, and SiLU·mul, one C++ call
each (``csrc/decode_attention.cpp``, ``add_rms_norm.cpp``, ``silu_mul.cpp``; built with the rest of the library by
:mod:`kernels.cpu.library`).

Between its weight matmuls an eager decode layer is ~35 small torch ops (views, the rotation, two ``index_put_``,
SDPA, norms, the residual adds), each a Python call, a dispatch and an allocation, and SDPA over 8 rows of 144 keys
took 3.4× the read of those keys. These ops do the same math in three calls per layer, and attention reads each
row's keys and values once. Each has a torch form with the same signature (:mod:`kernels.layer_reference`) that
tests compare it with; the model reaches them through :mod:`kernels.layer_ops` where :func:`available`.
"""

from __future__ import annotations

import torch

from kernels.cpu.library import load

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available(x: torch.Tensor) -> bool:
    """Whether the C++ ops serve tensors like ``x``: a CPU tensor of a supported dtype, the library built."""
    return x.device.type == "cpu" and x.dtype in DTYPES and load()


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


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The residual add (in place) and the next RMSNorm, in one call.

    Semantics::

        h += delta                                   # when delta is given: h is the residual stream after it
        out = weight · (h / sqrt(mean(h², -1) + eps))   # computed in fp32, rounded to h's dtype before the weight

    Shape: h [T, H] (unit inner stride), written in place when ``delta`` [T, H] is given; weight [H]. Returns a new
    [T, H].
    """
    return torch.ops.adapter_manager.add_rms_norm.default(h, delta, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation over the fused gate|up output.

    Semantics: ``gate, up = gate_up.chunk(2, -1); out = silu(gate) · up`` (silu rounded to the dtype first).

    Shape: gate_up [T, 2·I] (unit inner stride); returns a new [T, I].
    """
    return torch.ops.adapter_manager.silu_mul.default(gate_up)
