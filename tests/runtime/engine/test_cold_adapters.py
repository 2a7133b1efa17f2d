"""Cold adapters never stall the batch: real PEFT adapters on the local hub, a real HF cache. A request whose
adapter must be downloaded or prepared waits alone while the others keep generating one token per step (counted in
steps, never timed), then equals HF + PEFT; the bounded disk tier holds at every sampled moment, downloads in flight
included; and a prefetch that finds no room downloads and prepares nothing."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants as hf_constants
from huggingface_hub.file_download import repo_folder_name

from adapter_manager import AdapterManager, AdapterManagerConfig, HubConfig, HubFault, LocalHub, Move, RowOptions
from adapter_manager.runtime.engine.engine import Engine, EngineConfig
from adapter_manager.runtime.engine.sampling import SamplingParams
from adapter_manager.runtime.engine.scheduler import SchedulerConfig
from adapter_manager.runtime.model.checkpoint import load_model
from tests.conftest import TINY_NAME
from tests.runtime._oracle import ADAPTERS
from tests.runtime._oracle import ENGINE_NEW_TOKENS as NEW_TOKENS

FILES = ("adapter_config.json", "adapter_model.safetensors")
PROMPT = [3, 1, 4, 1, 5]
BASE_PROMPT = [2, 8, 33]  # the oracle's base-model row


@pytest.fixture
def hub_root(written, tmp_path, monkeypatch) -> Path:
    """The oracle's adapters as hub repos org/<name>."""
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    root = tmp_path / "hub"
    for name in ADAPTERS:
        (root / "org" / name).mkdir(parents=True)
        for file in FILES:
            shutil.copy(written[name][0] / file, root / "org" / name / file)
    return root


def _serve(written, hub: LocalHub, cache: Path, max_batch: int = 4, **manager_kwargs) -> tuple[Engine, AdapterManager]:
    model = load_model(written[None][0], dtype=torch.float32)
    spec = model.config.to_spec(TINY_NAME)
    hub_config = HubConfig(endpoint=hub.endpoint, cache_dir=cache, retries=0, timeout_s=30)
    manager = AdapterManager(spec, AdapterManagerConfig(rows=RowOptions(max_rank=8), hub=hub_config, **manager_kwargs))
    for name in ADAPTERS:
        manager.register(f"org/{name}", name)
    config = EngineConfig(max_batch=max_batch, max_seq_len=64, scheduler=SchedulerConfig(token_budget=16), eos_ids=())
    return Engine(model, manager, config), manager


def _leave_disk_and_host(manager: AdapterManager, cache: Path, name: str) -> None:
    """The adapter's files leave the HF cache and its prepared weights the host: serving it needs the hub again."""
    shutil.rmtree(cache / repo_folder_name(repo_id=f"org/{name}", repo_type="model"))
    manager.registry.host.discard((name, manager.registry.get(name).digest))


def test_a_slow_download_stalls_no_one_and_the_slow_request_still_equals_peft(written, expected, hub_root, tmp_path):
    warm, slow = "qv", "all_rslora"
    cache = tmp_path / "cache"
    with LocalHub(hub_root) as hub:
        engine, manager = _serve(written, hub, cache, max_slots=2)
        _leave_disk_and_host(manager, cache, slow)
        hub.add_fault(HubFault(f"*org/{slow}/resolve/*/adapter_model.safetensors", method="GET", delay_s=2.0))
        params = SamplingParams(max_tokens=NEW_TOKENS)
        others = [engine.submit(PROMPT, warm, params), engine.submit(BASE_PROMPT, None, params)]
        manager.prefetcher.wait(30)  # the warm adapter's copy into its slot (started at submit) is done
        engine.step()  # both prefill together: from here on they decode
        cold = engine.submit(PROMPT, slow, params)
        tokens_per_step = []
        while not all(h.done for h in others):
            before = [h.num_tokens for h in others]
            stats = engine.step()
            tokens_per_step.append([h.num_tokens - b for h, b in zip(others, before, strict=True)])
            assert stats.sequences == 2, "the cold request was admitted before its adapter was ready"
        assert tokens_per_step == [[1, 1]] * (NEW_TOKENS - 1)  # one token per step each, every step
        assert cold.num_tokens == 0 and cold.adapter_wait_s is None  # still downloading: it waited alone
        engine.run_until_idle(max_steps=500)
        slow_gets = [r for r in hub.requests if r.method == "GET" and f"org/{slow}/resolve" in r.path]
        manager.close()
    for handle, prompt, name in zip([*others, cold], [PROMPT, BASE_PROMPT, PROMPT], [warm, None, slow], strict=True):
        assert handle.result(timeout=0) == expected[(tuple(prompt), name)], name
    assert cold.adapter_wait_s is not None and cold.adapter_wait_s > 0
    assert len(slow_gets) == 4  # registration (2 files), then both once again: none in a step, none twice
    snapshot = manager.metrics()
    assert snapshot.adapter_wait is not None and snapshot.adapter_wait.count == 2  # qv once, the slow one once
    assert snapshot.moves[Move.DISK_TO_HOST.value].count == len(ADAPTERS) + 1  # registration + the slow one again


def _bytes_on_disk(cache: Path) -> int:
    """Bytes of every adapter repo's blobs in the cache, partial downloads included (what the bound covers)."""
    total = 0
    for repo in cache.glob("models--org--*"):
        for entry in os.scandir(repo / "blobs") if (repo / "blobs").is_dir() else ():
            try:
                total += entry.stat().st_size
            except FileNotFoundError:  # evicted between the listing and the stat
                pass
    return total


