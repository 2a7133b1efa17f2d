"""The adapter directory's restore after Serve restarted it empty: replicas give back what they registered from,
without undoing a deletion or registration made since, the newer of two versions winning."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ray.serve", reason="the cluster extra (ray[serve]) is not installed")

from adapter_manager.runtime.cluster.directory import ORPHAN_S, AdapterDirectory, DirectoryEntry, reconcile_plan  # noqa: E402


def test_a_restarted_directory_gets_its_entries_back_from_the_replicas():
    old = AdapterDirectory()
    a = old.put("a", "org/a", {"sha": "1"})
    b1 = old.put("b", "org/b", {"sha": "1"})
    b2 = old.put("b", "org/b", {"sha": "2"})  # registered again: a new version
    c = old.put("c", "org/c", {"sha": "1"})
    assert a.version < b1.version < b2.version < c.version

    time.sleep(0.01)  # versions are microsecond clock readings; a real restart takes seconds
    new = AdapterDirectory()  # Serve restarted the directory: empty, another epoch
    assert new.epoch != old.epoch and new.report("r1", {}) == (new.epoch, {}, [], [])
    new.remove("c")  # deleted after the restart, before any replica gave it back
    d = new.put("d", "org/d", {"sha": "1"})
    assert d.version > c.version  # never a version a replica may hold from the old directory
    stale_d = DirectoryEntry("d", "org/stale", c.version + 1)
    assert new.restore([a, b1, c]) == {"a": a.version, "b": b1.version, "d": d.version}  # replica 1 knew old b
    assert new.restore([b2, stale_d]) == {"a": a.version, "b": b2.version, "d": d.version}
    assert new.get("b") == b2 and new.get("d").ref == "org/d"  # the newer b wins; d was put here, it stays
    assert new.put("e", "org/e", {}).version > d.version
    b3 = new.put("b", "org/b", {"sha": "3"})
    assert new.restore([b2])["b"] == b3.version  # put since the restart: never replaced by a replica's copy


def test_with_a_state_dir_registrations_survive_a_new_directory(tmp_path):
    """Every put and remove is committed to the state store; a directory started on it (the whole cluster
    restarted) has the same adapters, refs, shas and versions (so replicas keep what they registered)."""
    old = AdapterDirectory(state_dir=tmp_path)
    a = old.put("org/a", "org/a@v1", {"id": "org/a", "sha": "aaa", "rank": 8})
    old.put("org/b", "/adapters/b", {"id": "org/b", "sha": "local-bbb"})
    old.remove("org/b")
    c = old.put("team/c", "org/c", {"id": "team/c", "sha": "ccc"})
    old.restore([DirectoryEntry("org/d", "org/d", c.version + 1, {"sha": "ddd"})])  # given back: kept too
    new = AdapterDirectory(state_dir=tmp_path)
    assert {e.adapter_id: (e.ref, e.info["sha"]) for e in new.entries()} == {
        "org/a": ("org/a@v1", "aaa"),
        "team/c": ("org/c", "ccc"),
        "org/d": ("org/d", "ddd"),
    }
    assert new.versions() == {"org/a": a.version, "team/c": c.version, "org/d": c.version + 1}
    assert new.put("org/e", "org/e", {}).version > c.version + 1
    new.remove("org/a")
    assert {e.adapter_id for e in AdapterDirectory(state_dir=tmp_path).entries()} == {"team/c", "org/d", "org/e"}


def test_a_report_names_recent_removals_until_the_id_is_registered_again():
    directory = AdapterDirectory()
    directory.put("a", "org/a", {"sha": "1"})
    directory.put("b", "org/b", {"sha": "1"})
    directory.remove("a")
    epoch, versions, removed, pinned = directory.report("r1", {})
    assert set(versions) == {"b"} and removed == ["a"]
    directory.put("a", "org/a", {"sha": "2"})
    assert directory.report("r1", {})[1:3] == ({"a": directory.get("a").version, "b": directory.get("b").version}, [])


def test_reconcile_plan_drops_what_the_directory_no_longer_backs():
    """The flake this pins: a replica validates an adapter for the admin route (registered here, not yet adopted),
    and it is deleted before the replica's next report; with the versions alone it was kept for ever."""
    now = 1000.0
    entry = DirectoryEntry("kept", "org/kept", 7, {"sha": "s"})
    changed = DirectoryEntry("changed", "org/changed", 3)
    deleted = DirectoryEntry("deleted", "org/deleted", 4)
    local = {
        "kept": (now - 100, "s"),
        "changed": (now - 100, "s"),  # registered again elsewhere: a new version
        "deleted": (now - 100, "s"),
        "validated": (now - 1, "s"),  # by this replica's admin route, now in the directory: adopt
        "validated-deleted": (now - 1, "s"),  # ... deleted before this report
        "in-flight": (now - 1, "s"),  # validated, the ingress has not recorded it yet: keep
        "orphan": (now - ORPHAN_S - 1, "s"),  # validated long ago and never recorded
    }
    synced = {"kept": entry, "changed": changed, "deleted": deleted}
    versions = {"kept": 7, "changed": 5, "validated": 9}
    adopt, drop = reconcile_plan(local, synced, versions, ["deleted", "validated-deleted"], now)
    assert adopt == ["validated"]
    assert sorted(drop) == ["changed", "deleted", "orphan", "validated-deleted"]
    assert reconcile_plan({}, synced, versions, [], now) == ([], [])


def test_operator_pins_are_bounded_by_the_pinned_slots_kept_across_registrations_and_durable(tmp_path):
    directory = AdapterDirectory(state_dir=tmp_path, max_pinned=1)
    a = directory.put("a", "org/a", {"sha": "1"})
    directory.put("b", "org/b", {"sha": "1"})
    assert directory.pin("nobody", True) == (None, False)
    entry, full = directory.pin("a", True)
    assert entry is not None and entry.pinned and entry.version == a.version and not full  # not a re-registration
    assert directory.pin("a", True)[1] is False  # pinning a pinned one again takes no second slot
    assert directory.pin("b", True) == (directory.get("b"), True)  # the one pinned slot is taken
    assert not directory.get("b").pinned and directory.report("r", {})[3] == ["a"]
    assert directory.put("a", "org/a", {"sha": "2"}).pinned  # registered again (a new revision): still pinned
    assert [e.pinned for e in AdapterDirectory(state_dir=tmp_path).entries()] == [True, False]  # a, b
    directory.pin("a", False)
    assert directory.pin("b", True)[0].pinned and directory.report("r", {})[3] == ["b"]
    restarted = AdapterDirectory(state_dir=tmp_path, max_pinned=1)
    assert {e.adapter_id: e.pinned for e in restarted.entries()} == {"a": False, "b": True}
    assert AdapterDirectory().pin("x", True) == (None, False)
    empty = AdapterDirectory()  # max_pinned 0 (the default): every pin is refused
    empty.put("x", "org/x", {})
    assert empty.pin("x", True)[1] is True
