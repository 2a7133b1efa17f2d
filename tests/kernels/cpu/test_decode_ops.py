"""The CPU decode ops (kernels/cpu/csrc: decode_attention, add_rms_norm, silu_mul, gelu_tanh_mul) equal their torch
forms (kernels.layer_reference): RoPE + KV write + GQA attention over adversarial rows and positions, the fused
residual add + RMSNorm, and SwiGLU's and GeGLU's activations."""

from __future__ import annotations

import pytest
import torch

from adapter_manager.kernels import layer_reference
from adapter_manager.kernels.cpu import decode_ops, load, unavailable_reason

pytestmark = pytest.mark.skipif(not load(), reason=f"no CPU kernels: {unavailable_reason()}")

TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2}}

CASES = {  # (rows, positions) of the step's tokens; each row's table names 33 of the 200 blocks
    "decode-ragged": ([3, 1, 0, 5, 2], [0, 7, 143, 199, 1]),
    "one-token-at-0": ([4], [0]),
    "rows-out-of-order": ([5, 4, 3, 2, 1, 0], [9, 8, 7, 6, 5, 4]),
    "a-chunk-of-one-row": ([2, 2, 2, 0], [5, 6, 7, 3]),  # each token sees the chunk's earlier keys
    "block-boundaries": ([0, 1, 2, 3], [15, 16, 31, 32]),
    "long-context": ([1, 0], [511, 300]),
}
BLOCK_SIZES = (16, 3, 1)


def _tables(block_size: int, rows: int = 6, seed: int = 0) -> tuple[torch.Tensor, int]:
    """Each row's blocks shuffled over the pool (out of order, never adjacent in sequence); rows 4 and 5 share rows
    0's and 1's first blocks (a cached prefix read by two rows) where no token of theirs writes them."""
    width = -(-520 // block_size)
    gen = torch.Generator().manual_seed(seed)
    blocks = rows * width + 1
    tables = torch.randperm(blocks, generator=gen)[: rows * width].view(rows, width).clone()
    tables[4, :1] = tables[0, :1]
    return tables, blocks


def _operands(tokens: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, blocks: int, block_size: int):
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(tokens, (heads + 2 * kv_heads) * dim + 5, generator=gen).to(dtype)
    qkv = wide[:, 3 : 3 + (heads + 2 * kv_heads) * dim]  # a view with a row stride wider than its columns
    table = torch.randn(520, 2, dim // 2, generator=gen)
    k = torch.randn(blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    return qkv, table, k, v


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(16, 4, 64), (8, 2, 128), (4, 4, 128), (6, 2, 8), (8, 1, 64), (10, 2, 32)]
)
@pytest.mark.parametrize("case", list(CASES))
def test_decode_attention_equals_the_reference(case, heads, kv_heads, dim, dtype, block_size):
    rows, positions = (torch.tensor(v) for v in CASES[case])
    tables, blocks = _tables(block_size)
    qkv, table, k, v = _operands(len(rows), heads, kv_heads, dim, dtype, blocks, block_size)
    k_ref, v_ref = k.clone(), v.clone()
    out = decode_ops.decode_attention(qkv, table, k, v, tables, rows, positions, heads, kv_heads)
    ref = layer_reference.decode_attention(qkv, table, k_ref, v_ref, tables, rows, positions, heads, kv_heads)
    assert out.shape == (len(rows), heads * dim) and out.dtype == dtype
    torch.testing.assert_close(out, ref, **TOL[dtype])
    torch.testing.assert_close(k, k_ref, **TOL[dtype])  # the rotated keys, written where the reference writes them
    assert torch.equal(v, v_ref)  # values are copied as they are, nothing else touched


def test_a_shared_prefix_block_is_read_by_both_rows():
    """Two rows whose tables start with the same block attend over the same keys there: equal queries and equal
    later keys give equal outputs, whatever the rest of the pool holds."""
    heads, kv_heads, dim, block_size = 4, 2, 64, 4
    qkv, table, k, v = _operands(2, heads, kv_heads, dim, torch.float32, 10, block_size)
    qkv = qkv[:1].expand(2, -1).contiguous()  # both tokens the same
    tables = torch.tensor([[7, 2, 9], [7, 2, 5]])  # both rows share blocks 7 and 2, then differ
    out = decode_ops.decode_attention(qkv, table, k, v, tables, torch.tensor([0, 1]), torch.tensor([6, 6]), 4, 2)
    assert torch.equal(out[0], out[1])  # position 6 is in block 2 for both: the same keys 0..6, the same write


def test_decode_attention_refuses_bad_operands_and_writes_nothing():
    qkv, table, k, v = _operands(2, 4, 2, 8, torch.float32, 12, 4)
    tables = torch.arange(12).view(2, 6)
    k0, v0 = k.clone(), v.clone()
    rows, positions = torch.tensor([0, 1]), torch.tensor([3, 4])
    with pytest.raises(RuntimeError, match="names table row 6"):
        decode_ops.decode_attention(qkv, table, k, v, tables, torch.tensor([0, 6]), positions, 4, 2)
    with pytest.raises(RuntimeError, match="beyond its table"):
        decode_ops.decode_attention(qkv, table, k, v, tables, rows, torch.tensor([3, 24]), 4, 2)
    bad = tables.clone()
    bad[1, 1] = 12
    with pytest.raises(RuntimeError, match="reads block 12"):
        decode_ops.decode_attention(qkv, table, k, v, bad, rows, positions, 4, 2)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        decode_ops.decode_attention(qkv, table, k, v, tables, rows, positions, 3, 2)
    with pytest.raises(RuntimeError, match="qkv must be"):
        decode_ops.decode_attention(qkv[:, :-8], table, k, v, tables, rows, positions, 4, 2)
    with pytest.raises(RuntimeError, match="block_tables must be"):
        decode_ops.decode_attention(qkv, table, k, v, tables.int(), rows, positions, 4, 2)
    assert torch.equal(k, k0) and torch.equal(v, v0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_delta", [True, False], ids=["add", "norm-only"])
@pytest.mark.parametrize("tokens", [1, 8, 300])
def test_add_rms_norm_equals_the_reference(tokens, with_delta, dtype):
    gen = torch.Generator().manual_seed(tokens)
    h = (torch.randn(tokens, 1030, generator=gen) * 3).to(dtype)[:, 6:]  # row stride wider than the row
    delta = torch.randn(tokens, 1024, generator=gen).to(dtype) if with_delta else None
    weight = torch.randn(1024, generator=gen).to(dtype)
    h_ref = h.clone()
    out = decode_ops.add_rms_norm(h, delta, weight, 1e-5)
    ref = layer_reference.add_rms_norm(h_ref, delta, weight, 1e-5)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    assert torch.equal(h, h_ref)  # h += delta in place, exactly as the reference's add


@pytest.mark.parametrize("op", ["silu_mul", "gelu_tanh_mul"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 7, 200])
def test_gated_activations_equal_the_reference(tokens, dtype, op):
    gen = torch.Generator().manual_seed(tokens)
    gate_up = (torch.randn(tokens, 2 * 700 + 4, generator=gen) * 6).to(dtype)[:, 4:]
    gate_up[0, :4] = torch.tensor([-120.0, 120.0, 0.0, -0.0])  # the activations' saturated ends and zero
    out = getattr(decode_ops, op)(gate_up)
    torch.testing.assert_close(out, getattr(layer_reference, op)(gate_up), **TOL[dtype])
