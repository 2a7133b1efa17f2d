"""The CPU vector epilogue (csrc/vector_epilogue.cpp: DoRA's scale and LoRA's bias on a linear's output) equals its
fp32 loop reference (kernels.reference.vector_epilogue) and the torch forms, over adversarial index mixes, and a
token's result is the same bits in any batch."""

from __future__ import annotations

import pytest
import torch

from adapter_manager.kernels import reference
from adapter_manager.kernels.cpu import load, unavailable_reason
from adapter_manager.kernels.cpu.linear_ops import vector_epilogue

pytestmark = pytest.mark.skipif(not load(), reason=f"no CPU kernels: {unavailable_reason()}")

SLOTS = 6  # vector rows 0..5, row 6 the zero row
MIXES = {  # each token's (bias row, scale row); 6 = the zero row (no vector of that kind)
    "all-distinct": ([0, 1, 2, 3, 4, 5], [6, 6, 6, 6, 6, 6]),
    "all-one": ([2] * 7, [6] * 7),
    "scale-only": ([6] * 5, [0, 3, 3, 5, 1]),
    "mixed-kinds": ([0, 6, 6, 4, 6, 6, 6, 0], [6, 1, 1, 6, 6, 5, 6, 6]),
    "none": ([6] * 4, [6] * 4),
    "one-token": ([6], [3]),
}
TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def operands(tokens: int, dtype: torch.dtype, seed: int = 0):
    """y [T, 80] and a vector table whose group is columns 17..57 of a wider row (a strided view, like the pool's)."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(tokens, 80, generator=gen).to(dtype)
    table = torch.randn(SLOTS + 1, 100, generator=gen).mul(0.3).to(dtype)
    table[SLOTS].zero_()
    return y, table[:, 17:57]  # [S + 1, 40], row stride 100


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("kinds", ["bias", "scale", "both"])
def test_equals_the_loop_reference(mix, kinds, dtype):
    bias_rows, scale_rows = MIXES[mix]
    y, vectors = operands(len(bias_rows), dtype)
    bias = torch.tensor(bias_rows) if kinds in ("bias", "both") else None
    scale = torch.tensor(scale_rows) if kinds in ("scale", "both") else None
    expected, ours = y.clone(), y.clone()
    reference.vector_epilogue(expected, 23, vectors, bias, scale)
    vector_epilogue(ours, 23, vectors, bias, scale)
    torch.testing.assert_close(ours.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(ours[:, :23], y[:, :23]) and torch.equal(ours[:, 63:], y[:, 63:])  # outside its columns
    if kinds == "both" and mix == "none":
        assert torch.equal(ours, y)  # the zero row is the identity of both kinds


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_token_is_the_same_bits_in_any_batch(dtype):
    bias_rows, scale_rows = MIXES["mixed-kinds"]
    y, vectors = operands(600, dtype, seed=3)  # past the parallel threshold: the threads split the tokens
    bias = torch.tensor((bias_rows * 75)[:600])
    scale = torch.tensor((scale_rows * 75)[:600])
    whole = y.clone()
    vector_epilogue(whole, 0, vectors, bias, scale)
    for t in (0, 5, 333, 599):
        alone = y[t : t + 1].clone()
        vector_epilogue(alone, 0, vectors, bias[t : t + 1].clone(), scale[t : t + 1].clone())
        assert torch.equal(alone[0], whole[t]), t


def test_bad_operands_are_refused_by_name():
    y, vectors = operands(3, torch.float32)
    with pytest.raises(RuntimeError, match=r"bias\[1\] = 9 is outside 0..6"):
        vector_epilogue(y, 0, vectors, torch.tensor([0, 9, 1]), None)
    with pytest.raises(RuntimeError, match="columns \\[50, 90\\) are outside y's 80"):
        vector_epilogue(y, 50, vectors, torch.tensor([0, 1, 2]), None)
    with pytest.raises(RuntimeError, match="vectors must be a CPU"):
        vector_epilogue(y, 0, vectors.bfloat16(), torch.tensor([0, 1, 2]), None)
    with pytest.raises(RuntimeError, match="scale must be a contiguous CPU int64 \\[3\\]"):
        vector_epilogue(y, 0, vectors, None, torch.tensor([0, 1], dtype=torch.int64))
