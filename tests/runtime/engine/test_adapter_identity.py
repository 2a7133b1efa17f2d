"""An adapter is its content: a refresh of a local folder rewritten with other weights of the same size and the same
mtime (what ``cp -p``, ``rsync -a`` or ``tar x`` leave) is an update that drops the old prefix blocks, the same bytes
under another revision keep them, and a prefetch failure of an earlier registration never fails a request of the
next one."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from adapter_manager import AdapterConflictError
from adapter_manager.runtime.engine.sampling import SamplingParams
from tests._rewrite import keeping_size_and_mtime

BLOCK = 4
PROMPT = [5, 17, 3, 9, 60, 2, 41, 7, 8, 13, 22, 31, 4]  # 3 full blocks of 4 and one more token
PARAMS = SamplingParams(max_tokens=6, logprobs=1)


def rewrite_same_size_and_mtime(folder: Path) -> None:
    """Replace the folder's LoRA weights with other values of the same shapes and dtypes (so the same file size),
    keeping the old modification time."""
    weights = folder / "adapter_model.safetensors"
    with safe_open(weights, framework="pt") as handle:
        metadata = handle.metadata()
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    generator = torch.Generator().manual_seed(1234)
    tensors = {k: (t + 0.5 * torch.randn(t.shape, generator=generator, dtype=t.dtype)) for k, t in tensors.items()}
    with keeping_size_and_mtime(weights):
        save_file(tensors, weights, metadata=metadata)


def _serve(engine, prompt, adapter):
    handle = engine.submit(prompt, adapter, PARAMS)
    engine.run_until_idle(max_steps=200)
    return handle.result(timeout=0), [e.logprob for e in handle.logprobs]


def _tenant(make_engine, written, tmp_path, **engine_kwargs):
    """A copy of the "qv" adapter's folder registered as "tenant" on a fresh engine: (folder, engine, manager)."""
    folder = shutil.copytree(written["qv"][0], tmp_path / "tenant")
    engine, manager = make_engine(engine_kwargs=engine_kwargs, adapters=())
    manager.register(str(folder), adapter_id="tenant")
    return folder, engine, manager


def _fresh(make_engine, folder: Path):
    """The oracle: ``folder``'s weights served from nothing with the prefix cache off, (tokens, logprobs)."""
    engine, manager = make_engine(engine_kwargs={"prefix_caching": False}, adapters=())
    manager.register(str(folder), adapter_id="fresh")
    try:
        return _serve(engine, PROMPT, "fresh")
    finally:
        engine.close()
        manager.close()


def test_a_folder_rewritten_with_the_same_size_and_mtime_is_an_update(make_engine, written, tmp_path):
    folder, engine, manager = _tenant(make_engine, written, tmp_path, kv_block_size=BLOCK)
    old = _serve(engine, PROMPT, "tenant")
    assert engine.kv_metrics().blocks_cached >= 3
    old_digest = manager.record("tenant").digest

    rewrite_same_size_and_mtime(folder)
    result = manager.register(str(folder), adapter_id="tenant", refresh=True)
    assert result.action == "updated" and result.record.digest != old_digest
    assert engine.kv_metrics().prefix_dropped_blocks >= 3
    new = _serve(engine, PROMPT, "tenant")
    assert engine.kv_metrics().prefix_hit_tokens == 0  # the old weights' KV is never read
    engine.close()
    manager.close()

    # the oracle: the rewritten weights served from nothing, prefix cache off
    fresh = _fresh(make_engine, folder)
    assert new[0] == fresh[0] and new[1] == pytest.approx(fresh[1], abs=1e-5)
    assert new[1] != pytest.approx(old[1], abs=1e-5)


def test_the_same_bytes_elsewhere_keep_their_blocks_and_a_changed_folder_is_refused(make_engine, written, tmp_path):
    folder, engine, manager = _tenant(make_engine, written, tmp_path, kv_block_size=BLOCK)
    first = _serve(engine, PROMPT, "tenant")
    digest = manager.record("tenant").digest

    # new modification times, the same bytes: the same adapter, its cached blocks stay
    os.utime(folder / "adapter_model.safetensors", ns=(1, 1))
    assert manager.register(str(folder), adapter_id="tenant", refresh=True).action == "unchanged"
    assert manager.record("tenant").digest == digest
    assert engine.kv_metrics().prefix_dropped_blocks == 0
    second = _serve(engine, PROMPT, "tenant")
    assert engine.kv_metrics().prefix_hit_tokens == 3 * BLOCK and second == first

    # rewritten without a refresh: a preparation from the changed folder is refused, never served as the old adapter
    rewrite_same_size_and_mtime(folder)
    manager.allocator.forget("tenant")  # out of its slot and the host tier: the next request prepares it again
    manager.registry.host.discard(("tenant", digest))
    handle = engine.submit(PROMPT, "tenant", PARAMS)
    engine.run_until_idle(max_steps=200)
    with pytest.raises(Exception, match="changed since registration"):
        handle.result(timeout=0)
    engine.close()
    manager.close()


