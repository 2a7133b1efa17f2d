"""The row pool on CPU: sizing, units, loads that copy a block into exactly its rows, refusals before any write."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from adapter_manager import (
    AdapterRegistry,
    BaseModelSpec,
    ModuleKey,
    RegistryConfig,
    RowOptions,
    TensorParallel,
    write_synthetic_adapter,
)
from adapter_manager.errors import SlotLoadError
from adapter_manager.tiers.prepare import PreparedAdapter
from adapter_manager.tiers.row_layout import RowLayout
from adapter_manager.tiers.slot_pool import SlotPool, SlotPoolConfig, bytes_needed, units_for
from tests.adapter_manager._fakes import make_prepared

SENTINEL = 7.5


def sentinel_pool(spec: BaseModelSpec, **config) -> SlotPool:
    """A pool whose rows (all but the zero row) hold SENTINEL, so a write outside a block's rows shows."""
    pool = SlotPool(spec, SlotPoolConfig(**config))
    pool.rows[: pool.zero_row].fill_(SENTINEL)
    return pool


@pytest.mark.parametrize(
    ("rank", "granule", "units"),
    [(1, 8, 1), (8, 8, 1), (9, 8, 2), (16, 8, 2), (17, 8, 4), (32, 8, 4), (33, 8, 8), (1, 2, 1), (3, 2, 2), (5, 2, 4)],
)
def test_units_for_rounds_up_to_a_power_of_two(rank, granule, units):
    assert units_for(rank, granule) == units


def test_pool_size_granule_and_rows(tiny_spec):
    pool = SlotPool(tiny_spec, SlotPoolConfig(max_slots=3, rows=RowOptions(max_rank=4), dtype=torch.bfloat16))
    assert (pool.granule, pool.max_units, pool.num_units, pool.num_slots) == (4, 1, 3, 3)
    assert pool.num_rows == 13 and pool.zero_row == 12 and pool.rows.shape == (13, RowLayout.of(tiny_spec).width)
    vector_width = RowLayout.of(tiny_spec).vector_width  # a vector row per unit and the zero one: 4 of them
    assert pool.vectors is not None and pool.vectors.shape == (4, vector_width) and not pool.vectors.any()
    assert pool.nbytes == bytes_needed(tiny_spec, 13, torch.bfloat16) + 4 * vector_width * 2 and not pool.rows.any()
    assert pool.slot_nbytes == bytes_needed(tiny_spec, 4, torch.bfloat16)
    stacks = pool.stacks[ModuleKey(0, "k_proj")]
    assert stacks.a.shape == (13, 32) and stacks.bt.shape == (13, 16) and stacks.a.dtype == torch.bfloat16
    assert stacks.a.untyped_storage().data_ptr() == pool.rows.untyped_storage().data_ptr()  # views, no copies
    assert stacks.vector is not None and stacks.vector.shape == (4, 16)
    assert stacks.vector.untyped_storage().data_ptr() == pool.vectors.untyped_storage().data_ptr()
    plain = SlotPool(
        tiny_spec, SlotPoolConfig(max_slots=3, rows=RowOptions(max_rank=4, lora_vectors=False), dtype=torch.bfloat16)
    )
    assert plain.vectors is None and plain.stacks[ModuleKey(0, "k_proj")].vector is None
    assert plain.nbytes == bytes_needed(tiny_spec, 13, torch.bfloat16)
    assert len(pool.stacks) == tiny_spec.num_layers * 7
    vocab = SlotPool(
        tiny_spec, SlotPoolConfig(max_slots=3, rows=RowOptions(max_rank=4, lora_vocab=True))
    )  # V = 64, H = 32
    assert vocab.layout.width == pool.layout.width + 2 * (64 + 32) and vocab.layout.vocab
    embed, head = (vocab.stacks[ModuleKey.vocab(name)] for name in ("embed_tokens", "lm_head"))
    assert (embed.a.shape, embed.bt.shape, head.a.shape, head.bt.shape) == ((13, 64), (13, 32), (13, 32), (13, 64))
    assert embed.vector is None and vocab.nbytes == bytes_needed(tiny_spec, 13, torch.float32, vocab=True) + 4 * (
        vector_width * 4
    )
    with pytest.raises(ValueError, match="lora_vocab with tensor_parallel_size 2"):
        SlotPoolConfig(max_slots=2, rows=RowOptions(max_rank=4, tensor_parallel=TensorParallel(2), lora_vocab=True))
    wide = SlotPool(tiny_spec, SlotPoolConfig(max_slots=2, rows=RowOptions(max_rank=64)))
    assert (wide.granule, wide.max_units, wide.num_units, wide.num_slots, wide.num_rows) == (8, 8, 16, 16, 129)
    assert [wide.units_for(r) for r in (1, 8, 9, 24, 64)] == [1, 1, 2, 4, 8]


