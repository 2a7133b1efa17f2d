"""Durable registrations: the sqlite3 state store, and a new manager restoring them from the HF cache (offline),
fetching again at the recorded sha only what left the cache, reporting what cannot be restored."""

from __future__ import annotations

import shutil
import sqlite3
import time

import pytest
from huggingface_hub import constants as hf_constants
from huggingface_hub import scan_cache_dir
from safetensors.torch import load_file, save_file

from adapter_manager import (
    AdapterManager,
    AdapterManagerConfig,
    AdapterNotFoundError,
    HubConfig,
    HubUnavailableError,
    LocalHub,
    Move,
    NonFiniteWeightsError,
    Registration,
    RowOptions,
    StateStore,
    write_synthetic_adapter,
)


def test_state_store_commits_every_write_in_wal_mode(tmp_path):
    store = StateStore(tmp_path / "state")
    store.put(Registration("org/a", "org/a", "v1", "a" * 40, False, 1.0))
    store.put(Registration("loc", "/srv/adapters/loc", None, "local-1", False, 2.0))
    store.set_pinned("org/a", True)
    store.put(Registration("org/a", "org/a", "v2", "b" * 40, False, 3.0))  # an update keeps the pin
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    # A second connection (another process after a crash) sees every committed write without any close.
    other = sqlite3.connect(store.path)
    assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    rows = other.execute("SELECT adapter_id, revision, sha, pinned FROM registrations ORDER BY adapter_id").fetchall()
    assert rows == [("loc", None, "local-1", 0), ("org/a", "v2", "b" * 40, 1)]
    store.delete("loc")
    assert [r.adapter_id for r in StateStore(tmp_path / "state").load()] == ["org/a"]
    assert StateStore(tmp_path / "state").load()[0].pinned
    other.close()
    store.close()


@pytest.fixture
def hub_root(tmp_path, tiny_spec):
    root = tmp_path / "hub"
    for i, name in enumerate(("a", "b")):
        write_synthetic_adapter(root / "org" / name, tiny_spec, r=4, target_modules=["q_proj", "v_proj"], seed=i)
    write_synthetic_adapter(root / "org" / "a" / ".revisions" / "v1", tiny_spec, r=2, seed=5)
    return root


@pytest.fixture(autouse=True)
def online(monkeypatch):
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)


def manager_for(spec, tmp_path, endpoint: str, **overrides) -> AdapterManager:
    hub = HubConfig(endpoint=endpoint, cache_dir=tmp_path / "cache", retries=0, timeout_s=2)
    config = dict(max_slots=4, rows=RowOptions(max_rank=8), prefetch_workers=0, hub=hub, state_dir=tmp_path / "state")
    return AdapterManager(spec, AdapterManagerConfig(**{**config, **overrides}))


def test_a_new_manager_restores_every_registration_offline(hub_root, tmp_path, tiny_spec):
    local = write_synthetic_adapter(tmp_path / "local" / "mine", tiny_spec, r=2, seed=9)
    with LocalHub(hub_root) as hub, manager_for(tiny_spec, tmp_path, hub.endpoint) as first:
        registered = {
            "org/a": first.register("org/a@v1").record,
            "org/b": first.register("org/b").record,
            "mine": first.register(str(local)).record,
        }
        first.register("org/b", "gone")
        first.pin("org/b")
        first.unregister("gone")
        endpoint = hub.endpoint
    # The hub is down now: restoring must not need it.
    with manager_for(tiny_spec, tmp_path, endpoint) as second:
        assert sorted(second.restored) == ["mine", "org/a", "org/b"]
        for adapter_id, before in registered.items():
            after = second.registry.get(adapter_id)
            assert (after.sha, after.ref, after.rank) == (before.sha, before.ref, before.rank)
            assert after.registered_at == before.registered_at
        assert "gone" not in second.registry  # unregistered: its row went before unregister returned
        assert second.residency()["org/b"].pinned  # the operator pin came back
        assert second.metrics().restore == {"restored": 3}
        assert Move.HUB_TO_DISK.value not in second.metrics().moves
        lease = second.acquire(["org/a", "mine"])  # serving works at once
        second.release(lease)


