"""The engine with popularity-aware tiers: per-adapter request counts come from `submit`, a hot adapter stays in
its slot through a burst of cold ones, and every output still equals PEFT's."""

from __future__ import annotations

from adapter_manager.runtime.engine.sampling import SamplingParams
from tests.runtime._oracle import ADAPTERS
from tests.runtime._oracle import ENGINE_NEW_TOKENS as NEW_TOKENS

PROMPT = [3, 1, 4, 1, 5]


def test_hot_adapter_survives_a_cold_burst_and_outputs_match_peft(expected, make_engine):
    engine, manager = make_engine(max_slots=2, max_batch=1, prefetch_workers=0)
    hot, *cold = list(ADAPTERS)
    requests = [hot] * 6 + cold + [hot] * 2  # one request at a time (max_batch 1), two slots
    handles = [engine.submit(PROMPT, name, SamplingParams(max_tokens=NEW_TOKENS)) for name in requests]
    resident_hot = []
    while engine.has_work:
        engine.step()
        resident_hot.append(manager.allocator.slot_of(hot) is not None)
    for handle, name in zip(handles, requests, strict=True):
        assert handle.result(timeout=0) == expected[(tuple(PROMPT), name)], name
    snapshot = manager.metrics()
    assert snapshot.requests == {hot: 8} | dict.fromkeys(cold, 1)
    assert all(resident_hot[resident_hot.index(True) :])  # from its first load on, the cold burst never evicts it
    assert snapshot.moves["host_to_slot"].count == 1 + len(cold)  # the hot adapter loaded once
    manager.close()
