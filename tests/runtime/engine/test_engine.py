"""The engine end to end on the tiny model: continuous batching with more adapters than slots, against PEFT."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from adapter_manager import AdapterNotFoundError
from adapter_manager.runtime.engine import Engine, EngineConfig
from adapter_manager.runtime.engine.request import RequestFailedError
from adapter_manager.runtime.engine.sampling import SamplingParams
from tests.runtime._oracle import ADAPTERS, ENGINE_REQUESTS, ROWS
from tests.runtime._oracle import ENGINE_NEW_TOKENS as NEW_TOKENS


def test_many_adapters_few_slots_match_peft(expected, make_engine):
    engine, manager = make_engine()
    handles = [engine.submit(p, a, SamplingParams(max_tokens=NEW_TOKENS)) for p, a in ENGINE_REQUESTS]
    steps = engine.run_until_idle(max_steps=500)
    for handle, (prompt, name) in zip(handles, ENGINE_REQUESTS, strict=True):
        assert handle.result(timeout=0) == expected[(tuple(prompt), name)], (prompt, name)
        assert handle.finish_reason == "length"
    snapshot = manager.metrics()
    assert snapshot.moves["host_to_slot"].count >= len(ADAPTERS)  # 5 adapters through 2 slots: swaps happened
    assert steps < 500
    manager.close()


def test_unknown_adapter_and_bad_prompts_are_refused_at_submit(make_engine):
    engine, manager = make_engine()
    with pytest.raises(AdapterNotFoundError):
        engine.submit([1, 2], "nope")
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.submit([1] * 60, None, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="token ids"):
        engine.submit([10_000], None)
    manager.close()


def test_a_failing_adapter_fails_alone(written, tmp_path, expected, make_engine):
    broken = tmp_path / "broken"
    shutil.copytree(written["qv"][0], broken)
    engine, manager = make_engine()
    manager.register(str(broken), adapter_id="broken")
    manager.registry.host.discard(("broken", manager.registry.get("broken").digest))
    (broken / "adapter_model.safetensors").write_bytes(b"garbage")
    bad = engine.submit([1, 2, 3], "broken", SamplingParams(max_tokens=3))
    good = [engine.submit(p, a, SamplingParams(max_tokens=NEW_TOKENS)) for p, a in ROWS[:4]]
    engine.run_until_idle(max_steps=200)
    with pytest.raises(RequestFailedError):
        bad.result(timeout=0)
    assert bad.finish_reason == "error"
    for handle, (prompt, name) in zip(good, ROWS[:4], strict=True):
        assert handle.result(timeout=0) == expected[(tuple(prompt), name)]
    manager.close()


def test_seeded_sampling_is_reproducible_and_streams(make_engine):
    engine, manager = make_engine()
    params = SamplingParams(max_tokens=8, temperature=1.5, top_p=0.9, seed=7)
    first = engine.submit([5, 6, 7], "qv", params)
    second = engine.submit([5, 6, 7], "qv", params)
    other = engine.submit([5, 6, 7], "qv", SamplingParams(max_tokens=8, temperature=1.5, top_p=0.9, seed=8))
    engine.start()
    try:
        streamed = list(first.stream(timeout=60))
        assert streamed == first.result(timeout=60) == second.result(timeout=60)
        assert other.result(timeout=60) != streamed
    finally:
        engine.stop()
        manager.close()


def test_stop_ids_end_a_request(expected, make_engine):
    engine, manager = make_engine()
    prompt, name = ROWS[0]
    stop = expected[(tuple(prompt), name)][2]
    handle = engine.submit(prompt, name, SamplingParams(max_tokens=NEW_TOKENS, stop_ids=(stop,)))
    engine.run_until_idle(max_steps=100)
    out = handle.result(timeout=0)
    assert out[-1] == stop and handle.finish_reason == "stop"
    assert out == expected[(tuple(prompt), name)][: out.index(stop) + 1]
    manager.close()


@pytest.mark.parametrize("where", ["generation_config", "config", "engine_config"])
def test_requests_stop_at_the_checkpoints_eos_by_default(written, expected, tmp_path, where, make_engine):
    """A Python-API user gets the checkpoint's eos ids without passing stop_ids; ignore_eos runs on to max_tokens."""
    prompt, name = ROWS[0]
    full = expected[(tuple(prompt), name)]
    eos = full[2]
    checkpoint = tmp_path / "base"
    shutil.copytree(written[None][0], checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config["eos_token_id"] = [eos, 63] if where == "config" else 63
    (checkpoint / "config.json").write_text(json.dumps(config))
    generation = checkpoint / "generation_config.json"
    if where == "generation_config":
        generation.write_text(json.dumps({"eos_token_id": [63, eos]}))  # wins over config.json's
    else:
        generation.unlink(missing_ok=True)
    engine, manager = make_engine(checkpoint=checkpoint, eos_ids=(eos,) if where == "engine_config" else None)
    stopped = engine.submit(prompt, name, SamplingParams(max_tokens=NEW_TOKENS))
    ignoring = engine.submit(prompt, name, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    engine.run_until_idle(max_steps=100)
    assert stopped.result(timeout=0) == full[: full.index(eos) + 1] and stopped.finish_reason == "stop"
    assert ignoring.result(timeout=0) == full and ignoring.finish_reason == "length"
    manager.close()


def test_cancel_frees_the_request_and_the_engine_restarts(make_engine):
    engine, manager = make_engine(max_batch=2)
    long = engine.submit([1, 2, 3], "qv", SamplingParams(max_tokens=40))
    waiting = engine.submit([4, 5], None, SamplingParams(max_tokens=40))
    queued = engine.submit([6], "spare", SamplingParams(max_tokens=2))
    for _ in range(3):
        engine.step()
    long.cancel()
    waiting.cancel()
    engine.step()
    assert long.done and long.finish_reason == "cancelled" and 0 < len(long.result(timeout=0)) < 40
    assert waiting.finish_reason == "cancelled"
    engine.start()
    engine.stop()
    engine.start()  # a stopped engine starts again
    try:
        assert len(queued.result(timeout=60)) == 2
    finally:
        engine.stop()
        manager.close()


def test_handle_reports_first_token_time_and_tokens_so_far(make_engine):
    """Read from this thread while the engine steps in its own: no first-token time and no tokens before the first
    token, then a perf_counter timestamp taken between submit and that token's arrival, and the count so far."""
    engine, manager = make_engine()
    submitted = time.perf_counter()
    handle = engine.submit([5, 6, 7], "qv", SamplingParams(max_tokens=6))
    assert handle.first_token_at is None and handle.num_tokens == 0
    engine.start()
    try:
        counts = []
        for _ in handle.stream(timeout=60):
            counts.append(handle.num_tokens)
            if len(counts) == 1:
                first_seen = time.perf_counter()
                assert handle.first_token_at is not None and submitted < handle.first_token_at <= first_seen
        assert all(seen >= streamed for streamed, seen in enumerate(counts, 1)), counts
        assert handle.num_tokens == len(handle.result(timeout=60)) == 6
        assert submitted < handle.first_token_at <= first_seen  # set once, by the first token
    finally:
        engine.stop()
        manager.close()


def test_a_closed_engine_stops_listening_to_the_prefetcher(make_engine):
    """An engine registers a listener with the manager's prefetcher; close() takes it back, so an engine nobody uses
    is neither called nor kept alive by a manager that outlives it."""
    import gc
    import weakref

    engine, manager = make_engine()
    try:
        model = engine.model
        engine.close()
        gone = weakref.ref(engine)
        del engine
        gc.collect()
        assert gone() is None  # nothing of the manager's still refers to it
        second = Engine(model, manager, EngineConfig(max_batch=2, max_seq_len=64))
        second.close()
        second.close()  # closing twice is harmless
    finally:
        manager.close()