def test_files_that_left_the_cache_are_fetched_again_at_the_recorded_sha_on_first_use(hub_root, tmp_path, tiny_spec):
    """A restart downloads nothing: a revision whose files left the cache (the disk bound evicted it) is restored from
    its stored config, and its first use fetches exactly that sha again (a row from before configs were stored is
    fetched at restore, as before)."""
    with LocalHub(hub_root) as hub:
        with manager_for(tiny_spec, tmp_path, hub.endpoint) as first:
            sha_a = first.register("org/a").record.sha
            sha_b = first.register("org/b").record.sha
        blobs = list((tmp_path / "cache" / "models--org--b" / "blobs").iterdir())
        (weights,) = [blob for blob in blobs if blob.stat().st_size > 1000]
        weights.unlink()  # the weights left the cache; the config is still there
        # A new commit on org/a's main branch must not move the restored adapter off its recorded sha.
        write_synthetic_adapter(hub_root / "org" / "a", tiny_spec, r=8, seed=42)
        hub.clear_requests()
        with manager_for(tiny_spec, tmp_path, hub.endpoint) as second:
            assert second.registry.get("org/a").sha == sha_a and second.registry.get("org/b").sha == sha_b
            assert second.registry.get("org/a").rank == 4 and second.registry.get("org/b").rank == 4
            assert not [r for r in hub.requests if "/resolve/" in r.path]  # the restart fetched nothing
            assert Move.HUB_TO_DISK.value not in second.metrics().moves
            second.release(second.acquire(["org/a", "org/b"]))  # first use: org/b's files again, at its sha
            fetched = [r.path for r in hub.requests if r.method == "GET" and "/resolve/" in r.path]
            assert fetched and all("org/b" in path and sha_b in path for path in fetched), fetched
            assert second.metrics().moves[Move.HUB_TO_DISK.value].count == 1
            assert second.metrics().misses["disk"] == 1 and second.metrics().hits["disk"] == 2
        old_rows = sqlite3.connect(tmp_path / "state" / "registrations.sqlite3")
        old_rows.execute("UPDATE registrations SET config = NULL")  # rows from before configs were stored
        old_rows.commit()
        old_rows.close()
        shutil.rmtree(tmp_path / "cache" / "models--org--b" / "blobs")
        hub.clear_requests()
        with manager_for(tiny_spec, tmp_path, hub.endpoint) as third:
            assert sorted(third.restored) == ["org/a", "org/b"]
            assert third.metrics().moves[Move.HUB_TO_DISK.value].count == 1  # fetched at restore


def test_an_adapter_that_cannot_be_restored_is_reported_and_the_others_serve(
    hub_root, tmp_path, tiny_spec, monkeypatch
):
    local = write_synthetic_adapter(tmp_path / "local" / "mine", tiny_spec, r=2, seed=9)
    with LocalHub(hub_root) as hub:
        with manager_for(tiny_spec, tmp_path, hub.endpoint) as first:
            first.register("org/a")
            first.register("org/b")
            first.register(str(local))
        endpoint = hub.endpoint
    monkeypatch.setattr(time, "sleep", lambda s: None)  # huggingface_hub's back-off against the dead hub
    shutil.rmtree(local)
    shutil.rmtree(tmp_path / "cache" / "models--org--b")  # gone from the cache, and the hub is down
    with manager_for(tiny_spec, tmp_path, endpoint, rows=RowOptions(max_rank=8)) as second:
        # org/b restores from its stored config: its files come back at first use, which fails while the hub is down
        assert second.restored == ["org/a", "org/b"]
        unrestored = {u.registration.adapter_id: u for u in second.registry.unrestored()}
        assert set(unrestored) == {"mine"} and "does not exist" in unrestored["mine"].error
        assert second.metrics().restore == {"restored": 2, "failed": 1}
        second.release(second.acquire(["org/a"]))
        with pytest.raises(HubUnavailableError, match="org/b"):
            second.acquire(["org/b"])
        assert "org/b" in second.registry  # still registered: served once the hub is back
        assert second.unregister("mine") is None  # an unrestored adapter can be unregistered
        with pytest.raises(AdapterNotFoundError):
            second.unregister("mine")
    with manager_for(tiny_spec, tmp_path, endpoint) as third:
        assert third.registry.unrestored() == [] and sorted(third.restored) == ["org/a", "org/b"]


def test_rows_without_a_state_dir_are_not_written(hub_root, tmp_path, tiny_spec):
    with LocalHub(hub_root) as hub, manager_for(tiny_spec, tmp_path, hub.endpoint, state_dir=None) as manager:
        manager.register("org/a")
        assert manager.registry.store is None and manager.restored == []
    assert not (tmp_path / "state").exists()
    assert {r.repo_id for r in scan_cache_dir(tmp_path / "cache").repos} == {"org/a"}


def _cache_repos(cache) -> set[str]:
    return {r.repo_id for r in scan_cache_dir(cache).repos}


