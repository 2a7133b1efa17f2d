"""The torch eager backend and the laned (xla-form) backend on CPU against the fp32 loop reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import KernelConfig, LoRAForm, LoRAKernelMeta, expand, select_backend, shrink
from kernels.dispatch_table import DispatchEntry, TorchDispatchTable
from kernels.torch_eager import TorchEagerBackend
from kernels.xla_laned import XlaLanedBackend
from tests.kernels._cases import MIXES, TOLERANCE, collapse_laned, make_stacks, reference_forward, slot_mix

ALWAYS_GROUPED = TorchDispatchTable((DispatchEntry(slots=1, rank=1, laned_max_tokens=0),))
ALWAYS_LANED = TorchDispatchTable((DispatchEntry(slots=1, rank=1, laned_max_tokens=1 << 30),))
BACKENDS = {
    "torch_grouped": lambda: TorchEagerBackend(ALWAYS_GROUPED, max_segment_runs=0),
    "torch_laned": lambda: TorchEagerBackend(ALWAYS_LANED, max_segment_runs=0),
    "torch_segments": lambda: TorchEagerBackend(ALWAYS_GROUPED, max_segment_runs=1 << 30),
    "torch_table": lambda: select_backend("cpu"),
    # forced through the config: the same form for every step with an adapter, single-slot steps included
    "forced_segments": lambda: select_backend("cpu", KernelConfig(torch_form=LoRAForm.SEGMENTS)),
    "forced_grouped": lambda: select_backend("cpu", KernelConfig(torch_form=LoRAForm.GROUPED)),
    "forced_laned": lambda: select_backend("cpu", KernelConfig(torch_form=LoRAForm.LANED)),
    "xla_laned_on_cpu": XlaLanedBackend,
}


def run_backend(backend, x, y, a, bt, slots):
    meta = LoRAKernelMeta.make(backend, a.shape[0], a.shape[1], 128, "cpu")
    meta.prepare(slots)
    h = shrink(x, a, meta)
    y_new = expand(y.clone(), h, bt, meta)
    if backend.laned_output:
        h = collapse_laned(h, a.shape[0], a.shape[1])
    return h, y_new


def check(backend, num_tokens, num_slots, rank, mix, dtype, seed=0, used_rank=None, in_f=48, out_f=80):
    gen = torch.Generator().manual_seed(seed)
    a, bt = make_stacks(num_slots, rank, in_f, out_f, gen, used_rank)
    x = torch.randn(num_tokens, in_f, generator=gen)
    y = torch.randn(num_tokens, out_f, generator=gen)
    slots = slot_mix(mix, num_tokens, num_slots, gen)
    x, y, a, bt = (t.to(dtype) for t in (x, y, a, bt))
    h_ref, y_ref = reference_forward(x, y, a, bt, slots)
    h, y_new = run_backend(backend, x, y, a, bt, slots)
    assert h.dtype == dtype and y_new.dtype == dtype
    torch.testing.assert_close(h.float(), h_ref, **TOLERANCE[dtype])
    torch.testing.assert_close(y_new.float(), y_ref, **TOLERANCE[dtype])
    none = slots < 0
    assert torch.equal(h[none], torch.zeros_like(h[none])), "slot -1 must give an exactly zero h"
    assert torch.equal(y_new[none], y[none]), "slot -1 rows of y must be unchanged bit for bit"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("name", list(BACKENDS))
def test_mixes_against_reference(name, mix, dtype):
    check(BACKENDS[name](), num_tokens=37, num_slots=6, rank=8, mix=mix, dtype=dtype)


@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.parametrize(
    ("num_tokens", "num_slots", "rank", "used_rank"),
    [(1, 4, 8, None), (1, 1, 16, None), (3, 8, 16, None), (61, 3, 4, None), (50, 8, 16, 5), (64, 16, 8, None)],
)
def test_shapes(name, num_tokens, num_slots, rank, used_rank):
    for mix in ("uniform", "distinct", "single_with_none"):
        check(BACKENDS[name](), num_tokens, num_slots, rank, mix, torch.float32, used_rank=used_rank)


def test_expand_ignores_h_rows_of_unassigned_tokens():
    """expand must not rely on shrink having zeroed h: garbage h rows of slot -1 tokens add nothing."""
    gen = torch.Generator().manual_seed(3)
    a, bt = make_stacks(4, 8, 16, 24, gen)
    for mix in ("single_with_none", "uniform"):
        slots = slot_mix(mix, 20, 4, gen)
        for backend in (TorchEagerBackend(ALWAYS_GROUPED), TorchEagerBackend(ALWAYS_LANED)):
            meta = LoRAKernelMeta.make(backend, 4, 8, 32, "cpu")
            meta.prepare(slots)
            h = torch.randn(20, 8, generator=gen)
            y = torch.randn(20, 24, generator=gen)
            y_new = expand(y.clone(), h, bt, meta)
            assert torch.equal(y_new[slots < 0], y[slots < 0])


def test_no_adapter_does_no_work():
    backend = select_backend("cpu")
    meta = LoRAKernelMeta.make(backend, 4, 8, 16, "cpu")
    meta.prepare(torch.full((16,), -1, dtype=torch.int32))
    assert meta.no_adapter and meta.grouping is None and meta.lane_onehot is None
    y = torch.randn(16, 24)
    assert expand(y, torch.zeros(16, 8), torch.randn(4, 8, 24), meta) is y


@settings(max_examples=30, deadline=None)
@given(
    num_tokens=st.integers(1, 70),
    num_slots=st.integers(1, 9),
    rank=st.sampled_from([1, 4, 8, 16]),
    mix=st.sampled_from(MIXES),
    name=st.sampled_from(list(BACKENDS)),
    seed=st.integers(0, 2**16),
)
def test_hypothesis(num_tokens, num_slots, rank, mix, name, seed):
    check(BACKENDS[name](), num_tokens, num_slots, rank, mix, torch.float32, seed=seed, in_f=24, out_f=40)


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("name", list(BACKENDS))
def test_expand_without_accumulate_writes_and_never_reads_y(name, mix):
    """accumulate=False: y[t] = h[t] @ Bt[slot[t]] (0 for slot -1) whatever y held — NaN here, so a read shows."""
    gen = torch.Generator().manual_seed(5)
    backend = BACKENDS[name]()
    a, bt = make_stacks(6, 8, 48, 80, gen)
    x = torch.randn(37, 48, generator=gen)
    slots = slot_mix(mix, 37, 6, gen)
    _, y_ref = reference_forward(x, torch.zeros(37, 80), a, bt, slots)
    meta = LoRAKernelMeta.make(backend, 6, 8, 64, "cpu")
    meta.prepare(slots)
    y = torch.full((37, 80), float("nan"))
    y_new = expand(y, shrink(x, a, meta), bt, meta, accumulate=False)
    torch.testing.assert_close(y_new, y_ref, **TOLERANCE[torch.float32])
    assert torch.equal(y_new[slots < 0], torch.zeros_like(y_new[slots < 0]))
