"""The slot pool on the torch_xla CPU device: loads equal the prepared weights, and swapping never compiles (XLA lane).

A slot load is one graph whatever the slot and the adapter (device index tensor, fixed flat layout); the pool
compiles it once when made, so no load after that compiles anything.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.xla
torch_xla = pytest.importorskip("torch_xla")

import torch_xla.debug.metrics as metrics  # noqa: E402

from adapter_manager import BaseModelSpec, ModuleKey  # noqa: E402
from adapter_manager.errors import SlotLoadError  # noqa: E402
from adapter_manager.prepare import PreparedAdapter  # noqa: E402
from adapter_manager.slot_pool import SlotPool, SlotPoolConfig  # noqa: E402
from tests.adapter_manager.test_slot_pool import make_prepared  # noqa: E402

NUM_SLOTS, RANK = 4, 8


def compile_count() -> int:
    data = metrics.metric_data("CompileTime")
    return 0 if data is None else data[0]


def random_prepared(spec: BaseModelSpec, adapter_id: str, seed: int, modules: list[ModuleKey]) -> PreparedAdapter:
    """A prepared adapter over `modules` with random values in every A and Bt (catches any layout mix-up)."""
    prepared = make_prepared(spec, adapter_id, RANK, 0.0, modules)
    prepared.storage.copy_(torch.randn(prepared.storage.shape, generator=torch.Generator().manual_seed(seed)))
    return prepared


def assert_slot_holds(pool: SlotPool, slot: int, prepared: PreparedAdapter) -> None:
    for key, stacks in pool.stacks.items():
        a, bt = stacks.a.cpu()[slot], stacks.bt.cpu()[slot]
        weights = prepared.modules.get(key)
        if weights is None:
            assert not a.any() and not bt.any(), (prepared.adapter_id, key)
        else:
            assert torch.equal(a, weights.a) and torch.equal(bt, weights.bt), (prepared.adapter_id, key)


def test_swaps_compile_nothing_and_slots_equal_the_prepared_weights(tiny_spec):
    pool = SlotPool(tiny_spec, SlotPoolConfig(max_slots=NUM_SLOTS, max_rank=RANK, device=torch_xla.device()))
    made = compile_count()
    keys = tiny_spec.module_keys()
    gen = torch.Generator().manual_seed(0)
    resident: dict[int, PreparedAdapter] = {}
    for i in range(3 * NUM_SLOTS):  # every slot once, then different adapters into different slots
        slot = i if i < NUM_SLOTS else int(torch.randint(0, NUM_SLOTS, (1,), generator=gen))
        subset = [k for k in keys if torch.rand((), generator=gen) < 0.5] or keys[:1]
        resident[slot] = random_prepared(tiny_spec, f"adapter-{i}", seed=i, modules=subset)
        pool.load(slot, resident[slot])
    for slot, prepared in resident.items():
        assert_slot_holds(pool, slot, prepared)
    assert compile_count() == made, "a slot load compiled: the slot or the adapter is baked into the graph"


def test_a_refused_load_writes_nothing(tiny_spec):
    pool = SlotPool(tiny_spec, SlotPoolConfig(max_slots=2, max_rank=RANK, device=torch_xla.device()))
    good = random_prepared(tiny_spec, "good", seed=1, modules=tiny_spec.module_keys())
    pool.load(1, good)
    bad = make_prepared(tiny_spec, "bad", RANK, 1.0, [ModuleKey(0, "q_proj")])
    key = ModuleKey(0, "q_proj")
    weights = bad.modules[key]
    bad.modules[key] = type(weights)(a=weights.a[:, :-1], bt=weights.bt, rank=weights.rank)  # type: ignore[index]
    with pytest.raises(SlotLoadError, match="bad"):
        pool.load(1, bad)
    assert_slot_holds(pool, 1, good)
