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
    ModuleKey,
    Move,
    RegistryConfig,
    RowOptions,
    SlotPool,
    SlotPoolConfig,
    TensorParallel,
    bytes_needed,
    map_shared,
)
from adapter_manager.sharding import COLUMN_PARALLEL, ROW_PARALLEL
from adapter_manager.tiers.row_layout import ModuleColumns, RowLayout
from tests.conftest import ALL_LINEAR_RSLORA
from tests.runtime._oracle import PROJECTIONS

BENCH = BaseModelSpec.bench()  # 16 heads, 4 KV heads: 8 shards replicate each KV head twice
NO_GQA = BaseModelSpec("no-gqa", 64, 96, 2, 4, 4, 16)


@pytest.mark.parametrize("spec", [BENCH, NO_GQA], ids=["bench", "no_gqa"])
@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_the_plan_splits_every_feature_once_and_replicates_kv_heads_only_where_kv_is_fewer(spec, size):
    if size == 8 and spec is NO_GQA:
        with pytest.raises(ValueError, match="does not split the model 'no-gqa'"):
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
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 .*'adapter-manager/bench-llama'.*num_heads 16"):
        AdapterManager(BENCH, AdapterManagerConfig(rows=RowOptions(tensor_parallel=TensorParallel(3))))
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        AdapterManagerConfig(rows=RowOptions(tensor_parallel=TensorParallel(0)))


def documented_columns(spec: BaseModelSpec, shape_of) -> tuple[dict[ModuleKey, ModuleColumns], int]:
    """DESIGN.md's row, built independently: per layer every projection's A piece, then every projection's Bt piece;
    ``shape_of(proj)`` gives a piece's (in, out) widths. A vector row is the Bt pieces alone, in the same order."""
    columns, offset, vector = {}, 0, 0
    for layer in range(spec.num_layers):
        a_starts = {}
        for proj in PROJECTIONS:
            a_starts[proj], offset = offset, offset + shape_of(proj)[0]
        for proj in PROJECTIONS:
            fan_in, fan_out = shape_of(proj)
            columns[ModuleKey(layer, proj)] = ModuleColumns(a_starts[proj], fan_in, offset, fan_out, vector)
            offset, vector = offset + fan_out, vector + fan_out
    return columns, offset


