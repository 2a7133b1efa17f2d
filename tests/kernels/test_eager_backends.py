"""The torch eager backend and the laned (xla-form) backend on CPU, on row pools, against the fp32 loop reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adapter_manager.kernels import expand, select_backend, shrink
from adapter_manager.kernels.reference import ReferenceBackend
from tests.kernels._cases import (
    BACKENDS,
    MIXES,
    TOLERANCE,
    RowPool,
    collapse_laned,
    make_rows,
    reference_forward,
)


def run_backend(backend, pool: RowPool, x, y, slots, accumulate=True):
    meta = pool.meta(backend, 128)
    meta.prepare(slots, pool.slot_rows)
    h = shrink(x, pool.a_rows, meta)
    if backend.laned_output:
        assert h.shape == (x.shape[0], meta.active_width * pool.rank)
    y_new = expand(y.clone(), h, pool.bt_rows, meta, accumulate)
    if backend.laned_output:
        h = collapse_laned(h, pool.rank)
    return h, y_new


def check(backend, pool: RowPool, num_tokens, mix, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pool = pool.to(dtype)
    x = torch.randn(num_tokens, pool.a_rows.shape[1], generator=gen).to(dtype)
    y = torch.randn(num_tokens, pool.bt_rows.shape[1], generator=gen).to(dtype)
    slots = pool.slots(mix, num_tokens, gen)
    h_ref, y_ref = reference_forward(x, y, pool, slots)
    h, y_new = run_backend(backend, pool, x, y, slots)
    assert h.dtype == dtype and y_new.dtype == dtype
    torch.testing.assert_close(h.float(), h_ref, **TOLERANCE[dtype])
    torch.testing.assert_close(y_new.float(), y_ref, **TOLERANCE[dtype])
    none = slots < 0
    assert torch.equal(h[none], torch.zeros_like(h[none])), "slot -1 must give an exactly zero h"
    assert torch.equal(y_new[none], y[none]), "slot -1 rows of y must be unchanged bit for bit"
    ranks = torch.tensor([pool.slot_rows.get(int(s), 0) for s in slots])
    past_rank = torch.arange(pool.rank)[None, :] >= ranks[:, None]
    assert torch.equal(h[past_rank], torch.zeros_like(h[past_rank])), "h lanes past a token's rank must be zero"


def pool_of(num_slots, rank, granule, in_f=48, out_f=80, seed=0, **kwargs) -> RowPool:
    return make_rows(num_slots, rank, granule, in_f, out_f, torch.Generator().manual_seed(seed + 1000), **kwargs)


def test_reference_matches_an_independent_dense_oracle():
    """The loop reference against a vectorised formula: per token, gather its rows (zero row past its rank)."""
    pool = pool_of(7, 8, 3)
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(40, 48, generator=gen), torch.randn(40, 80, generator=gen)
    slots = pool.slots("uniform", 40, gen)
    lane = torch.arange(pool.rank)[None, :]
    ranks = torch.tensor([pool.slot_rows.get(int(s), 0) for s in slots])[:, None]
    rows = torch.where(lane < ranks, slots[:, None].long() * pool.granule + lane, pool.a_rows.shape[0] - 1)
    h = torch.einsum("ti,tri->tr", x, pool.a_rows[rows])
    y_expected = y + torch.einsum("tr,tro->to", h, pool.bt_rows[rows])
    h_ref, y_ref = reference_forward(x, y, pool, slots)
    torch.testing.assert_close(h_ref, h)
    torch.testing.assert_close(y_ref, y_expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("name", list(BACKENDS))
def test_mixes_against_reference(name, mix, dtype):
    """Mixed ranks 1..8 in one step, stale garbage past every rank."""
    check(BACKENDS[name](), pool_of(6, 8, 8), num_tokens=37, mix=mix, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mix", ["uniform", "distinct", "zipf", "single_with_none"])
@pytest.mark.parametrize("name", list(BACKENDS))
def test_granule_below_rank(name, mix, dtype):
    """G = 3 < R = 8: adapters of rank > 3 span several granules; the slot ids in between are unused."""
    check(BACKENDS[name](), pool_of(20, 8, 3), num_tokens=45, mix=mix, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mix", ["zipf", "distinct", "skewed", "empty_slots"])
@pytest.mark.parametrize("name", list(BACKENDS))
def test_pool_of_300_slots(name, mix, dtype):
    """A large pool of which a step uses a few slots; the table the laned forms read has A·R rows only."""
    pool = pool_of(300, 16, 16, in_f=32, out_f=40, seed=4)
    check(BACKENDS[name](), pool, num_tokens=70, mix=mix, dtype=dtype)


@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.parametrize(
    ("num_tokens", "num_slots", "rank", "granule", "full_rank"),
    [(1, 4, 8, 8, False), (1, 1, 16, 16, True), (3, 8, 16, 4, False), (61, 3, 4, 4, True), (64, 16, 8, 8, False)],
)
def test_shapes(name, num_tokens, num_slots, rank, granule, full_rank):
    pool = pool_of(num_slots, rank, granule, full_rank=full_rank)
    for mix in ("uniform", "distinct", "single_with_none"):
        check(BACKENDS[name](), pool, num_tokens, mix)


@pytest.mark.parametrize("name", list(BACKENDS))
def test_expand_reads_only_the_rank_of_each_token(name):
    """expand must not rely on shrink's zeros: garbage in h rows of slot -1 tokens and in lanes past a token's rank
    adds nothing (laned backends re-mask; eager forms read h[:, :r] or multiply by the zero row)."""
    backend = BACKENDS[name]()
    pool = pool_of(5, 8, 8, in_f=16, out_f=24, seed=3)
    gen = torch.Generator().manual_seed(3)
    for mix in ("single_with_none", "uniform", "single"):
        slots = pool.slots(mix, 20, gen)
        meta = pool.meta(backend, 32)
        meta.prepare(slots, pool.slot_rows)
        h = torch.randn(20, pool.rank, generator=gen)
        y = torch.randn(20, 24, generator=gen)
        _, y_ref = _reference_expand(pool, slots, h, y)
        if backend.laned_output:  # each token's R lanes at its compact slot, garbage everywhere else
            laned = torch.randn(20, meta.active_width, pool.rank, generator=gen)
            compact = meta.token_compact.long()
            laned[compact >= 0, compact[compact >= 0]] = h[compact >= 0]
            h = laned.view(20, -1)
        y_new = expand(y.clone(), h, pool.bt_rows, meta)
        torch.testing.assert_close(y_new, y_ref)
        assert torch.equal(y_new[slots < 0], y[slots < 0])


def _reference_expand(pool, slots, h, y):
    meta = pool.meta(ReferenceBackend(), slots.shape[0])
    meta.prepare(slots, pool.slot_rows)
    return h, expand(y.clone(), h, pool.bt_rows, meta)


def test_no_adapter_does_no_work():
    backend = select_backend("cpu")
    pool = pool_of(4, 8, 8)
    meta = pool.meta(backend, 16)
    meta.prepare(torch.full((16,), -1, dtype=torch.int32), {})
    assert meta.no_adapter and meta.grouping is None and meta.lane_onehot is None and meta.gather_rows is None
    y = torch.randn(16, 80)
    assert expand(y, torch.zeros(16, 8), pool.bt_rows, meta) is y


@settings(max_examples=30, deadline=None)
@given(
    num_tokens=st.integers(1, 70),
    num_slots=st.integers(1, 9),
    rank=st.sampled_from([1, 4, 8, 16]),
    granule_div=st.sampled_from([1, 2, 4]),
    mix=st.sampled_from(MIXES),
    name=st.sampled_from(list(BACKENDS)),
    seed=st.integers(0, 2**16),
)
def test_hypothesis(num_tokens, num_slots, rank, granule_div, mix, name, seed):
    pool = pool_of(num_slots, rank, max(rank // granule_div, 1), in_f=24, out_f=40, seed=seed)
    check(BACKENDS[name](), pool, num_tokens, mix, seed=seed)


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("name", list(BACKENDS))
def test_expand_without_accumulate_writes_and_never_reads_y(name, mix):
    """accumulate=False: y[t] = h[t] @ Bt rows of slot[t] (0 for slot -1) whatever y held — NaN here, so a read
    shows."""
    gen = torch.Generator().manual_seed(5)
    pool = pool_of(6, 8, 8)
    x = torch.randn(37, 48, generator=gen)
    slots = pool.slots(mix, 37, gen)
    _, y_ref = reference_forward(x, torch.zeros(37, 80), pool, slots)
    _, y_new = run_backend(BACKENDS[name](), pool, x, torch.full((37, 80), float("nan")), slots, accumulate=False)
    torch.testing.assert_close(y_new, y_ref, **TOLERANCE[torch.float32])
    assert torch.equal(y_new[slots < 0], torch.zeros_like(y_new[slots < 0]))
