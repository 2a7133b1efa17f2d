"""Weight-only int8: the quantizer's contract, the blocked layout's round trip, and ``q8_linear`` (the C++ int8 matmul)
against ``x @ W.T`` in fp64 on the dequantized weight, over shapes that are no multiple of the block, the panel or
the token pass; every other int8 matmul form (bf16 through torch's ``_weight_int8pack_mm``, the dequantize-in-the-
matmul form XLA and CUDA run) against the same reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adapter_manager.kernels import LinearWeight, WeightLayout, base_linear, quantize_weight, unpack_weight
from adapter_manager.kernels.cpu import load, unavailable_reason
from adapter_manager.kernels.cpu.linear_ops import Q8_BLOCK, q8_block, q8_linear, q8_unblock
from adapter_manager.kernels.cpu.weights import dequantize, int8_linear
from adapter_manager.kernels.quantize import int8_matmul, quantize_int8

needs_library = pytest.mark.skipif(not load(), reason=f"no CPU kernels: {unavailable_reason()}")


def _reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.double() @ (q.double() * scales.double()[:, None]).t()


@settings(max_examples=40, deadline=None)
@given(
    out=st.integers(1, 130),
    width=st.integers(1, 300),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_quantize_int8_rounds_each_row_to_its_own_scale(out: int, width: int, seed: int, dtype) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(out, width, generator=gen) * torch.rand(out, 1, generator=gen) * 3).to(dtype)
    w[0] = 0  # an all-zero row
    q, scales = quantize_int8(w, dtype)
    assert q.dtype == torch.int8 and scales.dtype == dtype and q.shape == w.shape and scales.shape == (out,)
    assert int(q.abs().max()) <= 127 and scales[0] == 1 and not q[0].any()
    deq = q.double() * scales.double()[:, None]
    # each value within half a step of its row's scale (the scale rounded to the dtype first; W / s rounds in fp32)
    assert ((deq - w.double()).abs() <= scales.double()[:, None] * (0.5 + 1e-5)).all()
    # the largest value of every nonzero row lands on ±127 or next to it (the scale's rounding apart)
    nonzero = w.double().abs().amax(1) > 0
    assert (q[nonzero].abs().amax(1) >= 126).all()


@needs_library
@pytest.mark.parametrize(
    ("tokens", "width", "out"),
    [
        (1, 64, 48),
        (2, 128, 96),
        (3, 200, 37),
        (8, 1000, 130),
        (9, 129, 49),
        (16, 384, 5),
        (33, 257, 144),
        (300, 96, 50),
    ],
)
def test_q8_linear_equals_the_dequantized_matmul(tokens: int, width: int, out: int) -> None:
    gen = torch.Generator().manual_seed(tokens * 1000 + out)
    w = torch.randn(out, width, generator=gen)
    q, scales = quantize_int8(w, torch.float32)
    x = torch.randn(tokens, width, generator=gen)
    qb = q8_block(q)
    assert qb.shape == (-(-out // Q8_BLOCK), width, Q8_BLOCK) and torch.equal(q8_unblock(qb, out), q)
    y = q8_linear(x, qb, scales, out)
    assert y.shape == (tokens, out) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), _reference(x, q, scales), atol=1e-4, rtol=1e-5)
    strided = torch.randn(tokens, width + 3, generator=gen)[:, 1 : width + 1]  # rows not contiguous
    torch.testing.assert_close(
        int8_linear(strided, LinearWeight(WeightLayout.INT8, qb, out, scales)).double(),
        _reference(strided, q, scales),
        atol=1e-4,
        rtol=1e-5,
    )


@needs_library
def test_q8_linear_refuses_bad_operands() -> None:
    q, scales = quantize_int8(torch.randn(50, 64), torch.float32)
    qb, x = q8_block(q), torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="fp32"):
        q8_linear(x.double(), qb, scales, 50)
    with pytest.raises(RuntimeError, match="blocked"):
        q8_linear(x, q, scales, 50)  # the plain [out, in] layout
    with pytest.raises(RuntimeError, match="does not fit"):
        q8_linear(x, qb, scales, 200)
    with pytest.raises(RuntimeError, match="scales"):
        q8_linear(x, qb, scales[:10], 50)
    assert q8_linear(torch.zeros(0, 64), qb, scales, 50).shape == (0, 50)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_int8_form_computes_the_dequantized_matmul(dtype) -> None:
    """The face (quantize_weight, base_linear, unpack_weight) for each dtype on CPU, and the torch form the traced and
    CUDA devices take (a plain q dequantized inside the matmul)."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(70, 96, generator=gen).to(dtype)
    weight = quantize_weight(w)
    assert weight.layout is WeightLayout.INT8 and weight.scales is not None and weight.scales.dtype == dtype
    plain_q = weight.tensor if weight.tensor.dim() == 2 else q8_unblock(weight.tensor, 70)
    deq = unpack_weight(weight)
    assert deq.dtype == dtype and torch.equal(
        deq, dequantize(LinearWeight(WeightLayout.INT8, plain_q, 70, weight.scales))
    )
    for tokens in (1, 5, 40):
        x = torch.randn(tokens, 96, generator=gen).to(dtype)
        expected = _reference(x, plain_q, weight.scales)
        tol = 1e-4 if dtype == torch.float32 else 2e-2 * expected.abs().max().item()
        for form in (weight, LinearWeight(WeightLayout.INT8, plain_q, 70, weight.scales)):
            y = base_linear(x, form)
            assert y.dtype == dtype and y.shape == (tokens, 70)
            torch.testing.assert_close(y.double(), expected, atol=tol, rtol=1e-4 if dtype == torch.float32 else 2e-2)
        torch.testing.assert_close(  # the traced / CUDA form, run on CPU
            int8_matmul(x, plain_q, weight.scales).double(), expected, atol=tol, rtol=2e-2
        )
