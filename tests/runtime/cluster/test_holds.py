"""The replica's counted pins: Serve's loaded model and each in-flight request hold an adapter pinned; the first hold
pins it, the last drop unpins it, and a hold whose pin fails holds nothing."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import pytest

pytest.importorskip("ray.serve", reason="the cluster extra (ray[serve]) is not installed")

from adapter_manager import (  # noqa: E402
    AdapterManager,
    AdapterManagerConfig,
    RowOptions,
    SlotsExhaustedError,
    write_synthetic_adapter,
)
from adapter_manager.runtime.cluster.holds import Holds, Resident  # noqa: E402


def test_first_hold_pins_last_drop_unpins_and_a_failed_pin_holds_nothing(tiny_spec, tmp_path):
    manager = AdapterManager(tiny_spec, AdapterManagerConfig(max_slots=1, rows=RowOptions(max_rank=8)))
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


def test_a_view_never_sees_an_unload_half_done(tiny_spec, tmp_path):
    """Serve unloads a model on an executor thread while the replica reports: every view of the pool's pins, Serve's
    loaded models and the holds must agree (a pin without its hold failed the cluster test once)."""
    manager = AdapterManager(tiny_spec, AdapterManagerConfig(max_slots=4, rows=RowOptions(max_rank=8)))
    names = ("a", "b", "c")
    for i, name in enumerate(names):
        write_synthetic_adapter(tmp_path / name, tiny_spec, r=8, lora_alpha=8, seed=i)
        manager.register(str(tmp_path / name), adapter_id=name)

    async def pin(adapter_id: str) -> None:
        manager.pin(adapter_id)

    holds, loaded = Holds(manager, pin), {}

    def _unload(residents: list[Resident]) -> None:
        for resident in residents:
            time.sleep(1e-4)  # the reports are being taken meanwhile
            resident.__del__()  # as Serve's LRU unload calls it, on an executor thread

    def read() -> tuple[set[str], set[str]]:
        return {s.adapter_id for s in manager.allocator.states() if s.manual}, set(loaded)

    async def run() -> int:
        views = 0
        for turn in range(60):
            residents = []
            for name in names:
                await holds.hold(name)
                residents.append(Resident(loaded, holds, name))
            unload = threading.Thread(target=_unload, args=(residents,))
            unload.start()
            while unload.is_alive() or views < 20 * (turn + 1):
                counts, (pinned, seen) = holds.view(read)
                assert set(counts) == pinned == seen and set(counts.values()) <= {1}, (counts, pinned, seen)
                views += 1
            unload.join()
            assert holds.counts() == {} and loaded == {} and read() == (set(), set())
        return views

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch every few bytecodes, so an unload lands between any two reads
    try:
        assert asyncio.run(run()) >= 1200
    finally:
        sys.setswitchinterval(interval)
    manager.close()
