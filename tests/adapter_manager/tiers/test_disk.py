"""The disk tier on a real HF cache filled by huggingface_hub from the local hub: LRU order, pins during use,
revisions no registration needs first, and repositories it does not own never touched."""

from __future__ import annotations

import pytest
from huggingface_hub import constants as hf_constants
from huggingface_hub import scan_cache_dir, snapshot_download
from huggingface_hub.utils import _cache_manager as cache_manager

from adapter_manager import (
    AdapterRegistry,
    DiskTier,
    DiskTierFullError,
    DiskUsage,
    HubConfig,
    LocalHub,
    RegistryConfig,
    RowOptions,
    StateStore,
    SwapMetrics,
    write_synthetic_adapter,
)


@pytest.fixture
def cache(tmp_path, tiny_spec, monkeypatch):
    """org/a, org/b, org/c (each one revision) and other/model (not owned) downloaded into one HF cache."""
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    for i, name in enumerate(("org/a", "org/b", "org/c", "other/model")):
        write_synthetic_adapter(tmp_path / "hub" / name, tiny_spec, r=4, seed=i)
    with LocalHub(tmp_path / "hub") as hub:
        for name in ("other/model", "org/a", "org/b", "org/c"):
            snapshot_download(name, endpoint=hub.endpoint, cache_dir=tmp_path / "cache")
    return tmp_path / "cache"


def _repos(cache) -> dict[str, str]:
    return {r.repo_id: next(iter(r.revisions)).commit_hash for r in scan_cache_dir(cache).repos}


def _tier(cache, capacity, needed=set) -> DiskTier:
    tier = DiskTier(cache, capacity, SwapMetrics(), needed)
    for repo in ("org/a", "org/b", "org/c"):
        tier.own(repo)
    return tier


def test_least_recently_used_goes_first_and_unowned_repos_stay(cache):
    shas = _repos(cache)
    one = max(r.size_on_disk for r in scan_cache_dir(cache).repos)
    tier = _tier(cache, 2 * one)
    for repo in ("org/b", "org/a", "org/c"):
        tier.touch(repo, shas[repo])
    assert tier.usage().used_bytes == sum(
        r.size_on_disk for r in scan_cache_dir(cache).repos if r.repo_id != "other/model"
    )
    freed = tier.enforce()
    assert set(_repos(cache)) == {"org/a", "org/c", "other/model"} and freed > 0
    assert tier.usage().used_bytes <= 2 * one
    small = _tier(cache, 1)  # below any adapter: every owned revision goes, the unowned model stays
    small.enforce()
    assert set(_repos(cache)) == {"other/model"}


def test_a_repo_in_use_is_never_evicted_and_unneeded_revisions_go_first(cache):
    shas = _repos(cache)
    one = max(r.size_on_disk for r in scan_cache_dir(cache).repos)
    tier = _tier(cache, one, needed=lambda: {("org/a", shas["org/a"]), ("org/b", shas["org/b"])})
    for repo in ("org/c", "org/a", "org/b"):
        tier.touch(repo, shas[repo])  # org/c: needed by no registration; org/a: oldest of the needed, in use
    with tier.using("org/a"):
        tier.enforce()
        assert set(_repos(cache)) == {"org/a", "other/model"}  # in use: kept although least recently used
    metrics = tier._metrics.snapshot()
    assert metrics.evictions["disk"] == 2 and metrics.disk["used_bytes"] <= one
    assert metrics.disk["evicted_bytes"] > 0 and metrics.disk["capacity_bytes"] == one


def test_a_download_reserves_its_bytes_first_and_without_room_is_refused(cache):
    shas = _repos(cache)
    one = max(r.size_on_disk for r in scan_cache_dir(cache).repos)
    tier = _tier(cache, 3 * one)
    for repo in ("org/b", "org/a", "org/c"):
        tier.touch(repo, shas[repo])
    with tier.using("org/a"), tier.using("org/c"):
        with tier.downloading("org/new", one, "new"):  # the least recently used unpinned repo makes room now
            assert set(_repos(cache)) == {"org/a", "org/c", "other/model"}
            usage = tier.usage()
            assert usage.reserved_bytes == one and usage.used_bytes + usage.reserved_bytes <= 3 * one
            with pytest.raises(DiskTierFullError, match="no room in the disk tier"):  # the rest is in use
                with tier.downloading("org/other", one, "other"):
                    pytest.fail("downloaded with no room")
        assert tier.usage().reserved_bytes == 0  # given back (nothing landed in org/new)
    assert set(_repos(cache)) == {"org/a", "org/c", "other/model"}


def test_capacity_must_be_positive(cache):
    with pytest.raises(ValueError, match="disk_cache_bytes must be positive, got 0"):
        DiskTier(cache, 0, SwapMetrics())


