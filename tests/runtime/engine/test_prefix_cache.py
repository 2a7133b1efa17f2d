"""The paged KV cache and the prefix cache in the engine: every output with the prefix cache on equals the output
with it off (greedy tokens, logprobs within 1e-5) — across adapters sharing a prefix text (which must not share
blocks), a refresh to a new revision, preemption and recompute, and a sweep of prompt lengths around block
boundaries — and preempted requests still equal HF + PEFT."""

from __future__ import annotations

import shutil

import pytest

from adapter_manager.runtime.engine.kv_space import block_bytes
from adapter_manager.runtime.engine.sampling import SamplingParams

BLOCK = 4
PREFIX = [5, 17, 3, 9, 60, 2, 41, 7, 8, 13, 22, 31, 4]  # 13 tokens: 3 full blocks of 4, and one more token
TAILS = [[1, 2, 3], [9], [40, 41, 42, 43, 44]]
PARAMS = SamplingParams(max_tokens=5, logprobs=2)


def _serve(make_engine, requests, caching: bool, **kwargs):
    """Serve ``requests`` one after another (each sees what the earlier ones cached); returns per request (tokens,
    logprobs) and the engine's KV metrics."""
    engine, manager = make_engine(engine_kwargs={"kv_block_size": BLOCK, "prefix_caching": caching}, **kwargs)
    out = []
    for prompt, adapter in requests:
        handle = engine.submit(prompt, adapter, PARAMS)
        engine.run_until_idle(max_steps=200)
        out.append((handle.result(timeout=0), [e.logprob for e in handle.logprobs]))
    metrics = engine.kv_metrics()
    engine.close()
    manager.close()
    return out, metrics


def _assert_same(on, off) -> None:
    for (tokens_on, logprobs_on), (tokens_off, logprobs_off) in zip(on, off, strict=True):
        assert tokens_on == tokens_off
        assert logprobs_on == pytest.approx(logprobs_off, abs=1e-5)


def test_prefix_hits_equal_recompute_and_adapters_never_share_blocks(make_engine):
    requests = [(PREFIX + tail, adapter) for adapter in ("qv", "all_rslora", None) for tail in TAILS]
    on, metrics = _serve(make_engine, requests, caching=True)
    off, metrics_off = _serve(make_engine, requests, caching=False)
    _assert_same(on, off)
    # per namespace the first request computes everything, the next two find PREFIX's 3 full blocks cached: the
    # same text under another adapter (or the base model) never hits the first one's blocks
    assert metrics.prefix_hit_tokens == 3 * 2 * 3 * BLOCK and metrics.prefix_hit_requests == 3 * 2
    assert metrics.prefix_queried_requests == 9 and 0 < metrics.prefix_hit_rate < 1
    assert metrics_off.prefix_hit_tokens == 0 and metrics_off.blocks_cached == 0
    assert metrics.blocks_used == 0 and metrics.blocks_free == metrics.blocks_total  # all released, cached kept
    assert metrics.blocks_cached > 0


def test_a_refresh_to_a_new_revision_drops_the_adapters_blocks(make_engine, written, tmp_path):
    folder = tmp_path / "tenant"
    shutil.copytree(written["qv"][0], folder)
    engine, manager = make_engine(engine_kwargs={"kv_block_size": BLOCK}, adapters=())
    manager.register(str(folder), adapter_id="tenant")
    first = engine.submit(PREFIX + TAILS[0], "tenant", PARAMS)
    engine.run_until_idle(max_steps=200)
    assert engine.kv_metrics().blocks_cached > 0
    shutil.rmtree(folder)
    shutil.copytree(written["all_rslora"][0], folder)  # a new revision in place: other weights, another sha
    assert manager.register(str(folder), adapter_id="tenant", refresh=True).action == "updated"
    assert engine.kv_metrics().prefix_dropped_blocks >= 3
    second = engine.submit(PREFIX + TAILS[0], "tenant", PARAMS)
    engine.run_until_idle(max_steps=200)
    assert engine.kv_metrics().prefix_hit_tokens == 0  # the stale prefix is never read
    assert [e.logprob for e in second.logprobs] != [e.logprob for e in first.logprobs]
    engine.close()
    manager.close()
    fresh, _ = _serve(make_engine, [(PREFIX + TAILS[0], "all_rslora")], caching=False)
    assert second.result(timeout=0) == fresh[0][0]
    assert [e.logprob for e in second.logprobs] == pytest.approx(fresh[0][1], abs=1e-5)