def test_a_prefetch_failure_of_an_earlier_registration_fails_no_request(make_engine, written, expected):
    prompt, name = next((p, n) for p, n in expected if n == "qv")
    engine, manager = make_engine(adapters=())
    manager.register(str(written["qv"][0]), adapter_id="u")
    waiting = engine.submit(list(prompt), "u", SamplingParams(max_tokens=4))  # its prefetch starts at submit
    manager.prefetcher.wait(30)
    manager.unregister("u")
    engine.submit([1, 2, 3], None, SamplingParams(max_tokens=1))  # prefetches the queue: "u" is not registered
    manager.prefetcher.wait(30)
    assert "u" in manager.prefetcher.errors()  # recorded against the registration that is gone

    manager.register(str(written["qv"][0]), adapter_id="u")  # vLLM's unload + load, or load_inplace
    after = [engine.submit(list(prompt), "u", SamplingParams(max_tokens=len(expected[(prompt, name)]))) for _ in "ab"]
    engine.run_until_idle(max_steps=200)
    for handle in after:
        assert handle.result(timeout=0) == expected[(prompt, name)]
    assert waiting.result(timeout=0) == expected[(prompt, name)][:4]  # still waiting: served by the new registration
    engine.close()
    manager.close()


def test_a_request_generating_through_a_refresh_to_new_content_fails_typed_never_mixing(make_engine, written, tmp_path):
    folder, engine, manager = _tenant(make_engine, written, tmp_path)
    generating = engine.submit(PROMPT, "tenant", SamplingParams(max_tokens=12))
    unchanged = engine.submit(PROMPT, "tenant", SamplingParams(max_tokens=12))
    while generating.num_tokens < 3 or unchanged.num_tokens < 1:
        engine.step()
    os.utime(folder / "adapter_model.safetensors", ns=(2, 2))  # the same bytes: nothing ends
    assert manager.register(str(folder), adapter_id="tenant", refresh=True).action == "unchanged"
    engine.step()
    assert not generating.done
    rewrite_same_size_and_mtime(folder)
    assert manager.register(str(folder), adapter_id="tenant", refresh=True).action == "updated"
    after = engine.submit(PROMPT, "tenant", PARAMS)
    engine.run_until_idle(max_steps=200)
    for handle in (generating, unchanged):  # both had tokens of the old content: they end, typed
        with pytest.raises(Exception, match="updated to new content while this request was generating"):
            handle.result(timeout=0)
        assert isinstance(handle._request.error, AdapterConflictError)  # noqa: SLF001
    engine.close()
    manager.close()
    assert after.result(timeout=0) == _fresh(make_engine, folder)[0]


def test_a_request_admitted_while_a_refresh_is_half_applied_keeps_its_slots_content(make_engine, written, tmp_path):
    """The soak's wrong-version answer: a refresh publishes the new record before the old slot goes, so a request
    admitted in between computes with the old slot. Its content is the slot's, so it ends typed, never mixing."""
    folder, engine, manager = _tenant(make_engine, written, tmp_path)
    old = engine.submit(PROMPT, "tenant", SamplingParams(max_tokens=3))
    engine.run_until_idle(max_steps=50)
    rewrite_same_size_and_mtime(folder)
    # the manager's update, step by step (manager.register runs these three in a row): the record first ...
    assert manager.registry.register(str(folder), "tenant", refresh=True).action == "updated"
    window = engine.submit(PROMPT, "tenant", SamplingParams(max_tokens=12))
    while window.num_tokens < 2:  # ... a request admitted now runs on the old slot ...
        engine.step()
    manager.allocator.forget("tenant")  # ... then the old slot and the old prefix blocks go
    manager._retired("tenant")  # noqa: SLF001
    after = engine.submit(PROMPT, "tenant", PARAMS)
    engine.run_until_idle(max_steps=200)
    tokens = window._request.output  # noqa: SLF001
    assert len(tokens) >= 2 and old.result(timeout=0)[: len(tokens)] == tokens  # the old content's, every one
    with pytest.raises(Exception, match="updated to new content while this request was generating"):
        window.result(timeout=0)
    engine.close()
    manager.close()
    assert after.result(timeout=0) == _fresh(make_engine, folder)[0]  # served whole on the new content
