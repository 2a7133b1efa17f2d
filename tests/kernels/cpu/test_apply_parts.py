"""apply_parts: a fused linear's whole LoRA (P parts sharing x) added to y in one call. The cpu backend's fused C++
kernel and every eager backend's composition equal the fp32 loop reference over the adversarial mixes."""

from __future__ import annotations

import pytest
import torch

from adapter_manager.kernels import BackendKind, KernelConfig, LoRAForm, apply_parts, select_backend
from adapter_manager.kernels.cpu import lora_apply
from tests.kernels._cases import BACKENDS, MIXES, OUTS, bt_parts, check_apply_parts, parts_pool

EAGER = [name for name in BACKENDS if not BACKENDS[name]().traced]


@pytest.mark.parametrize(("parts", "dtype"), [(1, torch.float32), (3, torch.float32), (2, torch.bfloat16)])
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("name", EAGER)
def test_apply_parts_equals_the_loop_over_mixes(name, mix, parts, dtype):
    """Mixed ranks 1..8, stale garbage past every rank and around every part's columns, y a view of a wider tensor."""
    check_apply_parts(BACKENDS[name](), parts_pool(parts, 6, 8, 8), num_tokens=37, mix=mix, dtype=dtype)


@pytest.mark.parametrize("mix", ["distinct", "zipf", "skewed", "empty_slots"])
@pytest.mark.parametrize("name", ["cpu_fused", "cpu_auto", "reference"])
def test_apply_parts_granule_below_rank_large_pool_and_wide_outputs(name, mix):
    check_apply_parts(BACKENDS[name](), parts_pool(2, 20, 8, 3, seed=1), num_tokens=45, mix=mix, seed=1)
    check_apply_parts(BACKENDS[name](), parts_pool(3, 300, 16, 16, in_f=32, seed=2), num_tokens=70, mix=mix, seed=2)
    wide = (2100, 257)  # several 1024-column chunks, a ragged last one
    check_apply_parts(
        BACKENDS[name](), parts_pool(2, 6, 64, 64, in_f=40, seed=3), num_tokens=9, mix=mix, seed=3, outs=wide
    )


LIMIT = KernelConfig().fused_max_tokens


@pytest.mark.parametrize("num_tokens", [1, 2, 5, LIMIT, LIMIT + 1])
def test_auto_takes_the_kernel_up_to_fused_max_tokens(num_tokens):
    backend = select_backend("cpu")
    pp = parts_pool(3, 6, 8, 8, seed=4)
    meta = pp.pool.meta(backend, 2 * LIMIT)
    meta.prepare(pp.pool.slots("uniform", num_tokens, torch.Generator().manual_seed(4)), pp.pool.slot_rows)
    assert meta.fused == (num_tokens <= LIMIT and not meta.no_adapter)
    check_apply_parts(backend, pp, num_tokens, "uniform", seed=4)


def test_the_kernel_refuses_bad_operands():
    """The C++ checks name what is wrong (runs past the rows or tokens, a missing Bt, mixed dtypes)."""
    x, a, y = torch.randn(4, 8), torch.randn(9, 2, 8), torch.zeros(4, 6)
    bts = [torch.randn(9, 3), torch.randn(9, 3)]
    runs = torch.tensor([[0, 4, 6, 2]])
    lora_apply(y, x, a, bts, runs)
    torch.testing.assert_close(y[:, :3], x @ a[6:8, 0].t() @ bts[0][6:8])
    with pytest.raises(RuntimeError, match="reads rows"):
        lora_apply(y, x, a, bts, torch.tensor([[0, 4, 8, 2]]))
    with pytest.raises(RuntimeError, match="covers tokens"):
        lora_apply(y, x, a, bts, torch.tensor([[2, 3, 0, 2]]))
    with pytest.raises(RuntimeError, match="one Bt per part"):
        lora_apply(y, x, a, bts[:1], runs)
    with pytest.raises(RuntimeError, match="one dtype"):
        lora_apply(y.double(), x, a, bts, runs)
    with pytest.raises(RuntimeError, match="exceed"):
        lora_apply(torch.zeros(4, 5), x, a, bts, runs)


def test_a_traced_backend_refuses_apply_parts():
    pp = parts_pool(2, 6, 8, 8)
    meta = pp.pool.meta(BACKENDS["xla_laned_on_cpu"](), 16)
    meta.prepare(torch.zeros(3, dtype=torch.int32), pp.pool.slot_rows)
    with pytest.raises(ValueError, match="eager backends only"):
        apply_parts(torch.zeros(3, 44), torch.randn(3, 48), pp.a_parts, bt_parts(pp, OUTS[:2], 0), meta)


def test_forced_fused_needs_the_cpu_backend():
    assert select_backend("cpu", KernelConfig(torch_form=LoRAForm.FUSED)).form is LoRAForm.FUSED
    with pytest.raises(ValueError, match="torch and cpu backends only"):
        select_backend("cpu", KernelConfig(backend=BackendKind.REFERENCE, torch_form=LoRAForm.FUSED))


def test_the_fused_path_still_names_bad_operands():
    """The hot path skips the Python checks it does not need; a mismatch still gets a named error."""
    pp = parts_pool(2, 6, 8, 8)
    meta = pp.pool.meta(BACKENDS["cpu_fused"](), 16)
    meta.prepare(torch.zeros(3, dtype=torch.int32), pp.pool.slot_rows)
    bts = bt_parts(pp, OUTS[:2], 0)
    with pytest.raises(ValueError, match=r"x must have shape \[T=3"):
        apply_parts(torch.zeros(3, 44), torch.randn(4, 48), pp.a_parts, bts, meta)
    with pytest.raises(ValueError, match="a_parts has 2 parts, bt_parts 1"):
        apply_parts(torch.zeros(3, 44), torch.randn(3, 48), pp.a_parts, bts[:1], meta)
    with pytest.raises(RuntimeError, match="Bt dtype differs"):
        apply_parts(torch.zeros(3, 44), torch.randn(3, 48), pp.a_parts, [bts[0], bts[1].double()], meta)
