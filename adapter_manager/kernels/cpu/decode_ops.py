"""The decode step's glue on CPU: RoPE + KV write + GQA attention, residual add + RMSNorm, and SiLU·mul (GELU·mul for
GeGLU), one C++ call each (``csrc/decode_attention.cpp``, ``add_rms_norm.cpp``, ``gated_mul.cpp``; built with the
rest of the library by :mod:`kernels.cpu.library`).

Between its weight matmuls an eager decode layer is ~35 small torch ops (views, the rotation, two ``index_put_``,
SDPA, norms, the residual adds), each a Python call, a dispatch and an allocation, and SDPA over 8 rows of 144 keys
took 3.4× the read of those keys. These ops do the same math in three calls per layer, and attention reads each
row's keys and values once. Each has a torch form with the same signature (:mod:`kernels.layer_reference`) that
tests compare it with; the model reaches them through :mod:`kernels.layer_ops` where :func:`available`.
"""

from __future__ import annotations

import torch

from adapter_manager.kernels.cpu.library import load

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available(x: torch.Tensor) -> bool:
    """Whether the C++ ops serve tensors like ``x``: a CPU tensor of a supported dtype, the library built."""
    return x.device.type == "cpu" and x.dtype in DTYPES and load()


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
    """RoPE, paged KV cache write and causal GQA attention of a step's tokens, in one call.

    Semantics: :meth:`kernels.protocol.DecodeOps.decode_attention`. Every key is read through the token's block
    table row, block by block (a block's positions are contiguous); every block a token reads is checked first.
    """
    return torch.ops.adapter_manager.decode_attention.default(
        qkv, rope_table, k_cache, v_cache, block_tables, rows, positions, num_heads, num_kv_heads
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


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU's activation over the fused gate|up output (Gemma).

    Semantics: ``gate, up = gate_up.chunk(2, -1); out = gelu(gate, approximate="tanh") · up`` (gelu rounded to the
    dtype first).

    Shape: gate_up [T, 2·I] (unit inner stride); returns a new [T, I].
    """
    return torch.ops.adapter_manager.gelu_tanh_mul.default(gate_up)
