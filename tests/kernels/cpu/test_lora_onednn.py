"""lora_onednn: a linear on a oneDNN-packed weight with its LoRA in one C++ call. It must give exactly what oneDNN's
linear followed by one lora_apply per group gives (the calls it replaces), equal the fp64 loop over the adversarial
mixes, and refuse bad groups before writing anything."""

from __future__ import annotations

import pytest
import torch

from adapter_manager.kernels.cpu import load, lora_apply, lora_onednn, unavailable_reason
from tests.kernels._cases import MIXES, linear_case, reference_apply_parts

pytestmark = pytest.mark.skipif(
    not load() or not torch.backends.mkldnn.is_available(), reason=f"no CPU kernels or oneDNN: {unavailable_reason()}"
)


def _pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w)


def _onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@pytest.mark.parametrize("num_tokens", [1, 8, 40])
@pytest.mark.parametrize("mix", MIXES)
def test_lora_onednn_equals_the_linear_then_lora_apply(mix, num_tokens):
    """Three parts (7, 24, 20 columns) behind 5 base-only columns and before 6 more; mixed ranks, stale garbage past
    every rank. Bit for bit the two calls it replaces; within fp32 rounding the fp64 loop."""
    outs = (7, 24, 20)
    pp, bts, x, slots, meta, gen = linear_case(3, outs, num_tokens, mix, seed=num_tokens)
    w = torch.randn(5 + sum(outs) + 6, pp.in_features, generator=gen)
    runs = meta.runs if meta.runs is not None else torch.zeros(0, 4, dtype=torch.int64)
    y = lora_onednn(x, _pack(w), [pp.a_parts], bts, [5], runs)
    two_calls = _onednn(x, _pack(w))
    lora_apply(two_calls[:, 5 : 5 + sum(outs)], x, pp.a_parts, bts, runs)
    assert torch.equal(y, two_calls)
    base = x.double() @ w.double().t()
    expected = base.clone()
    expected[:, 5 : 5 + sum(outs)] = reference_apply_parts(base[:, 5 : 5 + sum(outs)], x, pp, bts, slots).double()
    torch.testing.assert_close(y.double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_groups_each_on_its_own_columns(dtype):
    """q|k|v with k base-only (PEFT targeting q and v): two groups of one part each, the middle columns untouched."""
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bf16 here")
    pp, (q, v), x, slots, meta, gen = linear_case(2, (130, 70), 11, "zipf", seed=5, in_f=40, rank=16)
    w = torch.randn(130 + 33 + 70, pp.in_features, generator=gen)
    x, w, q, v, a = x.to(dtype), w.to(dtype), q.to(dtype), v.to(dtype), pp.a_parts.to(dtype)
    groups = [a[:, 0:1], a[:, 1:2]]
    y = lora_onednn(x, _pack(w), groups, [q, v], [0, 163], meta.runs)
    expected = _onednn(x, _pack(w))
    base_only = expected[:, 130:163].clone()
    lora_apply(expected[:, :130], x, groups[0], [q], meta.runs)
    lora_apply(expected[:, 163:], x, groups[1], [v], meta.runs)
    assert torch.equal(y, expected)
    assert torch.equal(y[:, 130:163], base_only)


def test_lora_onednn_refuses_bad_groups():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, generator=gen), _pack(torch.randn(10, 8, generator=gen))
    a, bts = torch.randn(9, 2, 8, generator=gen), [torch.randn(9, 3, generator=gen), torch.randn(9, 3, generator=gen)]
    runs = torch.tensor([[0, 4, 6, 2]])
    torch.testing.assert_close(lora_onednn(x, w, [], [], [], runs), _onednn(x, w))
    with pytest.raises(RuntimeError, match="reads rows"):
        lora_onednn(x, w, [a], bts, [0], torch.tensor([[0, 4, 8, 2]]))
    with pytest.raises(RuntimeError, match="covers tokens"):
        lora_onednn(x, w, [a], bts, [0], torch.tensor([[2, 3, 0, 2]]))
    with pytest.raises(RuntimeError, match="past the 1 Bt"):
        lora_onednn(x, w, [a], bts[:1], [0], runs)
    with pytest.raises(RuntimeError, match="3 Bt for 2 parts"):
        lora_onednn(x, w, [a], [*bts, bts[0]], [0], runs)
    with pytest.raises(RuntimeError, match=r"columns \[5, 11\) exceed y's 10"):
        lora_onednn(x, w, [a], bts, [5], runs)
    with pytest.raises(RuntimeError, match="one column offset per group"):
        lora_onednn(x, w, [a], bts, [], runs)
    with pytest.raises(RuntimeError, match="same rows"):
        lora_onednn(x, w, [a[:, :1], a[:7, 1:]], bts, [0, 3], runs)