def test_a_sha_shared_with_a_repo_not_owned_leaves_that_repo_whole(tmp_path, tiny_spec, monkeypatch):
    """An eviction deletes the revision from the owned repo alone (its own snapshot and blobs): another repo holding
    the same commit sha, such as a mirror the manager did not download, keeps every file."""
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    for name in ("org/twin", "other/twin"):
        write_synthetic_adapter(tmp_path / "hub" / name, tiny_spec, r=2, seed=0)  # same files: same commit sha
    with LocalHub(tmp_path / "hub") as hub:
        for name in ("org/twin", "other/twin"):
            snapshot_download(name, endpoint=hub.endpoint, cache_dir=tmp_path / "cache")
    other = tmp_path / "cache" / "models--other--twin"
    before = {p.relative_to(other): p.read_bytes() for p in other.rglob("*") if p.is_file()}
    tier = DiskTier(tmp_path / "cache", 1, SwapMetrics())
    tier.own("org/twin")
    assert tier.enforce() > 0
    assert set(_repos(tmp_path / "cache")) == {"other/twin"}
    assert {p.relative_to(other): p.read_bytes() for p in other.rglob("*") if p.is_file()} == before


def test_ownership_is_kept_in_the_state_store_across_tiers(cache, tmp_path):
    """A new tier on the same store (a restart) still owns what the old one did, and evicts it under its bound;
    a repo wholly evicted is owned no more."""
    store, restarted = StateStore(tmp_path / "state"), StateStore(tmp_path / "state")
    first = DiskTier(cache, 1 << 30, SwapMetrics(), store=store)
    first.own("org/a")
    with first.using("org/b"):
        pass
    assert DiskTier(cache, 1, SwapMetrics()).usage() == DiskUsage(0, 1, 0)  # no store: nothing owned at start
    second = DiskTier(cache, 1, SwapMetrics(), store=restarted)
    assert second.usage().revisions == 2
    second.enforce()
    assert set(_repos(cache)) == {"org/c", "other/model"}  # never owned: kept
    assert DiskTier(cache, 1, SwapMetrics(), store=store).usage() == DiskUsage(0, 1, 0)
    assert store.owned_repos(cache) == set()
    store.close()
    restarted.close()


def test_after_start_only_the_repo_a_download_landed_in_is_read(tmp_path, tiny_spec, monkeypatch):
    """Sizes are kept incrementally: a download reads its own repo's folder, never the rest of the cache (the base
    model, other adapters), and the kept figure equals a full scan's."""
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    for i, name in enumerate(("org/a", "org/b", "org/c", "other/model")):
        write_synthetic_adapter(tmp_path / "hub" / name, tiny_spec, r=4, seed=i)
    read: list[str] = []
    scan_repo = cache_manager._scan_cached_repo

    def counting(repo_path):
        read.append(repo_path.name)
        return scan_repo(repo_path)

    with LocalHub(tmp_path / "hub") as hub:
        snapshot_download("other/model", endpoint=hub.endpoint, cache_dir=tmp_path / "cache")
        hub_config = HubConfig(endpoint=hub.endpoint, cache_dir=tmp_path / "cache", retries=0)
        registry = AdapterRegistry(
            tiny_spec, RegistryConfig(rows=RowOptions(max_rank=8), hub=hub_config, disk_cache_bytes=1 << 30)
        )
        registry.restore()
        monkeypatch.setattr(cache_manager, "_scan_cached_repo", counting)
        for name in ("org/a", "org/b", "org/c"):
            registry.register(name)
    assert "models--other--model" not in read
    assert read.count("models--org--a") <= 2  # when first owned, and when its download landed
    owned = [r for r in scan_cache_dir(tmp_path / "cache").repos if r.repo_id.startswith("org/")]
    assert registry.disk.usage() == DiskUsage(sum(r.size_on_disk for r in owned), 1 << 30, 3)


def test_a_refresh_that_downloads_the_same_sha_again_is_bounded_too(tmp_path, tiny_spec, monkeypatch):
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    for i, name in enumerate(("org/a", "org/b")):
        write_synthetic_adapter(tmp_path / "hub" / name, tiny_spec, r=4, seed=i)
    with LocalHub(tmp_path / "hub") as hub:
        hub_config = HubConfig(endpoint=hub.endpoint, cache_dir=tmp_path / "cache", retries=0)
        snapshot_download("org/a", endpoint=hub.endpoint, cache_dir=tmp_path / "sizes")
        one = scan_cache_dir(tmp_path / "sizes").size_on_disk
        registry = AdapterRegistry(
            tiny_spec, RegistryConfig(rows=RowOptions(max_rank=8), hub=hub_config, disk_cache_bytes=one)
        )
        registry.register("org/a")
        registry.register("org/b")  # org/a, least recently used, leaves the cache
        assert set(_repos(tmp_path / "cache")) == {"org/b"}
        again = registry.register("org/a", refresh=True)  # the same sha, downloaded again
        assert again.action == "unchanged" and again.downloaded_bytes > 0
    assert set(_repos(tmp_path / "cache")) == {"org/a"}
    assert registry.disk.usage().used_bytes <= one