def test_auto_sizing_from_a_budget(tiny_spec):
    block = bytes_needed(tiny_spec, 16, torch.float32)  # one adapter at max_rank 16 (granule 8, 2 units)
    pool = SlotPool(
        tiny_spec,
        SlotPoolConfig(max_slots="auto", rows=RowOptions(max_rank=16), memory_budget_bytes=5 * block + block // 2),
    )
    assert pool.max_units == 2 and pool.num_units == 10 and pool.nbytes <= 5 * block + block // 2
    config = SlotPoolConfig(
        max_slots="auto", rows=RowOptions(max_rank=16), granule=4, memory_budget_bytes=3 * block + block // 2
    )
    assert config.max_units == 4 and config.resolve_units(config.rows.layout(tiny_spec)) == 12
    with pytest.raises(ValueError, match="smaller than one adapter at max_rank 16 in torch.float32"):
        SlotPool(
            tiny_spec, SlotPoolConfig(max_slots="auto", rows=RowOptions(max_rank=16), memory_budget_bytes=block - 1)
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_slots": 0}, "max_slots must be a positive int or 'auto', got 0"),
        ({"max_slots": True}, "max_slots must be a positive int or 'auto', got True"),
        ({"max_slots": "auto"}, "needs a positive memory_budget_bytes, got None"),
        ({"max_rank": -2}, "max_rank must be a positive int, got -2"),
        ({"max_rank": 8, "granule": 0}, r"granule must be an int in 1..max_rank \(8\), got 0"),
        ({"max_rank": 8, "granule": 16}, r"granule must be an int in 1..max_rank \(8\), got 16"),
        ({"dtype": torch.int32}, "floating point dtype, got torch.int32"),
        ({"device": "meta"}, "device must be cpu, cuda or xla, got meta"),
    ],
)
def test_config_validation_shows_the_offending_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        rank = {"rows": RowOptions(max_rank=kwargs["max_rank"])} if "max_rank" in kwargs else {}  # R is the rows'
        SlotPoolConfig(**{key: value for key, value in kwargs.items() if key != "max_rank"}, **rank)


@pytest.mark.parametrize(("slot", "rank"), [(0, 1), (2, 3), (4, 8), (6, 4), (7, 2), (7, 1)])
def test_load_copies_the_block_into_exactly_its_rows(tiny_spec, slot, rank):
    pool = sentinel_pool(tiny_spec, max_slots=2, rows=RowOptions(max_rank=8), granule=2)  # 8 units of 2 rows, 17 rows
    before = pool.rows.clone()
    prepared = make_prepared(tiny_spec, "a", rank, 3.0, tiny_spec.module_keys()[::3])
    pool.load(slot, prepared)
    start = slot * pool.granule
    assert torch.equal(pool.rows[start : start + rank], prepared.storage)
    outside = torch.ones(pool.num_rows, dtype=torch.bool)
    outside[start : start + rank] = False
    assert torch.equal(pool.rows[outside], before[outside])  # every other row untouched, the zero row zero
    assert not pool.rows[pool.zero_row].any()


def test_load_overwrites_in_place_and_module_views_equal_the_prepared_weights(tmp_path, tiny_spec):
    registry = AdapterRegistry(tiny_spec, RegistryConfig(rows=RowOptions(max_rank=8)))
    registry.register(str(write_synthetic_adapter(tmp_path / "full", tiny_spec, r=8, seed=1)))
    registry.register(
        str(write_synthetic_adapter(tmp_path / "partial", tiny_spec, r=4, target_modules=["q_proj", "down_proj"]))
    )
    pool = SlotPool(tiny_spec, SlotPoolConfig(max_slots=2, rows=RowOptions(max_rank=8), granule=4))
    identities = {key: (s.a.data_ptr(), s.bt.data_ptr()) for key, s in pool.stacks.items()}
    pool.load(2, registry.prepared("full"))
    pool.load(2, registry.prepared("partial"))  # rows 8-11: the modules "full" targeted must become zero
    partial, full = registry.prepared("partial"), registry.prepared("full")
    assert partial.rows == 4 and full.rows == 8
    for key, stacks in pool.stacks.items():
        weights = partial.modules.get(key)
        if weights is None:
            assert key.proj not in ("q_proj", "down_proj")
            assert not stacks.a[8:12].any() and not stacks.bt[8:12].any()
        else:
            assert torch.equal(stacks.a[8:12], weights.a) and torch.equal(stacks.bt[8:12], weights.bt)
        assert torch.equal(stacks.a[12:16], full.modules[key].a[4:8])  # rows past the new rank: not rewritten
        assert not stacks.a[:8].any() and not stacks.a[16:].any()
    assert identities == {key: (s.a.data_ptr(), s.bt.data_ptr()) for key, s in pool.stacks.items()}


