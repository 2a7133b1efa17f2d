"""The slot pool on CPU: sizing, in-place loads equal to the prepared weights, untargeted modules zeroed, refusals."""

from __future__ import annotations

import pytest
import torch

from adapter_manager import AdapterRegistry, BaseModelSpec, ModuleKey, RegistryConfig, write_synthetic_adapter
from adapter_manager.errors import SlotLoadError
from adapter_manager.prepare import ModuleWeights, PreparedAdapter
from adapter_manager.slot_pool import SlotPool, SlotPoolConfig, bytes_needed, slots_for_budget


def make_prepared(
    spec: BaseModelSpec,
    adapter_id: str,
    max_rank: int,
    value: float,
    modules: list[ModuleKey] | None = None,
    dtype: torch.dtype = torch.float32,
) -> PreparedAdapter:
    """An in-memory prepared adapter whose A rows are `value` and Bt rows `-value` (cheap to build and to check)."""
    modules = spec.module_keys() if modules is None else modules
    sizes = [max_rank * sum(spec.projection_shape(m.proj)) for m in modules]
    storage = torch.empty(sum(sizes), dtype=dtype)
    weights, offset = {}, 0
    for module, size in zip(modules, sizes, strict=True):
        fan_in, fan_out = spec.projection_shape(module.proj)
        a = storage[offset : offset + max_rank * fan_in].view(max_rank, fan_in).fill_(value)
        bt = storage[offset + max_rank * fan_in : offset + size].view(max_rank, fan_out).fill_(-value)
        weights[module] = ModuleWeights(a=a, bt=bt, rank=max_rank)
        offset += size
    return PreparedAdapter(adapter_id, f"sha-{adapter_id}", max_rank, weights, storage)


def test_bytes_needed_matches_the_allocated_stacks(tiny_spec):
    pool = SlotPool(tiny_spec, SlotPoolConfig(max_slots=3, max_rank=4, dtype=torch.bfloat16))
    allocated = sum(s.a.nbytes + s.bt.nbytes for s in pool.stacks.values())
    assert pool.nbytes == allocated == bytes_needed(tiny_spec, 3, 4, torch.bfloat16)
    assert pool.slot_nbytes * 3 == allocated
    assert len(pool.stacks) == tiny_spec.num_layers * 7
    stacks = pool.stacks[ModuleKey(0, "k_proj")]
    assert stacks.a.shape == (3, 4, 32) and stacks.bt.shape == (3, 4, 16)
    assert stacks.a.dtype == torch.bfloat16 and not stacks.a.any()


def test_auto_sizing_from_a_budget(tiny_spec):
    per_slot = bytes_needed(tiny_spec, 1, 8, torch.float32)
    assert slots_for_budget(tiny_spec, 5 * per_slot + per_slot // 2, 8, torch.float32) == 5
    config = SlotPoolConfig(max_slots="auto", max_rank=8, memory_budget_bytes=3 * per_slot)
    assert SlotPool(tiny_spec, config).num_slots == 3
    with pytest.raises(ValueError, match="smaller than one slot"):
        SlotPool(tiny_spec, SlotPoolConfig(max_slots="auto", max_rank=8, memory_budget_bytes=per_slot - 1))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_slots": 0}, "max_slots must be a positive int or 'auto', got 0"),
        ({"max_slots": "auto"}, "needs a positive memory_budget_bytes, got None"),
        ({"max_rank": -2}, "max_rank must be a positive int, got -2"),
        ({"dtype": torch.int32}, "floating point dtype, got torch.int32"),
        ({"device": "meta"}, "device must be cpu, cuda or xla, got meta"),
    ],
)
def test_config_validation_shows_the_offending_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SlotPoolConfig(**kwargs)


def test_load_copies_prepared_weights_and_zeroes_untargeted_modules(tmp_path, tiny_spec):
    registry = AdapterRegistry(tiny_spec, RegistryConfig(max_rank=8))
    full = write_synthetic_adapter(tmp_path / "full", tiny_spec, r=8, seed=1)
    partial = write_synthetic_adapter(tmp_path / "partial", tiny_spec, r=4, target_modules=["q_proj", "down_proj"])
    registry.register(str(full))
    registry.register(str(partial))
    pool = SlotPool(tiny_spec, SlotPoolConfig(max_slots=2, max_rank=8))
    pool.load(1, registry.prepared("full"))
    pool.load(1, registry.prepared("partial"))  # overwrites in place: modules "full" targeted must become zero
    prepared = registry.prepared("partial")
    identities = {key: (s.a.data_ptr(), s.bt.data_ptr()) for key, s in pool.stacks.items()}
    for key, stacks in pool.stacks.items():
        weights = prepared.modules.get(key)
        if weights is None:
            assert key.proj not in ("q_proj", "down_proj")
            assert not stacks.a[1].any() and not stacks.bt[1].any()
        else:
            assert torch.equal(stacks.a[1], weights.a) and torch.equal(stacks.bt[1], weights.bt)
            assert not stacks.a[1, 4:].any()  # rows past the true rank stay zero
        assert not stacks.a[0].any() and not stacks.bt[0].any()  # the other slot is untouched
    assert identities == {key: (s.a.data_ptr(), s.bt.data_ptr()) for key, s in pool.stacks.items()}


def test_load_refuses_a_mismatched_adapter_naming_it(tiny_spec):
    pool = SlotPool(tiny_spec, SlotPoolConfig(max_slots=2, max_rank=4))
    with pytest.raises(SlotLoadError, match="'wide'.*rank 8 in torch.float32, the pool holds rank 4"):
        pool.load(0, make_prepared(tiny_spec, "wide", 8, 1.0))
    with pytest.raises(SlotLoadError, match="'half'.*torch.float16"):
        pool.load(0, make_prepared(tiny_spec, "half", 4, 1.0, dtype=torch.float16))
    with pytest.raises(SlotLoadError, match="slot 2 is outside 0..1"):
        pool.load(2, make_prepared(tiny_spec, "ok", 4, 1.0))
    with pytest.raises(SlotLoadError, match="not in the base model"):
        pool.load(0, make_prepared(tiny_spec, "ghost", 4, 1.0, modules=[ModuleKey(99, "q_proj")]))


def test_a_bad_module_is_refused_before_anything_is_written(tiny_spec):
    pool = SlotPool(tiny_spec, SlotPoolConfig(max_slots=1, max_rank=4))
    prepared = make_prepared(tiny_spec, "broken", 4, 2.0)
    last = tiny_spec.module_keys()[-1]
    good = prepared.modules[last]
    bad = dict(prepared.modules)
    bad[last] = ModuleWeights(a=good.a[:, :-1], bt=good.bt, rank=4)
    broken = PreparedAdapter("broken", "x", 4, bad, prepared.storage)
    with pytest.raises(SlotLoadError, match=r"'broken'.*layers\.2\.mlp\.down_proj a has shape \[4, 47\]"):
        pool.load(0, broken)
    assert not any(s.a.any() or s.bt.any() for s in pool.stacks.values())
