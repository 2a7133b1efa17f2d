"""The paged KV cache: every attention form over block tables (batched eager, per-sequence, static) equals dense
attention over the same keys, whatever the blocks' order, size and sharing; writes land where the tables say."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adapter_manager.runtime.model.batch import SeqSpan
from adapter_manager.runtime.model.kv_cache import KVCache, plan_attention, slot_index

ROWS, POSITIONS, KV, D = 6, 20, 2, 8

SPANS = {  # (row, offset, count, end)
    "decode-ragged": ((3, 0, 1, 7), (0, 1, 1, 1), (5, 2, 1, 19), (1, 3, 1, 12)),
    "decode-rows-in-order": ((0, 0, 1, 7), (1, 1, 1, 19), (2, 2, 1, 1), (3, 3, 1, 16)),
    "mixed": ((2, 0, 1, 9), (0, 1, 5, 5), (4, 6, 1, 3), (1, 7, 3, 14), (5, 10, 1, 20)),  # fresh + cached prefill
    "prefill-only": ((0, 0, 4, 4), (1, 4, 2, 11)),
    "one-decode": ((3, 0, 1, 16),),
}


def _paged(block_size: int, shared: bool) -> tuple[KVCache, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cache whose rows hold the dense K, V [ROWS, POSITIONS, KV, D] through shuffled block tables (with
    ``shared``: rows 4 and 5 hold the same keys as row 0 in their first block, and name row 0's block)."""
    gen = torch.Generator().manual_seed(0)
    dense_k = torch.randn(ROWS, POSITIONS, KV, D, generator=gen)
    dense_v = torch.randn(ROWS, POSITIONS, KV, D, generator=gen)
    width = -(-POSITIONS // block_size)
    tables = torch.randperm(ROWS * width + 3, generator=gen)[: ROWS * width].view(ROWS, width)
    if shared:
        for row in (4, 5):
            tables[row, 0] = tables[0, 0]
            dense_k[row, :block_size], dense_v[row, :block_size] = dense_k[0, :block_size], dense_v[0, :block_size]
    cache = KVCache(ROWS * width + 3, block_size, KV, D, torch.float32, "cpu")
    cache.k.normal_(generator=gen)  # blocks no table names hold noise
    cache.v.normal_(generator=gen)
    rows = torch.arange(ROWS).repeat_interleave(POSITIONS)
    positions = torch.arange(POSITIONS).repeat(ROWS)
    cache.update(slot_index(tables, rows, positions, block_size), dense_k.flatten(0, 1), dense_v.flatten(0, 1))
    return cache, tables, dense_k, dense_v


def _dense_attention(q, spans, dense_k, dense_v) -> torch.Tensor:
    out = torch.empty_like(q)
    for row, offset, count, end in spans:
        qs = q[offset : offset + count].transpose(0, 1)  # [H, n, D]
        ks, vs = dense_k[row, :end].transpose(0, 1), dense_v[row, :end].transpose(0, 1)
        mask = torch.arange(end)[None, :] <= torch.arange(end - count, end)[:, None]
        attended = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=mask, enable_gqa=True)
        out[offset : offset + count] = attended[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("shared", [False, True], ids=["distinct", "shared-prefix"])
@pytest.mark.parametrize("block_size", [16, 4, 3, 1])
@pytest.mark.parametrize("case", list(SPANS))
def test_paged_attention_equals_dense(case, block_size, shared) -> None:
    cache, tables, dense_k, dense_v = _paged(block_size, shared)
    spans = tuple(SeqSpan(*span) for span in SPANS[case])
    tokens = sum(span.count for span in spans)
    q = torch.randn(tokens, 4, D, generator=torch.Generator().manual_seed(1))  # 4 query heads over 2 KV heads
    # the step's own keys: those of its tokens' positions (a fresh prefill chunk attends over them directly)
    rows = torch.tensor([s.cache_row for s in spans for _ in range(s.count)])
    positions = torch.tensor([p for s in spans for p in range(s.end_pos - s.count, s.end_pos)])
    k, v = dense_k[rows, positions], dense_v[rows, positions]
    expected = _dense_attention(q, spans, dense_k, dense_v)
    plan = plan_attention(spans, tables, block_size, "cpu")
    assert (plan.blocks is not None) == any(span.count == 1 for span in spans)
    torch.testing.assert_close(cache.attend(q, plan, tables, k, v), expected, atol=1e-6, rtol=1e-5)
    static = cache.attend_static(q, tables, rows, positions)  # every token over its whole row, masked
    torch.testing.assert_close(static, expected, atol=1e-6, rtol=1e-5)


def test_update_writes_only_the_named_positions() -> None:
    cache = KVCache(5, 4, KV, D, torch.float32, "cpu")
    tables = torch.tensor([[3, 1], [0, 4]])
    slots = slot_index(tables, torch.tensor([0, 0, 1]), torch.tensor([0, 5, 7]), 4)
    assert slots.tolist() == [12, 5, 19]  # block 3 offset 0, block 1 offset 1, block 4 offset 3
    k = torch.ones(3, KV, D)
    cache.update(slots, k, 2 * k)
    written = cache.k.flatten(0, 1).abs().sum((1, 2)).nonzero().flatten().tolist()
    assert written == [5, 12, 19] and torch.equal(cache.v.flatten(0, 1)[19], 2 * k[0])