def test_unregistering_drops_the_adapters_blocks_and_keeps_the_others(make_engine):
    engine, manager = make_engine(engine_kwargs={"kv_block_size": BLOCK})
    for adapter in ("qv", None):
        engine.submit(PREFIX + TAILS[0], adapter, PARAMS)
    engine.run_until_idle(max_steps=200)
    cached = engine.kv_metrics().blocks_cached
    manager.unregister("qv")
    metrics = engine.kv_metrics()
    assert metrics.prefix_dropped_blocks > 0 and metrics.blocks_cached == cached - metrics.prefix_dropped_blocks
    engine.submit(PREFIX + TAILS[1], None, PARAMS)
    engine.run_until_idle(max_steps=200)
    assert engine.kv_metrics().prefix_hit_tokens == 3 * BLOCK  # the base model's blocks were kept
    engine.close()
    manager.close()


@pytest.mark.parametrize("length", [BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK - 1, 2 * BLOCK, 2 * BLOCK + 1, 3 * BLOCK])
def test_block_boundary_sweep(make_engine, length):
    """A prompt of ``length`` tokens after another one sharing it whole (and one sharing all but its last token):
    a full cached prompt still computes its last token; outputs equal recompute."""
    prompt = (PREFIX * 2)[:length]
    requests = [(prompt, "patterns"), (prompt, "patterns"), (prompt[:-1] + [59], "patterns"), (prompt + [1], None)]
    on, metrics = _serve(make_engine, requests, caching=True)
    off, _ = _serve(make_engine, requests, caching=False)
    _assert_same(on, off)
    assert metrics.prefix_hit_tokens == (length - 1) // BLOCK * BLOCK + (length - 1) // BLOCK * BLOCK


def test_preempted_requests_recompute_and_equal_peft(make_engine, written, expected):
    """A pool of 16 blocks of 4 tokens (one max_seq_len sequence) for up to 8 sequences of up to 15 tokens: the
    newest running requests are preempted when the others grow, wait, recompute their prompt and the output they
    had, and still equal HF + PEFT; with the prefix cache on their recompute reuses their own blocks."""
    from tests.runtime._oracle import ENGINE_NEW_TOKENS, ENGINE_REQUESTS

    for caching in (True, False):
        engine, manager = make_engine(max_slots=4, token_budget=64)
        per_block = block_bytes(engine.model.config, engine.model.dtype, BLOCK)
        engine.close()
        manager.close()
        engine, manager = make_engine(
            max_slots=4,
            token_budget=64,
            max_batch=8,
            engine_kwargs={"kv_block_size": BLOCK, "kv_cache_bytes": 16 * per_block, "prefix_caching": caching},
        )
        params = SamplingParams(max_tokens=ENGINE_NEW_TOKENS)
        handles = [engine.submit(p, a, params) for p, a in ENGINE_REQUESTS]
        engine.run_until_idle(max_steps=2000)
        for handle, (prompt, name) in zip(handles, ENGINE_REQUESTS, strict=True):
            assert handle.result(timeout=0) == expected[(tuple(prompt), name)], (prompt, name, caching)
        metrics = engine.kv_metrics()
        assert metrics.preemptions > 0, "the pool is small enough that running requests must give way"
        assert metrics.blocks_used == 0
        engine.close()
        manager.close()