def local_shape(spec: BaseModelSpec, proj: str, size: int) -> tuple[int, int]:
    """One shard's (in, out) widths, written out from Megatron's split."""
    hidden, heads = spec.hidden_size, spec.num_heads // size * spec.head_dim
    kv, mlp = max(1, spec.num_kv_heads // size) * spec.head_dim, spec.intermediate_size // size
    shapes = {"q_proj": (hidden, heads), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (heads, hidden)}
    shapes.update(gate_proj=(hidden, mlp), up_proj=(hidden, mlp), down_proj=(mlp, hidden))
    return shapes[proj]


@pytest.mark.parametrize("spec", [BENCH, NO_GQA], ids=["bench", "no_gqa"])
def test_one_section_is_the_unsharded_layout(spec):
    plain, one = RowLayout.of(spec), RowLayout.of(spec, TensorParallel(1))
    columns, width = documented_columns(spec, spec.projection_shape)
    assert plain == one and one.sections == 1 and one.section_width == one.width == width
    assert dict(one.columns) == columns
    rows = torch.randn(3, width)
    c = columns[ModuleKey(1, "v_proj")]
    a, bt = one.a_view(rows, ModuleKey(1, "v_proj")), one.bt_view(rows, ModuleKey(1, "v_proj"))  # [n, in], [n, out]
    assert torch.equal(a, rows[:, c.a_start : c.a_start + c.in_features]) and a.stride() == (width, 1)
    assert torch.equal(bt, rows[:, c.bt_start : c.bt_start + c.out_features]) and bt.shape == (3, c.out_features)


@pytest.mark.parametrize("size", [2, 4, 8])
def test_a_row_is_size_sections_of_local_pieces_and_views_gain_the_section_axis(size):
    tp = TensorParallel(size)
    layout = RowLayout.of(BENCH, tp)
    columns, section_width = documented_columns(BENCH, lambda proj: local_shape(BENCH, proj, size))
    assert dict(layout.columns) == columns and layout.sections == size and layout.section_width == section_width
    assert layout.width == size * section_width and layout.row_bytes(torch.float32) == 4 * layout.width
    assert layout.section_bytes(torch.bfloat16) == 2 * section_width
    rows = torch.randn(3, layout.width)
    for key in (ModuleKey(0, "q_proj"), ModuleKey(7, "down_proj")):
        c = columns[key]
        a, bt = layout.a_view(rows, key), layout.bt_view(rows, key)
        assert a.shape == (3, size, c.in_features) and bt.shape == (3, size, c.out_features)
        assert a.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr()  # a view, no copy
        for s in range(size):
            base = s * section_width
            assert torch.equal(a[:, s], rows[:, base + c.a_start : base + c.a_start + c.in_features])
            assert torch.equal(bt[:, s], rows[:, base + c.bt_start : base + c.bt_start + c.out_features])
    q, k, v = (columns[ModuleKey(2, p)] for p in ("q_proj", "k_proj", "v_proj"))
    assert k.a_start == q.a_start + q.in_features and v.a_start == k.a_start + k.in_features  # fused shrink's A


def test_fully_sharded_needs_a_hidden_size_the_shards_split():
    odd = BaseModelSpec("odd", 64, 96, 2, 6, 3, 16)  # heads, KV heads and the MLP split 3 ways; hidden 64 does not
    TensorParallel(3).check(odd)
    with pytest.raises(ValueError, match="fully_sharded_loras splits the hidden size 64 3 ways"):
        TensorParallel(3, fully_sharded_loras=True).check(odd)


@pytest.mark.parametrize("size", [2, 4])
def test_prepared_sections_join_into_the_unsharded_block(size, write_peft_adapter, tiny_spec):
    """Column-parallel: every section's A is the whole A, the sections' Bt columns joined (KV heads de-duplicated) the
    whole Bt; row-parallel: the sections' A columns joined the whole A, every Bt whole; and for row-parallel modules
    the shards' partial LoRA outputs sum to the unsharded one (the join the layer's one all-reduce makes)."""
    folder, _ = write_peft_adapter(**ALL_LINEAR_RSLORA)
    tp = TensorParallel(size)
    whole = AdapterRegistry(tiny_spec, RegistryConfig(rows=RowOptions(max_rank=8)))
    sharded = AdapterRegistry(
        tiny_spec, RegistryConfig(rows=RowOptions(max_rank=8, tensor_parallel=TensorParallel(size)))
    )
    reference, ours = (r.register(str(folder), adapter_id="a") and r.prepared("a") for r in (whole, sharded))
    layout = RowLayout.of(tiny_spec, tp)
    assert ours.storage.shape == (reference.rows, size, layout.section_width)
    assert layout.width == size * layout.section_width
    assert all(ours.storage[:, s].is_contiguous() for s in range(size))  # each device's piece: one contiguous copy
    x = torch.randn(5, tiny_spec.projection_shape("down_proj")[0])
    for key, weights in reference.modules.items():
        a, bt = ours.modules[key].a, ours.modules[key].bt  # [r, S, in_s], [r, S, out_s]
        assert a.shape[1] == bt.shape[1] == size
        if key.proj in COLUMN_PARALLEL:
            assert all(torch.equal(a[:, s], weights.a) for s in range(size))
            joined = torch.cat(bt.unbind(1), dim=1)  # [r, S * out_s], shard order
            kv = tiny_spec.num_kv_heads
            if key.proj in ("k_proj", "v_proj") and kv < size:  # S / KV consecutive shards hold each KV head
                copies = joined.view(reference.rows, kv, size // kv, -1)
                assert all(torch.equal(copies[:, :, j], copies[:, :, 0]) for j in range(size // kv))
                joined = copies[:, :, 0].reshape(reference.rows, -1)
            assert torch.equal(joined, weights.bt)
        else:
            assert torch.equal(torch.cat(a.unbind(1), dim=1), weights.a)
            assert all(torch.equal(bt[:, s], weights.bt) for s in range(size))
            xs = x[:, : weights.a.shape[1]]
            partial = sum(xs[:, tp.in_index(tiny_spec, key.proj, s)] @ a[:, s].T @ bt[:, s] for s in range(size))
            torch.testing.assert_close(partial, xs @ weights.a.T @ weights.bt, atol=1e-5, rtol=1e-5)
    assert ROW_PARALLEL == ("o_proj", "down_proj")


@pytest.mark.parametrize("size", [2, 4])
def test_fully_sharded_sections_hold_every_feature_once_and_their_summed_shrinks_give_the_delta(
    size, write_peft_adapter, tiny_spec
):
    """``fully_sharded_loras``: every module's A columns and Bt columns each in exactly one section (KV heads aside,
    replicated with the base), so a device holds 1/N of a row; the shards' shrinks summed (the one all-reduce), then
    each shard's expand, give PEFT's delta."""
    folder, _ = write_peft_adapter(**ALL_LINEAR_RSLORA)
    tp = TensorParallel(size, fully_sharded_loras=True)
    whole = AdapterRegistry(tiny_spec, RegistryConfig(rows=RowOptions(max_rank=8)))
    sharded = AdapterRegistry(
        tiny_spec,
        RegistryConfig(rows=RowOptions(max_rank=8, tensor_parallel=TensorParallel(size, fully_sharded_loras=True))),
    )
    reference, ours = (r.register(str(folder), adapter_id="a") and r.prepared("a") for r in (whole, sharded))
    layout = RowLayout.of(tiny_spec, tp)
    kv_copies = max(1, size // tiny_spec.num_kv_heads)
    kv_out = tiny_spec.projection_shape("k_proj")[1]
    unsharded = RowLayout.of(tiny_spec).width + 2 * tiny_spec.num_layers * kv_out * (kv_copies - 1)  # KV copies aside
    assert layout.width == unsharded and ours.storage.shape == (reference.rows, size, layout.section_width)
    for key, weights in reference.modules.items():
        a, bt = ours.modules[key].a, ours.modules[key].bt  # [r, S, in_s], [r, S, out_s]
        assert torch.equal(torch.cat(a.unbind(1), dim=1), weights.a), key  # A: every input feature once
        joined = torch.cat(bt.unbind(1), dim=1)
        if key.proj in ("k_proj", "v_proj") and kv_copies > 1:
            joined = joined.view(reference.rows, tiny_spec.num_kv_heads, kv_copies, -1)[:, :, 0]
        assert torch.equal(joined.reshape(reference.rows, -1), weights.bt), key
        fan_in = weights.a.shape[1]
        x = torch.randn(3, fan_in)
        h = sum(x[:, tp.lora_in_index(tiny_spec, key.proj, s)] @ a[:, s].T for s in range(size))  # all-reduced
        for s in range(size):
            out = tp.lora_out_index(tiny_spec, key.proj, s)
            torch.testing.assert_close(h @ bt[:, s], (x @ weights.a.T @ weights.bt)[:, out], atol=1e-5, rtol=1e-5)


def test_a_sharded_pool_loads_blocks_and_hands_out_sectioned_views(write_peft_adapter, tiny_spec):
    folder, _ = write_peft_adapter(**ALL_LINEAR_RSLORA)
    registry = AdapterRegistry(
        tiny_spec, RegistryConfig(rows=RowOptions(max_rank=8, tensor_parallel=TensorParallel(2)))
    )
    registry.register(str(folder), adapter_id="a")
    prepared = registry.prepared("a")
    pool = SlotPool(
        tiny_spec, SlotPoolConfig(max_slots=2, rows=RowOptions(max_rank=8, tensor_parallel=TensorParallel(2)))
    )
    pool.load(1, prepared)
    start = pool.granule
    for key, weights in prepared.modules.items():
        stacks = pool.stacks[key]
        assert stacks.a.shape[1:] == weights.a.shape[1:] and stacks.bt.shape[1:] == weights.bt.shape[1:]
        assert torch.equal(stacks.a[start : start + prepared.rows], weights.a)
        assert torch.equal(stacks.bt[start : start + prepared.rows], weights.bt)
    assert pool.section_nbytes * 2 == pool.nbytes == bytes_needed(tiny_spec, pool.num_rows, torch.float32, 2)
    assert pool.tensor_parallel == TensorParallel(2) and pool.stacks[key].a.shape[:2] == (pool.num_rows, 2)
    with pytest.raises(Exception, match="rows of"):
        SlotPool(tiny_spec, SlotPoolConfig(max_slots=2, rows=RowOptions(max_rank=8))).load(
            0, prepared
        )  # an unsharded pool refuses


def test_a_cpu_pool_over_shards_is_shared_memory_another_mapping_sees_each_load_in(write_peft_adapter, tiny_spec):
    """One process per shard on CPU: every shard maps the pool's rows (`SlotPool.shared_rows`) and a load is one
    copy they all see; an unsharded pool's rows are its own."""
    folder, _ = write_peft_adapter(**ALL_LINEAR_RSLORA)
    registry = AdapterRegistry(
        tiny_spec, RegistryConfig(rows=RowOptions(max_rank=8, tensor_parallel=TensorParallel(2)))
    )
    registry.register(str(folder), adapter_id="a")
    pool = SlotPool(
        tiny_spec, SlotPoolConfig(max_slots=2, rows=RowOptions(max_rank=8, tensor_parallel=TensorParallel(2)))
    )
    assert pool.shared_rows is not None
    other = map_shared(pool.shared_rows, tuple(pool.rows.shape), pool.dtype)  # another process's view of the rows
    assert other.data_ptr() != pool.rows.data_ptr() and not other.any()
    pool.load(1, registry.prepared("a"))
    assert pool.rows.any() and torch.equal(other, pool.rows)
    assert SlotPool(tiny_spec, SlotPoolConfig(max_slots=2, rows=RowOptions(max_rank=8))).shared_rows is None


def test_the_manager_prepares_loads_and_counts_one_swap_of_the_whole_sharded_block(write_peft_adapter, tiny_spec):
    folder, _ = write_peft_adapter(**ALL_LINEAR_RSLORA)
    config = AdapterManagerConfig(
        max_slots=2, rows=RowOptions(max_rank=8, tensor_parallel=TensorParallel(2)), prefetch_workers=0
    )
    with AdapterManager(tiny_spec, config) as manager:
        record = manager.register(str(folder), adapter_id="a").record
        lease = manager.acquire(["a"])
        prepared = manager.registry.prepared("a")
        layout = RowLayout.of(tiny_spec, TensorParallel(2))
        assert record.nbytes == prepared.nbytes == prepared.rows * layout.row_bytes(torch.float32)
        start = lease.slots["a"] * manager.granule
        for key, weights in prepared.modules.items():
            assert torch.equal(manager.stacks[key].bt[start : start + prepared.rows], weights.bt)  # [r, 2, out_s]
        moves = manager.metrics().moves[Move.HOST_TO_SLOT]
        assert moves.count == 1 and moves.total_bytes == prepared.nbytes  # every shard's section, one move
        assert manager.tensor_parallel_size == 2 and manager.pool_device_nbytes * 2 == manager.pool_nbytes
        manager.release(lease)
