"""Megatron's plan (adapter_manager.sharding) and the row layout in tensor-parallel sections: every shard's piece of
every module, prepared from a real PEFT adapter, joins back into PEFT's delta with no collective beyond the base's."""

from __future__ import annotations

import pytest
import torch

from adapter_manager import (
    AdapterManager,
    AdapterManagerConfig,
    AdapterRegistry,
    BaseModelSpec,
    RegistryConfig,
    SlotPool,
    SlotPoolConfig,
    TensorParallel,
)
from adapter_manager.sharding import COLUMN_PARALLEL, ROW_PARALLEL
from adapter_manager.tiers.row_layout import RowLayout
from tests.conftest import ALL_LINEAR_RSLORA
from tests.runtime._oracle import PROJECTIONS

BENCH = BaseModelSpec.bench()  # 16 heads, 4 KV heads: 8 shards replicate each KV head twice
NO_GQA = BaseModelSpec("no-gqa", 64, 96, 2, 4, 4, 16)


@pytest.mark.parametrize("spec", [BENCH, NO_GQA], ids=["bench", "no_gqa"])
@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_the_plan_splits_every_feature_once_and_replicates_kv_heads_only_where_kv_is_fewer(spec, size):
    if size == 8 and spec is NO_GQA:
        with pytest.raises(ValueError, match="does not split the model"):
            TensorParallel(8).check(spec)
        return
    tp = TensorParallel(size)
    tp.check(spec)
    for proj in PROJECTIONS:
        fan_in, fan_out = spec.projection_shape(proj)
        outs = [tp.out_index(spec, proj, s) for s in range(size)]
        ins = [tp.in_index(spec, proj, s) for s in range(size)]
        sharded, whole = (outs, ins) if proj in COLUMN_PARALLEL else (ins, outs)
        assert all(torch.equal(w, torch.arange(fan_in if proj in COLUMN_PARALLEL else fan_out)) for w in whole)
        joined = torch.cat(sharded)
        full = fan_out if proj in COLUMN_PARALLEL else fan_in
        if proj in ("k_proj", "v_proj") and spec.num_kv_heads < size:
            assert len(joined) == size * spec.head_dim and set(joined.tolist()) == set(range(full))  # replicated
        else:
            assert torch.equal(joined, torch.arange(full)), proj  # every feature in exactly one shard, in order
        assert all(len(piece) == len(sharded[0]) for piece in sharded)


def test_a_size_that_does_not_split_the_model_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 .*num_heads 16"):
        AdapterManager(BENCH, AdapterManagerConfig(tensor_parallel_size=3))
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        AdapterManagerConfig(tensor_parallel_size=0)


def test_one_section_is_the_unsharded_layout():
    plain, one = RowLayout.of(BENCH), RowLayout.of(BENCH, TensorParallel(1))
    assert plain == one and one.sections == 1 and one.section_width == one.width


@pytest.mark.parametrize("size", [2, 4])
def test_prepared_sections_join_into_the_unsharded_block(size, write_peft_adapter, tiny_spec):
    """Column-parallel: every section's A is the whole A, the sections' Bt columns joined (KV heads de-duplicated) the
    whole Bt; row-parallel: the sections' A columns joined the whole A, every Bt whole; and for row-parallel modules
    the shards' partial LoRA outputs sum to the unsharded one (the join the layer's one all-reduce makes)."""
    folder, _ = write_peft_adapter(**ALL_LINEAR_RSLORA)
    tp = TensorParallel(size)
    whole = AdapterRegistry(tiny_spec, RegistryConfig(max_rank=8))
    sharded = AdapterRegistry(tiny_spec, RegistryConfig(max_rank=8, tensor_parallel_size=size))
    reference, ours = (r.register(str(folder), adapter_id="a") and r.prepared("a") for r in (whole, sharded))
    layout = RowLayout.of(tiny_spec, tp)
    assert ours.storage.shape == (reference.rows, layout.width) and layout.width == size * layout.section_width
    x = torch.randn(5, tiny_spec.projection_shape("down_proj")[0])
    for key, weights in reference.modules.items():
        a, bt = ours.modules[key].a, ours.modules[key].bt  # [r, S, in_s], [r, S, out_s]
        assert a.shape[1] == bt.shape[1] == size
        if key.proj in COLUMN_PARALLEL:
            assert all(torch.equal(a[:, s], weights.a) for s in range(size))
            for s in range(size):
                assert torch.equal(bt[:, s], weights.bt[:, tp.out_index(tiny_spec, key.proj, s)])
        else:
            assert torch.equal(torch.cat(a.unbind(1), dim=1), weights.a)
            assert all(torch.equal(bt[:, s], weights.bt) for s in range(size))
            xs = x[:, : weights.a.shape[1]]
            partial = sum(xs[:, tp.in_index(tiny_spec, key.proj, s)] @ a[:, s].T @ bt[:, s] for s in range(size))
            torch.testing.assert_close(partial, xs @ weights.a.T @ weights.bt, atol=1e-5, rtol=1e-5)
    assert ROW_PARALLEL == ("o_proj", "down_proj")


def test_a_sharded_pool_loads_blocks_and_hands_out_sectioned_views(write_peft_adapter, tiny_spec):
    folder, _ = write_peft_adapter(**ALL_LINEAR_RSLORA)
    registry = AdapterRegistry(tiny_spec, RegistryConfig(max_rank=8, tensor_parallel_size=2))
    registry.register(str(folder), adapter_id="a")
    prepared = registry.prepared("a")
    pool = SlotPool(tiny_spec, SlotPoolConfig(max_slots=2, max_rank=8, tensor_parallel_size=2))
    pool.load(1, prepared)
    start = pool.granule
    for key, weights in prepared.modules.items():
        stacks = pool.stacks[key]
        assert stacks.a.shape[1:] == weights.a.shape[1:] and stacks.bt.shape[1:] == weights.bt.shape[1:]
        assert torch.equal(stacks.a[start : start + prepared.rows], weights.a)
        assert torch.equal(stacks.bt[start : start + prepared.rows], weights.bt)
    assert pool.section_nbytes * 2 == pool.nbytes
    with pytest.raises(Exception, match="rows of"):
        SlotPool(tiny_spec, SlotPoolConfig(max_slots=2, max_rank=8)).load(0, prepared)  # an unsharded pool refuses
