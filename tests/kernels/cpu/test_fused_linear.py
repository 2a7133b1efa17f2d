"""The cpu backend's fused_linear: which one-call form a linear takes is the step's backend's choice (the model only
says how its weight is held). The cpu backend must run our blocked layout on any step with an adapter, oneDNN's
layout and a plain fp32 weight of few tokens on its FUSED steps, each equal to the base matmul plus the fp32 loop
reference; every other (backend, layout, step) answers None, so the caller composes the base matmul and
apply_parts."""

from __future__ import annotations

import pytest
import torch

from adapter_manager.kernels import (
    KernelConfig,
    LinearWeight,
    LoRAForm,
    LoRAGroups,
    WeightLayout,
    select_backend,
)
from adapter_manager.kernels.config import BackendKind
from adapter_manager.kernels.cpu import LINEAR_MAX_TOKENS, block_weight, load, unavailable_reason
from tests.kernels._cases import MIXES, linear_case, reference_apply_parts

pytestmark = pytest.mark.skipif(not load(), reason=f"no CPU kernels: {unavailable_reason()}")

OUTS = (40, 24, 33)


def _weight(layout: WeightLayout, w: torch.Tensor) -> LinearWeight:
    if layout is WeightLayout.BLOCKED:
        return LinearWeight(layout, block_weight(w), w.shape[0])
    if layout is WeightLayout.ONEDNN:
        return LinearWeight(layout, torch.ops.mkldnn._reorder_linear_weight(w), w.shape[0])
    return LinearWeight(layout, w, w.shape[0])


def _case(num_tokens: int, mix: str, backend):  # noqa: ANN001
    pp, bts, x, slots, _, gen = linear_case(len(OUTS), OUTS, num_tokens, mix, seed=num_tokens, grouped=True)
    meta = pp.pool.meta(backend, max(128, num_tokens))  # the same step, prepared for the backend under test
    meta.prepare(slots, pp.pool.slot_rows)
    w = torch.randn(sum(OUTS), pp.in_features, generator=gen)
    groups = LoRAGroups((pp.a_parts,), tuple(bts), (0,))
    expected = reference_apply_parts((x.double() @ w.double().t()).float(), x, pp, bts, slots)
    return x, w, groups, meta, expected


# (num_tokens, backend config, layout) -> takes it (True) or answers None
CPU = KernelConfig()
PREFILL = KernelConfig(fused_max_tokens=4)  # more than 4 tokens: the torch forms' SEGMENTS step, runs table still set


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize(
    ("num_tokens", "config", "layout", "takes"),
    [
        (8, CPU, WeightLayout.BLOCKED, True),
        (8, CPU, WeightLayout.ONEDNN, True),
        (8, CPU, WeightLayout.PLAIN, True),
        (LINEAR_MAX_TOKENS + 1, CPU, WeightLayout.PLAIN, False),  # lora_linear is decode's kernel
        (40, CPU, WeightLayout.BLOCKED, True),
        (40, PREFILL, WeightLayout.BLOCKED, True),  # a prefill step: lora_blocked, long runs inside its GEMM
        (40, PREFILL, WeightLayout.ONEDNN, False),
        (40, PREFILL, WeightLayout.PLAIN, False),
        (8, KernelConfig(backend=BackendKind.TORCH), WeightLayout.BLOCKED, False),
        (8, KernelConfig(backend=BackendKind.REFERENCE), WeightLayout.BLOCKED, False),
    ],
)
def test_the_backend_chooses_the_one_call_form(mix, num_tokens, config, layout, takes):
    backend = select_backend("cpu", config)
    x, w, groups, meta, expected = _case(num_tokens, mix, backend)
    y = meta.backend.fused_linear(x, _weight(layout, w), groups, meta)
    if meta.no_adapter or not takes:  # a step without an adapter never reaches the seam: the base matmul alone
        assert y is None, (layout, meta.form)
        return
    assert y is not None, (layout, meta.form)
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)


def test_a_strided_input_is_left_to_the_composed_path():
    """The kernels read x rows of unit inner stride: a column view is not theirs (the caller composes)."""
    backend = select_backend("cpu")
    x, w, groups, meta, _ = _case(8, "distinct", backend)
    wide = torch.zeros(x.shape[1], x.shape[0]).t()  # [T, in] with strides (1, T)
    wide.copy_(x)
    assert meta.form is LoRAForm.FUSED
    assert meta.backend.fused_linear(wide, _weight(WeightLayout.BLOCKED, w), groups, meta) is None
    assert meta.backend.fused_linear(x, _weight(WeightLayout.BLOCKED, w), groups, meta) is not None