def test_a_restart_restores_records_and_prepares_each_adapter_only_on_first_use(hub_root, tmp_path, tiny_spec):
    with LocalHub(hub_root) as hub:
        with manager_for(tiny_spec, tmp_path, hub.endpoint) as first:
            first.register("org/a")
            first.register("org/b")
        with manager_for(tiny_spec, tmp_path, hub.endpoint) as second:
            assert sorted(second.restored) == ["org/a", "org/b"]
            assert Move.DISK_TO_HOST.value not in second.metrics().moves  # nothing prepared yet
            assert second.registry.host.keys() == set()
            assert {r.tier for r in second.residency().values()} == {"disk"}
            second.release(second.acquire(["org/a"]))  # the first request prepares it, as a cold load does
            assert second.metrics().moves[Move.DISK_TO_HOST.value].count == 1
            record = second.registry.get("org/a")
            assert second.registry.host.keys() == {("org/a", record.digest)}
            assert record.nbytes == second.registry.prepared("org/a").nbytes  # known before it was prepared


def _cached_weights(cache, repo: str):
    (snapshot,) = (cache / f"models--{repo.replace('/', '--')}" / "snapshots").iterdir()
    return (snapshot / "adapter_model.safetensors").resolve()  # the blob itself


def test_weights_broken_after_registration_are_found_at_restore_or_at_first_use(hub_root, tmp_path, tiny_spec):
    """Restore reads each weights file's header (keys, shapes, dtypes, length); values are read on first use."""
    with LocalHub(hub_root) as hub:
        with manager_for(tiny_spec, tmp_path, hub.endpoint) as first:
            first.register("org/a")
            first.register("org/b")
        endpoint = hub.endpoint
    truncated = _cached_weights(tmp_path / "cache", "org/a")
    truncated.write_bytes(truncated.read_bytes()[:-64])
    nan = _cached_weights(tmp_path / "cache", "org/b")
    tensors = load_file(nan)
    next(iter(tensors.values()))[0, 0] = float("nan")
    save_file(tensors, nan)
    with manager_for(tiny_spec, tmp_path, endpoint) as second:
        assert second.restored == ["org/b"]
        (unrestored,) = second.registry.unrestored()
        assert unrestored.registration.adapter_id == "org/a" and "CorruptWeightsError" in unrestored.error
        assert second.metrics().restore == {"restored": 1, "failed": 1}
        with pytest.raises(NonFiniteWeightsError, match="NaN"):  # that request's failure, as a cold load's
            second.acquire(["org/b"])
        assert "org/b" in second.registry and second.registry.host.keys() == set()


def test_repos_of_adapters_unregistered_before_a_restart_are_still_evicted(hub_root, tmp_path, tiny_spec):
    with LocalHub(hub_root) as hub:
        with manager_for(tiny_spec, tmp_path, hub.endpoint, disk_cache_bytes=1 << 30) as first:
            first.register("org/a")
            first.register("org/b")
            first.unregister("org/a")  # its files stay in the HF cache, owned by the disk tier
        one = max(r.size_on_disk for r in scan_cache_dir(tmp_path / "cache").repos)
        endpoint = hub.endpoint
    assert _cache_repos(tmp_path / "cache") == {"org/a", "org/b"}
    with manager_for(tiny_spec, tmp_path, endpoint, disk_cache_bytes=one) as second:
        assert _cache_repos(tmp_path / "cache") == {"org/b"}  # the restart still knew it owned org/a
        assert second.metrics().evictions["disk"] == 1 and second.metrics().disk["used_bytes"] <= one
        second.release(second.acquire(["org/b"]))


def test_repos_downloaded_before_the_disk_tier_existed_are_adopted_and_evicted(hub_root, tmp_path, tiny_spec):
    """Registrations made without a disk bound (no tier owned their repos) are the manager's downloads: a restart
    with a bound adopts them from the state store, and an adapter unregistered then leaves the cache."""
    with LocalHub(hub_root) as hub:
        with manager_for(tiny_spec, tmp_path, hub.endpoint) as first:  # no disk_cache_bytes: nothing owned
            first.register("org/a")
            first.register("org/b")
        one = max(r.size_on_disk for r in scan_cache_dir(tmp_path / "cache").repos)
        with manager_for(tiny_spec, tmp_path, hub.endpoint, disk_cache_bytes=1 << 30) as second:
            assert StateStore(tmp_path / "state").owned_repos(tmp_path / "cache") == {"org/a", "org/b"}
            second.unregister("org/a")
        with manager_for(tiny_spec, tmp_path, hub.endpoint, disk_cache_bytes=one) as third:
            assert _cache_repos(tmp_path / "cache") == {"org/b"}
            assert third.metrics().evictions["disk"] == 1