def test_the_disk_bound_holds_at_every_moment_with_popularity_prefetch(written, expected, hub_root, tmp_path):
    cache = tmp_path / "cache"
    sizes = {n: sum((hub_root / "org" / n / f).stat().st_size for f in FILES) for n in ADAPTERS}
    bound = sum(sorted(sizes.values())[-3:])  # about three of the five
    with LocalHub(hub_root) as hub:
        engine, manager = _serve(
            written,
            hub,
            cache,
            max_batch=2,
            max_slots=1,
            host_cache_bytes=2 * max(r.nbytes for r in _records(written)),
            disk_cache_bytes=bound,
            prefetch_popular=4,
        )
        samples: list[int] = []
        landed: list[int] = []  # the disk at each download's peak: landed, its reservation not yet given back
        stop = threading.Event()
        resolve = manager.registry._resolver.resolve

        def resolve_and_measure(ref, adapter):
            files = resolve(ref, adapter)
            landed.append(_bytes_on_disk(cache))
            return files

        manager.registry._resolver.resolve = resolve_and_measure

        def sample() -> None:
            while not stop.is_set():
                samples.append(_bytes_on_disk(cache))
                stop.wait(0.001)

        after_answers = []
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            names = list(ADAPTERS) * 4
            for i in range(0, len(names), 2):  # two at a time, cycling through all five
                pair = names[i : i + 2]
                handles = [engine.submit(PROMPT, name, SamplingParams(max_tokens=NEW_TOKENS)) for name in pair]
                engine.run_until_idle(max_steps=500)
                after_answers.append(_bytes_on_disk(cache))
                for handle, name in zip(handles, pair, strict=True):
                    assert handle.result(timeout=0) == expected[(tuple(PROMPT), name)], name
        finally:
            stop.set()
            sampler.join()
            manager.close()
    snapshot = manager.metrics()
    assert snapshot.evictions["disk"] > 0 and snapshot.moves[Move.HUB_TO_DISK.value].count > len(ADAPTERS)
    assert max(after_answers) <= bound, (after_answers, bound)
    assert samples and max(samples) <= bound, (max(samples), bound)  # sampled every ms from another thread
    downloads = snapshot.moves[Move.HUB_TO_DISK.value].count - len(ADAPTERS)  # after the registrations
    assert len(landed) == downloads > 0 and max(landed) <= bound, (landed, bound)


def _records(written):
    """Prepared sizes of the oracle's adapters (a throwaway registry of local dirs)."""
    model = load_model(written[None][0], dtype=torch.float32)
    with AdapterManager(
        model.config.to_spec(TINY_NAME), AdapterManagerConfig(rows=RowOptions(max_rank=8), prefetch_workers=0)
    ) as m:
        return [m.register(str(written[name][0]), name).record for name in ADAPTERS]


def test_a_prefetch_with_no_room_downloads_and_prepares_nothing(written, hub_root, tmp_path):
    cache = tmp_path / "cache"
    one = max(r.nbytes for r in _records(written))
    with LocalHub(hub_root) as hub:
        engine, manager = _serve(written, hub, cache, max_slots=1, host_cache_bytes=one, prefetch_popular=4)
        first, second, popular = "qv", "patterns", "spare"
        for name in (second, popular):
            _leave_disk_and_host(manager, cache, name)
        for _ in range(20):
            manager.note_request(popular)  # the most popular adapter by far, on neither disk nor host
        manager.registry.prepared(first)  # the host tier (room for one) holds the first queued adapter
        gets = len([r for r in hub.requests if r.method == "GET"])
        moves = {m: s.count for m, s in manager.metrics().moves.items()}
        manager.prefetch([first, second])  # the second may not evict the first; the popular one neither
        manager.prefetcher.wait(30)
        snapshot = manager.metrics()
        assert len([r for r in hub.requests if r.method == "GET"]) == gets  # no download
        assert {m: s.count for m, s in snapshot.moves.items() if m != Move.HOST_TO_SLOT.value} == {
            m: n for m, n in moves.items() if m != Move.HOST_TO_SLOT.value
        }  # no preparation either
        assert snapshot.prefetch.get("host_no_room") == 1 and snapshot.prefetch.get("popular_no_host_room") == 1
        assert manager.registry.is_prepared(first) and not manager.registry.is_prepared(second)
        manager.close()


def test_an_adapter_the_host_evicted_after_planning_sends_its_request_back_to_wait(expected, make_engine):
    """The step found the adapter ready, then the host tier dropped it before the slot copy: the request goes back
    to the queue (no preparation inside the step, no failure) and is served once the prefetcher prepared it."""
    engine, manager = make_engine(max_slots=2)
    name = "patterns"
    key = (name, manager.registry.get(name).digest)
    go = threading.Event()
    stage = manager.prefetcher._stage  # the registry's stage, held back: no worker prepares it before the step looks
    manager.prefetcher._stage = lambda *args: go.wait(30) and stage(*args)
    is_prepared = manager.registry.is_prepared
    manager.registry.is_prepared = lambda adapter_id: adapter_id == name or is_prepared(adapter_id)  # stale view
    manager.registry.host.discard(key)
    handle = engine.submit(PROMPT, name, SamplingParams(max_tokens=NEW_TOKENS))
    prepared_before = manager.metrics().moves[Move.DISK_TO_HOST.value].count
    stats = engine.step()
    assert stats.sequences == 0 and not handle.done  # admitted on the stale view, then put back: not failed
    assert manager.metrics().moves[Move.DISK_TO_HOST.value].count == prepared_before  # nothing prepared in the step
    assert manager.allocator.free_units() == manager.num_units  # and nothing left pinned or reserved
    manager.registry.is_prepared = is_prepared
    go.set()  # the prefetcher prepares it now
    engine.run_until_idle(max_steps=100)
    assert handle.result(timeout=0) == expected[(tuple(PROMPT), name)]
    manager.close()
