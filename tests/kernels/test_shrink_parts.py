"""The fused shrink of parts that share an input (q/k/v, gate/up) on a [N, P, in] view of one row buffer: every
backend's ``shrink_parts(x, a_parts)[p]`` equals its own ``shrink(x, a_parts[:, p])`` and the fp32 loop reference."""

from __future__ import annotations

import pytest
import torch

from adapter_manager.kernels import BackendKind, KernelConfig, LoRAForm, select_backend, shrink, shrink_parts
from adapter_manager.kernels.reference import ReferenceBackend
from tests.kernels._cases import BACKENDS, MIXES, PAD_LEFT, TOLERANCE, PartsPool, collapse_laned, parts_pool

FUSED_TOLERANCE = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: TOLERANCE[torch.bfloat16]}
"""Fused h[p] against the same backend's per-part shrink."""


def check(backend, pp: PartsPool, num_tokens: int, mix: str, dtype=torch.float32, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    pp = pp.to(dtype)
    x = torch.randn(num_tokens, pp.in_features, generator=gen).to(dtype)
    slots = pp.pool.slots(mix, num_tokens, gen)
    meta = pp.pool.meta(backend, 128)
    meta.prepare(slots, pp.pool.slot_rows)
    h = shrink_parts(x, pp.a_parts, meta)
    width = meta.active_width * pp.pool.rank if backend.laned_output else pp.pool.rank
    assert h.shape == (pp.parts, num_tokens, width) and h.dtype == dtype
    # the reference and the traced backends run the per-part op part by part; the torch forms run one matmul for
    # all parts where the per-part op runs one per part: the same sums, possibly in another order
    exact = backend.traced or isinstance(backend, ReferenceBackend)
    tolerance = {"atol": 0, "rtol": 0} if exact else FUSED_TOLERANCE[dtype]
    reference = ReferenceBackend()
    ref_meta = pp.pool.meta(reference, 128)
    ref_meta.prepare(slots, pp.pool.slot_rows)
    for index in range(pp.parts):
        torch.testing.assert_close(h[index], shrink(x, pp.part(index), meta), **tolerance)
        got = collapse_laned(h[index], pp.pool.rank) if backend.laned_output else h[index]
        expected = shrink(x.float(), pp.part(index).float(), ref_meta)
        torch.testing.assert_close(got.float(), expected, **TOLERANCE[dtype])
        none = slots < 0
        assert torch.equal(got[none], torch.zeros_like(got[none])), "slot -1 must give an exactly zero h"
        ranks = torch.tensor([pp.pool.slot_rows.get(int(s), 0) for s in slots])
        past_rank = torch.arange(pp.pool.rank)[None, :] >= ranks[:, None]
        assert torch.equal(got[past_rank], torch.zeros_like(got[past_rank])), "h past a token's rank must be zero"


@pytest.mark.parametrize(
    ("parts", "dtype"), [(2, torch.float32), (3, torch.float32), (3, torch.bfloat16)], ids=["P2", "P3", "P3-bf16"]
)
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("name", list(BACKENDS))
def test_fused_equals_per_part_over_mixes(name, mix, parts, dtype):
    """Mixed ranks 1..8 in one step, stale garbage past every rank and beside the parts' columns."""
    check(BACKENDS[name](), parts_pool(parts, 6, 8, 8), num_tokens=37, mix=mix, dtype=dtype)


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("mix", ["uniform", "distinct", "zipf", "single_with_none", "skewed"])
@pytest.mark.parametrize("name", list(BACKENDS))
def test_fused_granule_below_rank_and_large_pool(name, mix, parts):
    check(BACKENDS[name](), parts_pool(parts, 20, 8, 3, seed=1), num_tokens=45, mix=mix, seed=1)
    check(BACKENDS[name](), parts_pool(parts, 300, 16, 16, in_f=32, seed=2), num_tokens=70, mix=mix, seed=2)


@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.parametrize(("num_tokens", "num_slots", "rank", "granule"), [(1, 4, 8, 8), (3, 8, 16, 4), (64, 1, 4, 4)])
def test_fused_shapes(name, num_tokens, num_slots, rank, granule):
    for mix in ("single", "uniform", "single_with_none"):
        check(BACKENDS[name](), parts_pool(3, num_slots, rank, granule, in_f=24), num_tokens, mix)


@pytest.mark.parametrize("form", [LoRAForm.SEGMENTS, LoRAForm.GROUPED, LoRAForm.LANED])
def test_full_rank_single_and_every_form_on_a_sorted_batch(form):
    """Every adapter at rank R (the no-padding fast path of the single form) and a batch ordered by adapter."""
    pp = parts_pool(3, 4, 8, 8, seed=3)
    for slot in pp.pool.slot_rows:
        pp.pool.slot_rows[slot] = 8
        pp.buffer[slot * 8 : slot * 8 + 8, PAD_LEFT : PAD_LEFT + 3 * 48] = torch.randn(8, 3 * 48) / 48**0.5
    check(select_backend("cpu"), pp, 40, "single")
    check(select_backend("cpu", KernelConfig(torch_form=form)), pp, 40, "uniform")


def test_reference_fused_is_bit_exact_per_part():
    """The reference runs the same fp32 loops part by part: h[p] is the per-part shrink bit for bit."""
    pp = parts_pool(3, 6, 8, 8)
    backend = select_backend("cpu", KernelConfig(backend=BackendKind.REFERENCE))
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(30, 48, generator=gen)
    meta = pp.pool.meta(backend, 30)
    meta.prepare(pp.pool.slots("uniform", 30, gen), pp.pool.slot_rows)
    h = shrink_parts(x, pp.a_parts, meta)
    assert all(torch.equal(h[p], shrink(x, pp.part(p), meta)) for p in range(3))


def test_shrink_parts_reads_the_view_in_place():
    """a_parts is read where it lies: a write into the buffer (a slot load) shows in the next call, no copy kept."""
    pp = parts_pool(2, 4, 8, 8)
    backend = select_backend("cpu")
    meta = pp.pool.meta(backend, 8)
    slot = int(pp.pool.slot_ids[0])
    meta.prepare(torch.full((8,), slot, dtype=torch.int32), pp.pool.slot_rows)
    x = torch.randn(8, 48)
    a_parts = pp.a_parts
    before = shrink_parts(x, a_parts, meta)
    pp.buffer[slot * 8 : slot * 8 + 8, PAD_LEFT + 48 : PAD_LEFT + 96] *= 2  # part 1's rows of the slot
    after = shrink_parts(x, a_parts, meta)
    torch.testing.assert_close(after[0], before[0], atol=0, rtol=0)
    torch.testing.assert_close(after[1], 2 * before[1])


def test_shrink_parts_validates_its_arguments():
    pp = parts_pool(3, 4, 8, 8)
    meta = pp.pool.meta(select_backend("cpu"), 16)
    meta.prepare(pp.pool.slots("uniform", 10, torch.Generator().manual_seed(0)), pp.pool.slot_rows)
    x = torch.randn(10, 48)
    with pytest.raises(ValueError, match=r"a_parts must have shape \[N=33, P >= 1, features\].*got \(33, 48\)"):
        shrink_parts(x, pp.part(0), meta)
    with pytest.raises(ValueError, match=r"a_parts must have shape \[N=33.*got \(32, 3, 48\)"):
        shrink_parts(x, pp.a_parts[:-1], meta)
    with pytest.raises(ValueError, match=r"a_parts must have shape \[N=33.*got \(33, 0, 48\)"):
        shrink_parts(x, pp.a_parts[:, :0], meta)
    with pytest.raises(ValueError, match=r"a_parts features 40 != x features 48"):
        shrink_parts(x, pp.a_parts[:, :, :40], meta)
    with pytest.raises(ValueError, match=r"a_parts is torch.bfloat16 on cpu, expected torch.float32 on cpu"):
        shrink_parts(x, pp.a_parts.bfloat16(), meta)
    with pytest.raises(ValueError, match=r"x must have shape \[T=10, features\], got \(9, 48\)"):
        shrink_parts(x[:9], pp.a_parts, meta)
