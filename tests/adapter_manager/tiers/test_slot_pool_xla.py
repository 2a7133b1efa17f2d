"""The row pool on the torch_xla CPU device: rows equal the blocks loaded, and loading never compiles (XLA lane).

A load is one graph per block size class (1, 2, 4, ... units), whatever the slot and the adapter (device index
tensor, the block padded to its class); the pool compiles every class once when made, so no load after that compiles.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.xla
torch_xla = pytest.importorskip("torch_xla")

import torch_xla.debug.metrics as metrics  # noqa: E402

from adapter_manager import BaseModelSpec, RowOptions  # noqa: E402
from adapter_manager.errors import SlotLoadError  # noqa: E402
from adapter_manager.tiers.prepare import PreparedAdapter  # noqa: E402
from adapter_manager.tiers.slot_pool import SlotPool, SlotPoolConfig, units_for  # noqa: E402
from tests.adapter_manager._fakes import make_prepared  # noqa: E402

MAX_SLOTS, MAX_RANK, GRANULE = 2, 8, 2  # 8 units of 2 rows; ranks 1-2, 3-4, 5-8 take 1, 2, 4 units


def compile_count() -> int:
    data = metrics.metric_data("CompileTime")
    return 0 if data is None else data[0]


def random_prepared(spec: BaseModelSpec, adapter_id: str, rank: int, seed: int) -> PreparedAdapter:
    """A prepared adapter of rank `rank` with random values in every row (catches any row or column mix-up)."""
    prepared = make_prepared(spec, adapter_id, rank, 0.0, spec.module_keys()[::2])
    prepared.storage.copy_(torch.randn(prepared.storage.shape, generator=torch.Generator().manual_seed(seed)))
    return prepared


def make_pool(spec: BaseModelSpec) -> SlotPool:
    config = SlotPoolConfig(
        max_slots=MAX_SLOTS, rows=RowOptions(max_rank=MAX_RANK), granule=GRANULE, device=torch_xla.device()
    )
    return SlotPool(spec, config)


def test_loads_of_every_block_size_compile_nothing_and_rows_equal_the_blocks(tiny_spec):
    pool = make_pool(tiny_spec)
    made = compile_count()
    expected = torch.zeros(pool.num_rows, pool.layout.width)  # [N, width]: what the pool's rows must hold
    known = torch.ones(pool.num_rows, dtype=torch.bool)  # rows whose content the pool promises
    gen = torch.Generator().manual_seed(0)
    ranks = list(range(1, MAX_RANK + 1)) + [int(r) for r in torch.randint(1, MAX_RANK + 1, (12,), generator=gen)]
    last = None
    for i, rank in enumerate(ranks):  # every rank, so every size class, then random ranks at random aligned slots
        units = units_for(rank, GRANULE)
        slot = units * int(torch.randint(0, pool.num_units // units, (1,), generator=gen))
        prepared = random_prepared(tiny_spec, f"adapter-{i}", rank, seed=i)
        pool.load(slot, prepared)
        start = slot * GRANULE
        known[start : start + units * GRANULE] = False  # rows past the rank: the range's own, not promised
        known[start : start + rank] = True
        expected[start : start + rank] = prepared.storage
        last = (start, prepared)
    assert compile_count() == made, "a load compiled: the slot, rank or adapter is baked into the graph"
    rows = pool.rows.cpu()
    assert torch.equal(rows[known], expected[known]) and not rows[pool.zero_row].any()
    start, prepared = last
    for key, stacks in pool.stacks.items():  # the module views read the same rows as the block's views
        a, bt = stacks.a.cpu()[start : start + prepared.rows], stacks.bt.cpu()[start : start + prepared.rows]
        assert torch.equal(a, pool.layout.a_view(prepared.storage, key)), key
        assert torch.equal(bt, pool.layout.bt_view(prepared.storage, key)), key


def test_a_refused_load_writes_nothing(tiny_spec):
    pool = make_pool(tiny_spec)
    good = random_prepared(tiny_spec, "good", 4, seed=1)
    pool.load(2, good)
    before = pool.rows.cpu()
    made = compile_count()
    refused = [
        (PreparedAdapter("narrow", "x", {}, good.storage[:, 1:]), 2),
        (make_prepared(tiny_spec, "wide", MAX_RANK + 1, 1.0), 0),
        (make_prepared(tiny_spec, "half", 4, 1.0, dtype=torch.float16), 2),
        (good, pool.num_units),
        (random_prepared(tiny_spec, "past-end", 8, seed=2), pool.num_units - 2),
    ]
    for prepared, slot in refused:
        with pytest.raises(SlotLoadError, match=prepared.adapter_id):
            pool.load(slot, prepared)
    assert torch.equal(pool.rows.cpu(), before) and compile_count() == made
    assert torch.equal(before[4:8], good.storage)
