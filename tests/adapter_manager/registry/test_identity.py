"""An adapter's identity is the digest of its content: hub blobs named by their sha256 are not read, the same bytes
at a new commit or in another folder are the same adapter, a rewrite keeping size and mtime is not, and durable rows
record the digest (a state directory from before digests still opens and restores)."""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import time

import pytest
from huggingface_hub import constants as hf_constants

from adapter_manager import (
    AdapterManager,
    AdapterManagerConfig,
    AdapterRegistry,
    HubConfig,
    LocalHub,
    RegistryConfig,
    RowOptions,
    StateStore,
    write_synthetic_adapter,
)
from adapter_manager.sources import digests
from adapter_manager.sources.digests import FileDigests, content_digest
from adapter_manager.sources.peft_format import CONFIG_NAME, WEIGHTS_NAME
from tests._rewrite import keeping_size_and_mtime


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _rewrite_keeping_size_and_mtime(path, spec) -> None:
    with keeping_size_and_mtime(path):
        write_synthetic_adapter(path.parent, spec, r=4, target_modules=["q_proj", "v_proj"], seed=99)


@pytest.fixture
def hub(tmp_path, tiny_spec, monkeypatch):
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    write_synthetic_adapter(tmp_path / "hub" / "org" / "a", tiny_spec, r=4, target_modules=["q_proj", "v_proj"], seed=1)
    with LocalHub(tmp_path / "hub") as running:
        yield running


def _registry(spec, hub, tmp_path, **overrides) -> AdapterRegistry:
    config = HubConfig(endpoint=hub.endpoint, cache_dir=tmp_path / "cache", retries=0, timeout_s=5)
    return AdapterRegistry(spec, RegistryConfig(rows=RowOptions(max_rank=8), hub=config, **overrides))


def test_the_digest_is_the_content_wherever_it_comes_from(hub, tmp_path, tiny_spec, monkeypatch):
    registry = _registry(tiny_spec, hub, tmp_path)
    record = registry.register("org/a").record
    source = hub.root / "org" / "a"
    expected = content_digest(_sha256(source / CONFIG_NAME), _sha256(source / WEIGHTS_NAME))
    assert record.digest == expected
    # the weights' blob in the HF cache is named by its sha256 etag: its digest is that name, the file unread
    assert os.path.realpath(record.files.weights_path).endswith(_sha256(source / WEIGHTS_NAME))
    read: list[str] = []
    original = FileDigests.digests
    monkeypatch.setattr(
        FileDigests, "digests", lambda self, path, st: read.append(path.name) or original(self, path, st)
    )
    assert FileDigests().sha256(record.files.weights_path) == _sha256(source / WEIGHTS_NAME) and read == []
    # the same files in a local folder are the same adapter
    local = shutil.copytree(source, tmp_path / "copy")
    assert registry.register(str(local), "copy").record.digest == expected


def test_the_same_bytes_at_a_new_commit_are_unchanged_and_new_bytes_are_an_update(hub, tmp_path, tiny_spec):
    registry = _registry(tiny_spec, hub, tmp_path)
    first = registry.register("org/a").record
    (hub.root / "org" / "a" / "README.md").write_text("a new commit, the same adapter\n")
    same = registry.register("org/a", refresh=True)
    assert same.action == "unchanged" and same.record.sha != first.sha and same.record.digest == first.digest
    assert same.record.generation == first.generation and registry.host.keys() == {("org/a", first.digest)}
    _rewrite_keeping_size_and_mtime(hub.root / "org" / "a" / WEIGHTS_NAME, tiny_spec)
    updated = registry.register("org/a", refresh=True)
    assert updated.action == "updated" and updated.record.digest != first.digest
    assert updated.record.generation != first.generation and registry.host.keys() == {("org/a", updated.record.digest)}


def test_a_local_rewrite_keeping_size_and_mtime_is_seen_even_after_the_digest_was_remembered(
    tmp_path, tiny_spec, monkeypatch
):
    monkeypatch.setattr(digests, "_RACY_S", 0.0)  # remember fresh files too: only the stat key can tell a rewrite
    folder = write_synthetic_adapter(tmp_path / "a", tiny_spec, r=4, target_modules=["q_proj", "v_proj"], seed=1)
    registry = AdapterRegistry(tiny_spec, RegistryConfig(rows=RowOptions(max_rank=8)))
    first = registry.register(str(folder), "a").record
    assert registry.register(str(folder), "a", refresh=True).action == "unchanged"
    time.sleep(0.05)  # past the file timestamps' tick (the kernel's coarse clock)
    _rewrite_keeping_size_and_mtime(folder / WEIGHTS_NAME, tiny_spec)
    updated = registry.register(str(folder), "a", refresh=True)
    assert updated.action == "updated" and updated.record.digest != first.digest
    assert updated.record.digest == content_digest(_sha256(folder / CONFIG_NAME), _sha256(folder / WEIGHTS_NAME))


def test_durable_rows_keep_the_digest_and_a_folder_changed_while_down_is_not_restored(tmp_path, tiny_spec):
    folder = write_synthetic_adapter(tmp_path / "a", tiny_spec, r=4, target_modules=["q_proj", "v_proj"], seed=1)
    other = write_synthetic_adapter(tmp_path / "b", tiny_spec, r=4, target_modules=["q_proj", "v_proj"], seed=2)
    config = AdapterManagerConfig(
        max_slots=2, rows=RowOptions(max_rank=8), state_dir=tmp_path / "state", prefetch_workers=0
    )
    with AdapterManager(tiny_spec, config) as manager:
        digest = manager.register(str(folder), "a").record.digest
        manager.register(str(other), "b")
    assert {r.adapter_id: r.digest for r in StateStore(tmp_path / "state").load()}["a"] == digest
    _rewrite_keeping_size_and_mtime(folder / WEIGHTS_NAME, tiny_spec)
    with AdapterManager(tiny_spec, config) as manager:
        assert manager.restored == ["b"]
        (unrestored,) = manager.unrestored()
        assert unrestored.registration.adapter_id == "a" and "changed since registration" in unrestored.error


def test_a_state_directory_from_before_digests_opens_and_restores(tmp_path, tiny_spec):
    folder = write_synthetic_adapter(tmp_path / "a", tiny_spec, r=4, target_modules=["q_proj", "v_proj"], seed=1)
    (tmp_path / "state").mkdir()
    old = sqlite3.connect(tmp_path / "state" / "registrations.sqlite3")
    old.execute(
        "CREATE TABLE registrations (adapter_id TEXT PRIMARY KEY, ref TEXT NOT NULL, revision TEXT, "
        "sha TEXT NOT NULL, pinned INTEGER NOT NULL DEFAULT 0, registered_at REAL NOT NULL)"
    )
    old.execute("INSERT INTO registrations VALUES ('a', ?, NULL, 'local-0123', 0, 1.0)", (str(folder),))
    old.commit()
    old.close()
    config = AdapterManagerConfig(
        max_slots=2, rows=RowOptions(max_rank=8), state_dir=tmp_path / "state", prefetch_workers=0
    )
    with AdapterManager(tiny_spec, config) as manager:
        assert manager.restored == ["a"] and manager.record("a").digest
        manager.acquire(["a"])  # prepared from the folder as it is now
    (row,) = StateStore(tmp_path / "state").load()
    assert row.digest is None  # written by the old version; the next registration records it
