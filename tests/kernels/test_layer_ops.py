"""The model's ops besides its LoRA terms (kernels.layer_ops): the implementation the device's room picks equals the
torch form (kernels.layer_reference) in every weight layout, and the seam says which rooms have what."""

from __future__ import annotations

import pytest
import torch

from adapter_manager import kernels
from adapter_manager.kernels import LinearWeight, WeightLayout, layer_reference
from adapter_manager.kernels.cpu import load, unavailable_reason


def _plain(w: torch.Tensor) -> LinearWeight:
    return LinearWeight(WeightLayout.PLAIN, w, w.shape[0])


@pytest.mark.parametrize("tokens", [1, 8, 16, 17, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fast", [False, True])
def test_base_linear_equals_the_torch_form_in_every_layout(tokens: int, dtype: torch.dtype, fast: bool) -> None:
    gen = torch.Generator().manual_seed(tokens)
    w = torch.randn(72, 48, generator=gen).to(dtype)  # 72 columns: a blocked weight pads its last block
    x = torch.randn(tokens, 48, generator=gen).to(dtype)
    ref = layer_reference.base_linear(x.float(), w.float())
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    weights = [_plain(w)]
    packed = kernels.pack_weight(w)
    if packed is not None:
        weights.append(packed)
        assert packed.out_features == 72 and packed.tensor is not w
        torch.testing.assert_close(kernels.unpack_weight(packed), w, atol=0, rtol=0)
    for weight in weights:
        got = kernels.base_linear(x, weight, fast=fast)
        assert got.shape == (tokens, 72) and got.dtype == dtype, weight.layout
        torch.testing.assert_close(got.float(), ref, **tol)
        assert kernels.base_linear(x, weight, fast=fast, reorder=False).shape == (tokens, 72)


def test_pack_weight_layout_follows_the_room() -> None:
    w = torch.randn(40, 32)
    packed = kernels.pack_weight(w)
    if packed is None:
        pytest.skip("oneDNN cannot pack fp32 in this torch build")
    expected = WeightLayout.BLOCKED if load() else WeightLayout.ONEDNN
    assert packed.layout is expected
    assert kernels.pack_weight(torch.randn(4, 4, dtype=torch.float16)) is None  # no packed matmul takes fp16
    assert kernels.pack_weight(torch.randn(4, 4, device="meta")) is None  # not a CPU weight: plain stays
    plain = _plain(w)
    x = torch.randn(20, 32)
    assert kernels.plain_matmul(x[:4], plain)  # few tokens: torch's matmul (or the decode kernel when fast)
    assert not kernels.plain_matmul(x, plain)  # many: oneDNN's linear, which writes its output
    assert not kernels.plain_matmul(x, packed)  # a packed matmul writes its output: the LoRA adds onto it


@pytest.mark.skipif(not load(), reason=f"no CPU kernels: {unavailable_reason()}")
def test_decode_ops_are_the_cpu_rooms_where_it_builds() -> None:
    x = torch.randn(2, 8)
    ops = kernels.decode_ops(x)
    assert ops is not None
    assert isinstance(ops, kernels.DecodeOps)
    gate_up = torch.randn(3, 16)
    torch.testing.assert_close(ops.silu_mul(gate_up), layer_reference.silu_mul(gate_up), atol=1e-5, rtol=1e-5)
    weight = torch.rand(8) + 0.5
    h = torch.randn(2, 8)
    h_ref = h.clone()
    delta = torch.randn(2, 8)
    out = ops.add_rms_norm(h, delta, weight, 1e-5)
    torch.testing.assert_close(out, layer_reference.add_rms_norm(h_ref, delta, weight, 1e-5), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, h_ref)  # both added delta in place
    assert kernels.decode_ops(torch.randn(2, 8, dtype=torch.float64)) is None  # a dtype the library does not serve
    assert kernels.decode_ops(torch.randn(2, 8, device="meta")) is None  # not a CPU tensor: the torch layers


def test_only_a_capturing_backend_is_a_decode_capture(triton_interpret: None) -> None:
    """CUDA graph capture asks the backend what it keeps static (kernels.DecodeCapture), never a backend's type."""
    config = kernels.KernelConfig(backend=kernels.BackendKind.TORCH)
    assert not isinstance(kernels.select_backend("cpu", config), kernels.DecodeCapture)
    triton = kernels.select_backend("cpu", kernels.KernelConfig(backend=kernels.BackendKind.TRITON, bgmv_max_tokens=8))
    assert isinstance(triton, kernels.DecodeCapture) and triton.capture_max_tokens == 8
    meta = kernels.LoRAKernelMeta.make(triton, 4, 8, 16, "cpu", granule=8)
    meta.prepare(torch.tensor([1, 1, -1], dtype=torch.int32), {1: 8})
    inputs = triton.step_inputs(meta, 4)  # [2, bucket]: each token's first pool row and rank, then padding
    assert inputs.tolist() == [[8, 8, 0, 0], [8, 8, 0, 0]]
    static = triton.static_inputs(4, torch.device("cpu"))
    assert static.shape == inputs.shape and not static.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_deterministic_torch_forms_give_a_token_the_same_bits_in_any_batch(dtype: torch.dtype) -> None:
    """The deterministic mode's torch forms (any eager device; CPU where the library is not built): the base matmul
    and the norm of a token are the same bits alone, in any subset, in any order."""
    from adapter_manager.kernels.device_kernels import LayerKernels

    gen = torch.Generator().manual_seed(4)
    kernels = LayerKernels(deterministic=True)
    assert not kernels.plain_matmul(torch.zeros(1, 8), LinearWeight(WeightLayout.PLAIN, torch.zeros(4, 8), 4))
    x, w = torch.randn(23, 96, generator=gen).to(dtype), torch.randn(40, 96, generator=gen).to(dtype)
    norm_w = torch.randn(96, generator=gen).to(dtype)
    weight = LinearWeight(WeightLayout.PLAIN, w, 40)
    ops = kernels.decode_ops(x)
    whole, normed = kernels.linear(x, weight), ops.add_rms_norm(x.clone(), None, norm_w, 1e-6)
    torch.testing.assert_close(whole.double(), (x.double() @ w.double().t()), atol=0.3, rtol=2e-2)
    for index in ([5], [22, 0, 7], list(range(23))[::-1], list(range(0, 23, 2))):
        picked = x[index]
        assert torch.equal(kernels.linear(picked, weight), whole[index])
        assert torch.equal(ops.add_rms_norm(picked.clone(), None, norm_w, 1e-6), normed[index])
    assert kernels.linear(x[:0], weight).shape == (0, 40)
