"""The disk tier's eviction order against the pick it replaced (a min over every revision of every owned repo by
(needed, last used), first filed first among equals), over random files, touches, refilings, removals and busy
repos; and a registration's revision refiled when it is unregistered, with no needed set computed again."""

from __future__ import annotations

import random

import pytest
from huggingface_hub import constants as hf_constants
from huggingface_hub import scan_cache_dir

from adapter_manager import AdapterRegistry, HubConfig, LocalHub, RegistryConfig, RowOptions, write_synthetic_adapter
from adapter_manager.tiers.disk_order import EvictionOrder


class _Model:
    """The old pick: every revision's (used_at, filing order) kept in a dict, the min taken over all of them."""

    def __init__(self) -> None:
        self.used: dict[tuple[str, str], tuple[float, int]] = {}
        self.filed = 0

    def put(self, revision: tuple[str, str], used_at: float) -> None:
        self.filed += 1
        self.used[revision] = (used_at, self.filed)

    def oldest(self, busy: set[str], needed: set[tuple[str, str]]) -> tuple[str, str] | None:
        candidates = [r for r in self.used if r[0] not in busy]
        return min(candidates, key=lambda r: (r in needed, self.used[r]), default=None)


@pytest.mark.parametrize("seed", range(20))
def test_the_pick_equals_a_min_over_every_revision(seed):
    rng = random.Random(seed)
    order, model, needed = EvictionOrder(), _Model(), set()
    repos = [f"org/r{i}" for i in range(12)]
    clock = 0.0
    for _ in range(600):
        revision = (rng.choice(repos), rng.choice("ab"))
        op = rng.random()
        if op < 0.3:  # a repo read: filed again, at a time of its own (a touch's, or the files' mtime: any order)
            used_at = rng.choice([clock, rng.uniform(0, clock + 1), float(rng.randint(0, 3))])
            order.put(revision, used_at, revision in needed)
            model.put(revision, used_at)
        elif op < 0.45 and revision in model.used:  # touched: behind every other
            clock += rng.choice([0.0, 1.0])  # equal times too: the later touch goes after
            order.touch(revision, clock)
            model.put(revision, clock)
        elif op < 0.6:  # a registration starts or stops pointing at it (the tier is told)
            needed.symmetric_difference_update({revision})
            order.set_needed(revision, revision in needed)
        elif op < 0.7:
            order.remove(revision)
            model.used.pop(revision, None)
        else:
            busy = set(rng.sample(repos, rng.randint(0, 4)))
            picked = order.oldest(busy, lambda: needed)
            assert picked == model.oldest(busy, needed)
            if picked is not None and rng.random() < 0.5:  # evicted
                order.remove(picked)
                del model.used[picked]
        assert len(order) == len(model.used)


def test_a_revision_filed_under_the_wrong_kind_is_refiled_at_the_pick():
    """The pick checks its candidate against the live set: one that became needed without a `set_needed` (the
    moment between a registration and its report) is not evicted while an unneeded one is left."""
    order, needed = EvictionOrder(), set()
    order.put(("org/a", "1"), 1.0, False)
    order.put(("org/b", "2"), 2.0, False)
    needed.add(("org/a", "1"))
    assert order.oldest(set(), lambda: needed) == ("org/b", "2")
    order.remove(("org/b", "2"))
    assert order.oldest(set(), lambda: needed) == ("org/a", "1")
    assert order.oldest({"org/a"}, lambda: needed) is None


def test_superseded_entries_do_not_pile_up():
    order = EvictionOrder()
    for step in range(10_000):
        order.touch(("org/a", "1"), float(step)) if step else order.put(("org/a", "1"), 0.0, False)
    assert len(order) == 1 and sum(len(heap) for heap in order._heaps.values()) <= 2 * len(order) + 65


def test_an_unregistered_adapters_revision_goes_before_older_registered_ones(tmp_path, tiny_spec, monkeypatch):
    """The registry counts the revisions its records point at and tells the disk tier when one is needed no more:
    org/a, unregistered, is evicted before org/b although org/b was used longer ago."""
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    for i, name in enumerate(("org/a", "org/b", "org/c")):
        write_synthetic_adapter(tmp_path / "hub" / name, tiny_spec, r=4, seed=i)
    with LocalHub(tmp_path / "hub") as hub:
        hub_config = HubConfig(endpoint=hub.endpoint, cache_dir=tmp_path / "cache", retries=0)
        registry = AdapterRegistry(
            tiny_spec, RegistryConfig(rows=RowOptions(max_rank=8), hub=hub_config, disk_cache_bytes=1 << 30)
        )
        for name in ("org/b", "org/a", "org/c"):
            registry.register(name)
        assert registry._needed.view() == {(r.ref.repo_id, r.sha) for r in registry.list()}
        record = registry.unregister("org/a")
        assert (record.ref.repo_id, record.sha) not in registry._needed.view()
        one = max(r.size_on_disk for r in scan_cache_dir(tmp_path / "cache").repos)
        registry.disk.capacity_bytes = 2 * one
        registry.disk.enforce()
    assert {r.repo_id for r in scan_cache_dir(tmp_path / "cache").repos} == {"org/b", "org/c"}
