"""lora_linear: a decode linear's base matmul with its LoRA inside the same C++ call (fp32, at most 16 tokens). It
must equal ``x @ W.T`` plus the fp32 loop reference of every group's parts over the adversarial mixes, and refuse
bad operands before writing anything."""

from __future__ import annotations

import pytest
import torch

from adapter_manager.kernels.cpu import LINEAR_MAX_TOKENS, load, lora_linear, unavailable_reason
from tests.kernels._cases import MIXES, bench_qkv_case, linear_case, reference_apply_parts

pytestmark = pytest.mark.skipif(not load(), reason=f"no CPU kernels: {unavailable_reason()}")


@pytest.mark.parametrize("num_tokens", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("mix", MIXES)
def test_lora_linear_equals_the_base_matmul_plus_the_loop(mix, num_tokens):
    """Three parts (7, 24, 20 columns: no tile or vector multiple) behind 5 base-only columns and before 6 more;
    mixed ranks 1..8, stale garbage past every rank; an odd number of output rows."""
    outs = (7, 24, 20)
    pp, bts, x, slots, meta, gen = linear_case(3, outs, num_tokens, mix, seed=num_tokens)
    n = 5 + sum(outs) + 6
    w = torch.randn(n, pp.in_features, generator=gen)
    y = lora_linear(x, w, [pp.a_parts], bts, [5], meta.runs if meta.fused else None)
    base = x.double() @ w.double().t()
    expected = base.clone()
    expected[:, 5 : 5 + sum(outs)] = reference_apply_parts(base[:, 5 : 5 + sum(outs)], x, pp, bts, slots).double()
    torch.testing.assert_close(y.double(), expected, atol=1e-4, rtol=1e-4)
    none = slots < 0
    torch.testing.assert_close(y[none].double(), base[none], atol=1e-4, rtol=1e-4)  # slot -1: exactly the base


def _loop(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, slots: torch.Tensor, pool) -> torch.Tensor:
    """One part's LoRA term, token by token in fp64: x[t] @ A[rows of slot t].T @ Bt[rows]; zero for slot -1."""
    out = torch.zeros(x.shape[0], bt.shape[1], dtype=torch.float64)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            rows = slice(slot * pool.granule, slot * pool.granule + pool.slot_rows[slot])
            out[t] = (x[t].double() @ a[rows].double().t()) @ bt[rows].double()
    return out


@pytest.mark.parametrize("mix", ["distinct", "zipf", "single", "empty_slots"])
def test_lora_linear_with_two_groups_wide_parts_and_an_in_of_no_vector_multiple(mix):
    """q|k|v with k base-only (PEFT targeting q and v): two groups of one part; parts wider than a 64-column tile
    with ragged ends; in = 40 (the 16-float tail of every dot product); rank 16 in 8-row shrink blocks."""
    pp, (q, v), x, slots, meta, gen = linear_case(2, (130, 70), 11, mix, seed=5, in_f=40, rank=16)
    w = torch.randn(130 + 33 + 70, pp.in_features, generator=gen)
    y = lora_linear(x, w, [pp.a_parts[:, 0:1], pp.a_parts[:, 1:2]], [q, v], [0, 163], meta.runs)
    expected = x.double() @ w.double().t()
    expected[:, :130] += _loop(x, pp.part(0), q, slots, pp.pool)
    expected[:, 163:] += _loop(x, pp.part(1), v, slots, pp.pool)
    torch.testing.assert_close(y.double(), expected, atol=1e-4, rtol=1e-4)


def test_the_bench_models_shapes_with_one_and_eight_adapters():
    """The decode shapes the kernel was tuned on (in 1024, q|k|v 1024 + 256 + 256, rank 16), 8 tokens."""
    for runs in ([[0, 8, 0, 16]], [[t, 1, 16 * t, 16] for t in range(8)]):
        a, bts, w, x, expected = bench_qkv_case(runs)
        y = lora_linear(x, w, [a], bts, [0], torch.tensor(runs))
        torch.testing.assert_close(y.double(), expected, atol=2e-4, rtol=1e-4)


def test_lora_linear_refuses_bad_operands():
    x, w = torch.randn(4, 8), torch.randn(10, 8)
    a, bts = torch.randn(9, 2, 8), [torch.randn(9, 3), torch.randn(9, 3)]
    runs = torch.tensor([[0, 4, 6, 2]])
    torch.testing.assert_close(lora_linear(x, w, [], [], [], None), x @ w.t())
    with pytest.raises(RuntimeError, match="reads rows"):
        lora_linear(x, w, [a], bts, [0], torch.tensor([[0, 4, 8, 2]]))
    with pytest.raises(RuntimeError, match="covers tokens"):
        lora_linear(x, w, [a], bts, [0], torch.tensor([[2, 3, 0, 2]]))
    with pytest.raises(RuntimeError, match="one Bt per part"):
        lora_linear(x, w, [a], bts[:1], [0], runs)
    with pytest.raises(RuntimeError, match="outside y"):
        lora_linear(x, w, [a], bts, [5], runs)
    with pytest.raises(RuntimeError, match="must not overlap"):
        lora_linear(x, w, [a[:, :1], a[:, 1:]], bts, [3, 1], runs)
    with pytest.raises(RuntimeError, match="fp32 only"):
        lora_linear(x.double(), w.double(), [], [], [], None)
    with pytest.raises(RuntimeError, match="T <= 16"):
        lora_linear(torch.randn(LINEAR_MAX_TOKENS + 1, 8), w, [], [], [], None)
    with pytest.raises(RuntimeError, match="contiguous"):
        lora_linear(x, torch.randn(8, 10).t(), [], [], [], None)
