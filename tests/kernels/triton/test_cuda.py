"""The eager torch forms and the triton backend's compiled kernels on a CUDA device, on row pools, against the fp32
loop reference on CPU.

Skipped where no CUDA device is present (CI); run on a GPU machine with ``pytest tests/kernels/test_cuda.py``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from adapter_manager.kernels import (
    BackendKind,
    KernelConfig,
    LoRAForm,
    apply_parts,
    expand,
    select_backend,
    shrink,
    shrink_parts,
)
from tests.kernels._cases import (
    MIXES,
    OUTS,
    TOLERANCE,
    PartsPool,
    bt_parts,
    make_rows,
    parts_pool,
    reference_apply_parts,
    reference_forward,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

POOLS = {"dense": (6, 8, 8), "granule_below_rank": (20, 8, 3), "300_slots": (300, 16, 16)}


def strided_on_cuda(rows: torch.Tensor) -> torch.Tensor:
    buffer = torch.full((rows.shape[0], rows.shape[1] + 5), float("nan"), dtype=rows.dtype, device="cuda")
    buffer[:, : rows.shape[1]] = rows.cuda()
    return buffer[:, : rows.shape[1]]


@pytest.mark.parametrize("pool_name", list(POOLS))
@pytest.mark.parametrize("form", [LoRAForm.AUTO, LoRAForm.SEGMENTS, LoRAForm.GROUPED, LoRAForm.LANED])
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("indices_on", ["cpu", "cuda"])
def test_eager_forms_on_cuda_match_the_reference(pool_name, form, mix, dtype, indices_on):
    gen = torch.Generator().manual_seed(1)
    pool = make_rows(*POOLS[pool_name], 48, 80, gen).to(dtype)
    x, y = torch.randn(37, 48, generator=gen).to(dtype), torch.randn(37, 80, generator=gen).to(dtype)
    slots = pool.slots(mix, 37, gen)
    h_ref, y_ref = reference_forward(x, y, pool, slots)
    meta = pool.meta(select_backend("cuda", KernelConfig(torch_form=form)), 64, "cuda")
    meta.prepare(slots.to(indices_on), pool.slot_rows)
    h = shrink(x.cuda(), strided_on_cuda(pool.a_rows), meta)
    y_new = expand(y.cuda(), h, strided_on_cuda(pool.bt_rows), meta).cpu()
    torch.testing.assert_close(h.cpu().float(), h_ref, **TOLERANCE[dtype])
    torch.testing.assert_close(y_new.float(), y_ref, **TOLERANCE[dtype])
    none = slots < 0
    assert torch.equal(y_new[none], y[none]), "slot -1 rows of y must be unchanged bit for bit"
    assert torch.equal(h.cpu()[none], torch.zeros_like(h.cpu()[none]))


@pytest.mark.parametrize("pool_name", list(POOLS))
@pytest.mark.parametrize("form", [LoRAForm.AUTO, LoRAForm.SEGMENTS, LoRAForm.GROUPED, LoRAForm.LANED])
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize(("parts", "dtype"), [(2, torch.float32), (3, torch.float32), (3, torch.bfloat16)])
def test_fused_shrink_on_cuda_matches_per_part_and_the_reference(pool_name, form, mix, parts, dtype):
    """One batched matmul per run over a [N, P, in] view of one CUDA buffer (x broadcast over the parts)."""
    pp = parts_pool(parts, *POOLS[pool_name], in_f=48, seed=1).to(dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, 48, generator=gen).to(dtype)
    slots = pp.pool.slots(mix, 37, gen)
    meta = pp.pool.meta(select_backend("cuda", KernelConfig(torch_form=form)), 64, "cuda")
    meta.prepare(slots, pp.pool.slot_rows)
    on_cuda = PartsPool(pp.buffer.cuda(), pp.pool, parts, 48)
    h = shrink_parts(x.cuda(), on_cuda.a_parts, meta)
    assert h.shape == (parts, 37, pp.pool.rank)
    reference = select_backend("cpu", KernelConfig(backend=BackendKind.REFERENCE))
    ref_meta = pp.pool.meta(reference, 64)
    ref_meta.prepare(slots, pp.pool.slot_rows)
    for p in range(parts):
        torch.testing.assert_close(h[p], shrink(x.cuda(), on_cuda.part(p), meta), **TOLERANCE[dtype])
        expected = shrink(x.float(), pp.part(p).float(), ref_meta)
        torch.testing.assert_close(h[p].cpu().float(), expected, **TOLERANCE[dtype])
        assert torch.equal(h[p][slots.cuda() < 0], torch.zeros_like(h[p][slots.cuda() < 0]))


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
TRITON = {"bgmv": KernelConfig(), "sgmv": KernelConfig(bgmv_max_tokens=0)}
"""AUTO on cuda is the triton backend; bgmv_max_tokens=0 sends every step to the SGMV kernels."""


@needs_triton
@pytest.mark.parametrize(
    "pool", [(6, 8, 8), (20, 8, 3), (30, 64, 8)], ids=["dense", "granule_below_rank", "ranks_1_64"]
)
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize(
    ("parts", "dtype"), [(1, torch.float32), (3, torch.float32), (2, torch.bfloat16), (3, torch.float16)]
)
@pytest.mark.parametrize("kind", list(TRITON))
def test_triton_kernels_on_cuda_equal_the_loop(kind, mix, parts, dtype, pool):
    """The compiled BGMV / SGMV kernels (one shrink and one expand launch per call) against the fp32 loop on CPU;
    slot -1 rows and the columns around y bit for bit."""
    from adapter_manager.kernels.triton.backend import TritonBackend

    pp = parts_pool(parts, *pool, in_f=48, seed=1).to(dtype)
    bts = bt_parts(pp, OUTS[:parts], 1, dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, 48, generator=gen).to(dtype)
    slots = pp.pool.slots(mix, 37, gen)
    wide = torch.randn(37, 2 + sum(OUTS[:parts]) + 3, generator=gen).to(dtype)
    y = wide[:, 2 : 2 + sum(OUTS[:parts])]
    expected = reference_apply_parts(y, x, pp, [bt.float() for bt in bts], slots)
    backend = select_backend("cuda", TRITON[kind])
    assert isinstance(backend, TritonBackend)
    meta = pp.pool.meta(backend, 64, "cuda")
    meta.prepare(slots, pp.pool.slot_rows)
    on_cuda = PartsPool(pp.buffer.cuda(), pp.pool, parts, 48)
    bts_cuda = bt_parts(pp, OUTS[:parts], 1, dtype, "cuda")  # the same values, one buffer on the device
    wide_cuda = wide.cuda()
    apply_parts(wide_cuda[:, 2 : 2 + sum(OUTS[:parts])], x.cuda(), on_cuda.a_parts, bts_cuda, meta)
    tolerance = TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16])
    torch.testing.assert_close(wide_cuda[:, 2 : 2 + sum(OUTS[:parts])].cpu().float(), expected, **tolerance)
    untouched = torch.ones_like(wide, dtype=torch.bool)
    untouched[:, 2 : 2 + sum(OUTS[:parts])] = (slots < 0)[:, None]
    assert torch.equal(wide_cuda.cpu()[untouched], wide[untouched]), "slot -1 rows and other columns bit for bit"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_attention_compiled_equals_the_gathered_sdpa_on_cpu(dtype) -> None:
    """kernels.paged_attention on CUDA (the compiled Triton kernel) against the torch form on CPU, same operands."""
    from adapter_manager.kernels import paged_attention
    from tests.kernels.triton.test_paged_attention import _case

    cache, q, tables, rows, positions = _case(8, 2, 64, 16, dtype)
    ours = paged_attention(q.cuda(), cache.k.cuda(), cache.v.cuda(), tables.cuda(), rows.cuda(), positions.cuda())
    assert ours is not None
    expected = cache.attend_static(q, tables, rows, positions)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(ours.cpu().float(), expected.float(), **tol)
