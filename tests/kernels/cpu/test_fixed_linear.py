"""fixed_linear: the deterministic mode's linear. It must equal ``x @ W.T`` plus the fp32 loop reference of every
group's parts over the adversarial mixes, and every token's row must be bitwise the same whatever else shares the
call: alone, in any subset of any order, in runs of any length, in fp32, bf16 and fp16."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adapter_manager.kernels.cpu import fixed_linear, load, unavailable_reason
from tests.kernels._cases import MIXES, linear_case, reference_apply_parts

pytestmark = pytest.mark.skipif(not load(), reason=f"no CPU kernels: {unavailable_reason()}")

OUTS = (7, 24, 20)  # no tile or vector multiple
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("num_tokens", [1, 3, 8, 9, 40])
@pytest.mark.parametrize("mix", MIXES)
def test_fixed_linear_equals_the_base_matmul_plus_the_loop(mix, num_tokens):
    """Three parts behind 5 base-only columns and before 6 more; mixed ranks, stale garbage past every rank; an odd
    number of output rows (the last pair of W rows is one row); in = 48 (a 16-float tail in every dot product)."""
    pp, bts, x, slots, meta, gen = linear_case(3, OUTS, num_tokens, mix, seed=num_tokens)
    n = 5 + sum(OUTS) + 6
    w = torch.randn(n, pp.in_features, generator=gen)
    y = fixed_linear(x, w, [pp.a_parts], bts, [5], meta.runs)
    base = x.double() @ w.double().t()
    expected = base.clone()
    expected[:, 5 : 5 + sum(OUTS)] = reference_apply_parts(base[:, 5 : 5 + sum(OUTS)], x, pp, bts, slots).double()
    torch.testing.assert_close(y.double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precisions_round_the_fp32_sum_once(dtype):
    """bf16 / fp16 operands: the fp32 sum of their products, rounded once to the dtype."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(21, 70, generator=gen).to(dtype), torch.randn(45, 70, generator=gen).to(dtype)
    y = fixed_linear(x, w, [], [], [], None)
    assert y.dtype == dtype
    expected = (x.double() @ w.double().t()).to(dtype)
    torch.testing.assert_close(y.float(), expected.float(), atol=0, rtol=2**-7 if dtype is torch.bfloat16 else 1e-3)


def _runs(slots: torch.Tensor, pool) -> torch.Tensor:
    """The runs table of ``slots`` in their order (each maximal run of one slot; slot -1 in none)."""
    runs, start = [], 0
    values = slots.tolist()
    for t in range(1, len(values) + 1):
        if t == len(values) or values[t] != values[start]:
            if values[start] >= 0:
                slot = values[start]
                runs.append([start, t - start, slot * pool.granule, pool.slot_rows[slot]])
            start = t
    return torch.tensor(runs, dtype=torch.int64).reshape(-1, 4)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(DTYPES),
    mix=st.sampled_from(MIXES),
    num_tokens=st.integers(2, 40),
    data=st.data(),
)
def test_a_tokens_row_does_not_depend_on_the_rest_of_the_call(seed, dtype, mix, num_tokens, data):
    """The whole call, then sub-batches (any subset, any order, so runs of every length), then each token alone: the
    token's row is the same bits every time."""
    pp, bts, x, slots, _, gen = linear_case(3, OUTS, num_tokens, mix, seed=seed, in_f=40)
    w = torch.randn(5 + sum(OUTS) + 6, pp.in_features, generator=gen).to(dtype)
    a, bts, x = pp.a_parts.to(dtype), [bt.to(dtype) for bt in bts], x.to(dtype)

    def rows(index: list[int]) -> torch.Tensor:
        picked = torch.tensor(index, dtype=torch.int64)
        return fixed_linear(x[picked].contiguous(), w, [a], bts, [5], _runs(slots[picked], pp.pool))

    everyone = rows(list(range(num_tokens)))
    order = data.draw(st.permutations(range(num_tokens)))
    subset = order[: data.draw(st.integers(1, num_tokens))]
    grouped = sorted(subset, key=lambda t: int(slots[t]))  # as the engine orders a step: long runs
    for index in (subset, grouped):
        assert torch.equal(rows(index), everyone[index])
    for t in data.draw(st.lists(st.integers(0, num_tokens - 1), min_size=1, max_size=3)):
        assert torch.equal(rows([t])[0], everyone[t])


def test_fixed_linear_refuses_bad_operands():
    x, w = torch.randn(4, 8), torch.randn(10, 8)
    a, bts = torch.randn(9, 2, 8), [torch.randn(9, 3), torch.randn(9, 3)]
    with pytest.raises(RuntimeError, match="reads rows"):
        fixed_linear(x, w, [a], bts, [0], torch.tensor([[0, 4, 8, 2]]))
    with pytest.raises(RuntimeError, match="past the 1 Bt"):
        fixed_linear(x, w, [a], bts[:1], [0], torch.tensor([[0, 4, 6, 2]]))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        fixed_linear(x.double(), w.double(), [], [], [], None)
    with pytest.raises(RuntimeError, match="contiguous"):
        fixed_linear(x, torch.randn(8, 10).t(), [], [], [], None)
    with pytest.raises(RuntimeError, match="x's dtype"):
        fixed_linear(x, w.to(torch.bfloat16), [], [], [], None)
    assert fixed_linear(x[:0], w, [], [], [], None).shape == (0, 10)
