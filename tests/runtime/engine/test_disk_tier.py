"""The bounded disk tier under the engine: five PEFT adapters from the local hub in an HF cache bounded below their
total, beside the base checkpoint in the same cache. Every request still equals HF + PEFT, evicted adapters are
fetched again at their recorded sha, the bound holds after every eviction, and the base checkpoint is untouched."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import torch
from huggingface_hub import constants as hf_constants
from huggingface_hub import scan_cache_dir, snapshot_download

from adapter_manager import AdapterManager, AdapterManagerConfig, HubConfig, LocalHub, Move, RowOptions
from adapter_manager.runtime.engine.engine import Engine, EngineConfig
from adapter_manager.runtime.engine.sampling import SamplingParams
from adapter_manager.runtime.engine.scheduler import SchedulerConfig
from adapter_manager.runtime.model.checkpoint import load_model
from tests.conftest import TINY_NAME
from tests.runtime._oracle import ADAPTERS, ENGINE_REQUESTS
from tests.runtime._oracle import ENGINE_NEW_TOKENS as NEW_TOKENS

FILES = ("adapter_config.json", "adapter_model.safetensors")


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_adapters_over_the_disk_bound_still_answer_correctly(written, expected, tmp_path, monkeypatch):
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    hub_root, cache = tmp_path / "hub", tmp_path / "cache"
    sizes = {}
    for name in ADAPTERS:
        for file in FILES:
            (hub_root / "org" / name).mkdir(parents=True, exist_ok=True)
            shutil.copy(written[name][0] / file, hub_root / "org" / name / file)
        sizes[name] = sum((hub_root / "org" / name / f).stat().st_size for f in FILES)
    shutil.copytree(written[None][0], hub_root / "base" / "tiny")
    bound = sum(sorted(sizes.values())[-3:])  # room for the three largest: the five do not fit
    assert bound < sum(sizes.values())

    with LocalHub(hub_root) as hub:
        base = Path(snapshot_download("base/tiny", endpoint=hub.endpoint, cache_dir=cache))  # same cache
        base_before = _digests(base)
        model = load_model(base, dtype=torch.float32)
        spec = model.config.to_spec(TINY_NAME)
        config = AdapterManagerConfig(
            max_slots=2,
            rows=RowOptions(max_rank=8),
            host_cache_bytes=spec.max_adapter_bytes(8, 4),  # one adapter: every switch prepares from disk
            prefetch_workers=1,
            hub=HubConfig(endpoint=hub.endpoint, cache_dir=cache, retries=0),
            disk_cache_bytes=bound,
        )
        manager = AdapterManager(spec, config)
        disk = manager.registry.disk
        after_each: list[int] = []
        enforce = disk.enforce

        def enforce_and_measure() -> int:
            freed = enforce()
            after_each.append(disk.usage().used_bytes)
            return freed

        monkeypatch.setattr(disk, "enforce", enforce_and_measure)
        shas = {name: manager.register(f"org/{name}", name).record.sha for name in ADAPTERS}
        engine = Engine(
            model,
            manager,
            EngineConfig(max_batch=4, max_seq_len=64, scheduler=SchedulerConfig(token_budget=12), eos_ids=()),
        )
        requests = ENGINE_REQUESTS
        for prompt, name in requests:  # one at a time: each switch goes back to the disk tier
            handle = engine.submit(prompt, name, SamplingParams(max_tokens=NEW_TOKENS))
            engine.run_until_idle(max_steps=200)
            assert handle.result(timeout=0) == expected[(tuple(prompt), name)], (prompt, name)
        handles = [engine.submit(p, a, SamplingParams(max_tokens=NEW_TOKENS)) for p, a in requests]  # all at once
        engine.run_until_idle(max_steps=500)
        for handle, (prompt, name) in zip(handles, requests, strict=True):
            assert handle.result(timeout=0) == expected[(tuple(prompt), name)], (prompt, name)
        fetched = [r.path for r in hub.requests if r.method == "GET" and "/resolve/" in r.path and "org/" in r.path]
        manager.close()

    snapshot = manager.metrics()
    assert after_each and max(after_each) <= bound, after_each
    assert snapshot.evictions["disk"] > 0 and snapshot.misses["disk"] > 0 and snapshot.hits["disk"] > 0
    assert snapshot.moves[Move.HUB_TO_DISK.value].count > len(ADAPTERS)  # evicted adapters came back
    assert snapshot.disk["capacity_bytes"] == bound and 0 < snapshot.disk["used_bytes"] <= bound
    assert snapshot.disk["evicted_bytes"] > 0
    refetched = fetched[2 * len(ADAPTERS) :]  # the first downloads resolved branches; later ones the recorded sha
    assert refetched and all(any(sha in path for sha in shas.values()) for path in refetched), refetched
    assert {name: manager.registry.get(name).sha for name in ADAPTERS} == shas
    assert _digests(base) == base_before  # the base checkpoint in the same cache was never touched
    assert "base/tiny" in {r.repo_id for r in scan_cache_dir(cache).repos}
