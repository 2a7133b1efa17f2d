"""The replica's counted pins: Serve's loaded model and each in-flight request hold an adapter pinned; the first hold
pins it, the last drop unpins it, and a hold whose pin fails holds nothing."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray.serve", reason="the cluster extra (ray[serve]) is not installed")

from adapter_manager import (  # noqa: E402
    AdapterManager,
    AdapterManagerConfig,
    SlotsExhaustedError,
    write_synthetic_adapter,
)
from runtime.cluster.holds import Holds  # noqa: E402


def test_first_hold_pins_last_drop_unpins_and_a_failed_pin_holds_nothing(tiny_spec, tmp_path):
    manager = AdapterManager(tiny_spec, AdapterManagerConfig(max_slots=1, max_rank=8))
    for i, name in enumerate(("a", "b")):
        write_synthetic_adapter(tmp_path / name, tiny_spec, r=8, lora_alpha=8, seed=i)
        manager.register(str(tmp_path / name), adapter_id=name)
    pins: list[str] = []

    async def pin(adapter_id: str) -> None:
        pins.append(adapter_id)
        await asyncio.sleep(0.01)  # the replica's pin runs in an executor: others get to run meanwhile
        manager.pin(adapter_id)

    def pinned() -> set[str]:
        return {s.adapter_id for s in manager.allocator.states() if s.manual}

    holds = Holds(manager, pin)

    async def run() -> None:
        await asyncio.gather(holds.hold("a"), holds.hold("a"))  # Serve's load and a request, at once
        assert pins == ["a"] and holds.counts() == {"a": 2} and pinned() == {"a"}
        holds.drop("a")  # Serve unloaded it; the request still runs
        assert pinned() == {"a"}
        holds.drop("a")  # the response ended
        assert pinned() == set() and manager.allocator.slot_of("a") is not None  # resident, evictable
        await holds.hold("b")  # the one slot goes to b
        with pytest.raises(SlotsExhaustedError):
            await holds.hold("a")
        assert holds.counts() == {"b": 1} and pinned() == {"b"}
        holds.drop("b")
        await holds.hold("a")
        assert pinned() == {"a"}

    asyncio.run(run())
    manager.close()