def test_every_refusal_names_the_adapter_and_writes_nothing(tiny_spec):
    pool = sentinel_pool(tiny_spec, max_slots=2, rows=RowOptions(max_rank=4), granule=2)  # 4 units of 2 rows, 9 rows
    before = pool.rows.clone()
    ok = make_prepared(tiny_spec, "ok", 4, 1.0)
    too_narrow = PreparedAdapter("narrow", "x", {}, ok.storage[:, 1:])
    cases = [
        (make_prepared(tiny_spec, "wide", 8, 1.0), 0, "'wide'.*rank 8 is outside 1..max_rank 4"),
        (PreparedAdapter("empty", "x", {}, ok.storage[:0]), 0, "'empty'.*rank 0 is outside 1..max_rank 4"),
        (make_prepared(tiny_spec, "half", 4, 1.0, dtype=torch.float16), 0, r"'half'.*\[4, \d+\] torch.float16"),
        (too_narrow, 0, rf"'narrow'.*block is \[4, {pool.layout.width - 1}\].*rows of {pool.layout.width}"),
        (ok, 4, "'ok'.*slot 4 is outside 0..3"),
        (ok, -1, "'ok'.*slot -1 is outside 0..3"),
        (ok, 3, "'ok'.*rank 4 at slot 3 needs units up to 5, the pool has 4"),  # would run into the zero row
        (make_prepared(tiny_spec, "three", 3, 1.0), 3, "'three'.*rank 3 at slot 3 needs units up to 5"),
    ]
    for prepared, slot, message in cases:
        with pytest.raises(SlotLoadError, match=message):
            pool.load(slot, prepared)
        assert torch.equal(pool.rows, before), prepared.adapter_id


def test_a_variant_s_vector_row_goes_into_its_slot_s_vector_row_only(tmp_path, tiny_spec):
    """A LoRA-bias adapter's vector row lands in ``vectors[slot]`` (each module's piece ``s · b``), every other vector
    row untouched; a plain adapter loaded later into the same slot leaves it (the metadata never names it); a pool
    without vector rows, or of another dtype, refuses the variant before writing anything."""
    folder = write_synthetic_adapter(tmp_path / "bias", tiny_spec, r=4, lora_alpha=8, variant="lora_bias", seed=2)
    registry = AdapterRegistry(tiny_spec, RegistryConfig(rows=RowOptions(max_rank=4)))
    registry.register(str(folder), adapter_id="bias")
    prepared = registry.prepared("bias")
    assert prepared.vector is not None and prepared.nbytes == prepared.storage.numel() * 4 + prepared.vector.numel() * 4
    pool = SlotPool(tiny_spec, SlotPoolConfig(max_slots=3, rows=RowOptions(max_rank=4)))
    assert pool.vectors is not None
    pool.vectors[: pool.num_units].fill_(SENTINEL)
    pool.load(1, prepared)
    assert torch.equal(pool.vectors[1], prepared.vector)
    assert (pool.vectors[[0, 2]] == SENTINEL).all() and not pool.vectors[pool.num_units].any()  # the zero row stays
    key = ModuleKey(2, "v_proj")
    scaling = registry.get("bias").modules[key].scaling
    bias = load_file(folder / "adapter_model.safetensors")[f"base_model.model.{key.module_name}.lora_B.bias"]
    assert torch.allclose(pool.stacks[key].vector[1], scaling * bias)
    for config, match in (
        (SlotPoolConfig(max_slots=3, rows=RowOptions(max_rank=4, lora_vectors=False)), "the pool keeps none"),
        (SlotPoolConfig(max_slots=3, rows=RowOptions(max_rank=4), dtype=torch.bfloat16), "float32"),
    ):
        other = SlotPool(tiny_spec, config)
        block = prepared if config.dtype == torch.float32 else None
        if block is None:  # a bfloat16 block with a float32 vector row
            block = PreparedAdapter("bias", "x", {}, prepared.storage.bfloat16(), variant=prepared.variant,
                                    vector=prepared.vector)  # fmt: skip
        with pytest.raises(SlotLoadError, match=f"'bias'.*{match}"):
            other.load(0, block)
        assert not other.rows.any()
