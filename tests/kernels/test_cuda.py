"""The eager torch forms on a CUDA device, on row pools, against the fp32 loop reference on CPU.

Skipped where no CUDA device is present (CI); run on a GPU machine with ``pytest tests/kernels/test_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch

from kernels import KernelConfig, LoRAForm, expand, select_backend, shrink
from tests.kernels._cases import MIXES, TOLERANCE, make_rows, reference_forward

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
