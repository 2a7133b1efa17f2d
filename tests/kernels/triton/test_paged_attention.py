"""The paged decode attention kernel (kernels/triton/attention.py) in Triton's interpreter on CPU tensors, against the
torch form (``KVCache.attend_static``: the blocks gathered, then SDPA): blocks of a row scattered and out of order,
rows sharing a cached prefix's blocks, GQA groups of 1, 2 and 4 heads, block sizes that are and are not a power of
two, a head size that is not, positions at block edges; fp32 and bf16. Compiled for a GPU it runs in
tests/runtime/engine/test_cuda_graphs_gpu.py through the model."""

from __future__ import annotations

import pytest
import torch

from adapter_manager.runtime.model.kv_cache import KVCache

pytestmark = pytest.mark.usefixtures("triton_interpret")


def _case(heads: int, kv_heads: int, dim: int, block_size: int, dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks, max_blocks = 27, 6
    cache = KVCache(num_blocks, block_size, kv_heads, dim, dtype, "cpu")
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen).to(dtype))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen).to(dtype))
    order = torch.randperm(num_blocks - 1, generator=gen)
    tables = order[: 4 * max_blocks].view(4, max_blocks).clone()
    tables[3, :2] = tables[0, :2]  # row 3 shares row 0's first two blocks (a cached prefix)
    limit = max_blocks * block_size - 1
    positions = torch.tensor([0, block_size - 1, block_size, limit, 2 * block_size + 1, 3, limit - 1])
    rows = torch.tensor([0, 1, 2, 3, 3, 1, 0])
    q = torch.randn(len(rows), heads, dim, generator=gen).to(dtype)
    return cache, q, tables, rows, positions


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size"),
    [(4, 4, 16, 4), (8, 4, 32, 16), (8, 2, 24, 6), (4, 1, 8, 1)],
    ids=["mha-bs4", "gqa2-bs16", "gqa4-d24-bs6", "mqa-bs1"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_attention_equals_the_gathered_sdpa(heads, kv_heads, dim, block_size, dtype) -> None:
    from adapter_manager.kernels.triton.attention import PagedAttention

    cache, q, tables, rows, positions = _case(heads, kv_heads, dim, block_size, dtype)
    ours = PagedAttention()(q, cache.k, cache.v, tables, rows, positions)
    assert ours.shape == q.shape and ours.dtype == dtype
    cache32 = KVCache(cache.num_blocks, block_size, kv_heads, dim, torch.float32, "cpu")
    cache32.k.copy_(cache.k.float())
    cache32.v.copy_(cache.v.float())
    expected = cache32.attend_static(q.float(), tables, rows, positions)  # fp32, from the same cached values
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(ours.float(), expected, **tol)


def test_paged_attention_refuses_mismatched_operands() -> None:
    from adapter_manager.kernels.triton.attention import PagedAttention

    cache, q, tables, rows, positions = _case(4, 2, 16, 4, torch.float32)
    attention = PagedAttention()
    with pytest.raises(ValueError, match="differ"):
        attention(q[:, :3], cache.k, cache.v, tables, rows, positions)  # 3 heads over 2 KV heads
    with pytest.raises(ValueError, match="contiguous"):
        attention(q, cache.k.transpose(0, 1), cache.v.transpose(0, 1), tables, rows, positions)
    assert attention(q[:0], cache.k, cache.v, tables, rows[:0], positions[:0]).shape == (0, 4, 16)
