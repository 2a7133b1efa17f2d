"""The cluster's adapter directory: registration recorded once, and the latest report of every replica.

Registration is validated once, by the replica that answers the admin request (the single-machine admin route, with
its typed errors), then recorded here. Every other replica registers an adapter lazily, on its first request for it,
from the same hub ref (huggingface_hub's cache makes that a disk read on a shared node). A deleted adapter leaves
the directory at once (the ingress refuses it from then on); replicas unregister it at their next report
(`reconcile_plan`), including a replica that validated it and was deleted before it adopted the directory's entry.
An operator pin is a flag on the entry (at most `max_pinned`, the cluster's pinned slots per replica): from its next
report every replica holds the adapter in a slot of its own, outside Serve's model count.

The directory is one Serve replica. With a `state_dir` every put and remove is written through to a sqlite3 state
store (`adapter_manager.StateStore`, one committed transaction each) before it answers, and a directory that starts
loads it: registrations survive a restart of the whole cluster. Loaded entries keep the ref, sha, id and pin; the rest
of the validating replica's answer (rank, bytes, ...) is not stored. Without one it keeps its entries in memory.
Either way, if its process dies Serve starts a new one with a new `epoch`; each engine replica sees the new epoch in
the answer to its next report and gives back every entry it knows (`restore`) before it reconciles: each replica
mirrors the directory's entries from its reports (`entries_of` fetches the ones new to it), not only those it
registered from, so a directory crash loses no registration that a live replica has reported since. A replica that
validated or served an adapter and then died takes nothing with it. Versions survive in the store, so
after a restart replicas find theirs unchanged and keep what they registered. Until every replica has reported
(one `stats_period_s`), the ingress may answer 404 for an adapter not yet given back."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adapter_manager import Registration, StateStore

ORPHAN_S = 30.0  # a registration validated here that the directory never recorded (the put failed) is dropped after


@dataclass(frozen=True)
class DirectoryEntry:
    """One registered adapter: the ref replicas register it from, and what the validating replica answered."""

    adapter_id: str
    ref: str  # hub id[@revision] or local directory, as registered
    version: int  # bumped on every (re-)registration, so replicas know to register it again
    info: dict[str, Any] = field(default_factory=dict)  # the admin API's answer (source, sha, rank, bytes, ...)
    pinned: bool = False  # operator pin: held in a slot on every replica


class AdapterDirectory:
    """Plain state behind the directory deployment (one replica); every method is a short critical section."""

    def __init__(self, report_ttl_s: float = 30.0, state_dir: Path | None = None, max_pinned: int = 0) -> None:
        self.epoch = uuid.uuid4().hex  # a directory restarted by Serve has a new one
        self._entries: dict[str, DirectoryEntry] = {}
        self._restored: set[str] = set()  # entries given back by replicas, not put since
        self._removed: dict[str, float] = {}  # removed since this directory started (never given back) -> when
        self._reports: dict[str, tuple[float, dict[str, Any]]] = {}
        # A version is its registration's time in microseconds (kept unique): a new directory numbers past every
        # version an old one gave out, and the state store keeps it exactly as the row's registered_at.
        self._version = time.time_ns() // 1000
        self._ttl = report_ttl_s
        self._max_pinned = max_pinned  # the cluster's pinned slots per replica
        self._store = StateStore(state_dir) if state_dir is not None else None
        for row in self._store.load() if self._store is not None else ():
            version = round(row.registered_at * 1e6)
            self._version = max(self._version, version)
            info = {"id": row.adapter_id, "sha": row.sha}
            self._entries[row.adapter_id] = DirectoryEntry(row.adapter_id, row.ref, version, info, row.pinned)

    def put(self, adapter_id: str, ref: str, info: dict[str, Any]) -> DirectoryEntry:
        old = self._entries.get(adapter_id)
        pinned = old is not None and old.pinned  # registering again keeps an operator pin, as on one server
        if old is not None and old.ref == ref and old.info.get("sha") == info.get("sha"):
            entry = DirectoryEntry(adapter_id, ref, old.version, info, pinned)
        else:
            self._version = max(self._version + 1, time.time_ns() // 1000)
            entry = DirectoryEntry(adapter_id, ref, self._version, info, pinned)
        self._write(entry)
        self._entries[adapter_id] = entry
        self._restored.discard(adapter_id)
        self._removed.pop(adapter_id, None)
        return entry

    def pin(self, adapter_id: str, pinned: bool) -> tuple[DirectoryEntry | None, bool]:
        """Set an adapter's operator pin: (its entry, or None if unknown; whether it was refused because every
        pinned slot is taken). Replicas apply it at their next report."""
        entry = self._entries.get(adapter_id)
        if entry is None:
            return None, False
        if pinned and not entry.pinned and sum(e.pinned for e in self._entries.values()) >= self._max_pinned:
            return entry, True
        entry = dataclasses.replace(entry, pinned=pinned)
        self._entries[adapter_id] = entry
        if self._store is not None:
            self._store.set_pinned(adapter_id, pinned)
        return entry, False

    def remove(self, adapter_id: str) -> bool:
        if self._store is not None:
            self._store.delete(adapter_id)
        self._removed[adapter_id] = time.monotonic()
        self._restored.discard(adapter_id)
        return self._entries.pop(adapter_id, None) is not None

    def restore(self, entries: list[DirectoryEntry]) -> dict[str, int]:
        """A replica gives back the entries it registered from after this directory started empty. An entry removed
        or put since is kept as it is; of two replicas' versions of one adapter the newer wins. Later versions are
        numbered past every one given back. Answers like `report`."""
        for entry in entries:
            self._version = max(self._version, entry.version)
            current = self._entries.get(entry.adapter_id)
            if entry.adapter_id in self._removed:
                continue
            if current is None or (entry.adapter_id in self._restored and entry.version > current.version):
                self._write(entry)
                self._entries[entry.adapter_id] = entry
                self._restored.add(entry.adapter_id)
        return self.versions()

    def _write(self, entry: DirectoryEntry) -> None:
        if self._store is not None:
            sha = str(entry.info.get("sha") or "")
            row = Registration(entry.adapter_id, entry.ref, None, sha, entry.pinned, registered_at=entry.version / 1e6)
            self._store.put(row, keep_pin=False)

    def get(self, adapter_id: str) -> DirectoryEntry | None:
        return self._entries.get(adapter_id)

    def entries_of(self, adapter_ids: Collection[str]) -> list[DirectoryEntry]:
        """The current entries of those ids still registered (a replica's mirror catching up after a report)."""
        return [self._entries[a] for a in adapter_ids if a in self._entries]

    def entries(self) -> list[DirectoryEntry]:
        return list(self._entries.values())

    def versions(self) -> dict[str, int]:
        return {a: e.version for a, e in self._entries.items()}

    def report(self, replica: str, snapshot: dict[str, Any]) -> tuple[str, dict[str, int], list[str], list[str]]:
        """A replica's periodic report; answers with this directory's epoch, the adapters the replica may keep
        (id -> version), the ids removed in the last `ORPHAN_S` (and not put again; older ones are orphans) and the
        operator-pinned ids."""
        self._reports[replica] = (time.time(), snapshot)
        recent = time.monotonic() - ORPHAN_S
        removed = sorted(a for a, at in self._removed.items() if at >= recent)
        return self.epoch, self.versions(), removed, sorted(a for a, e in self._entries.items() if e.pinned)

    def reports(self) -> dict[str, dict[str, Any]]:
        """The live replicas' latest reports, each with its age; reports older than the TTL (dead replicas) go."""
        now = time.time()
        for replica in [r for r, (at, _) in self._reports.items() if now - at > self._ttl]:
            del self._reports[replica]
        return {r: {**snapshot, "age_s": round(now - at, 3)} for r, (at, snapshot) in self._reports.items()}


def reconcile_plan(
    local: Mapping[str, tuple[float, str]],
    synced: Mapping[str, DirectoryEntry],
    versions: Mapping[str, int],
    removed: Collection[str],
    now: float,
) -> tuple[list[str], list[str]]:
    """What a replica does with its registrations (`local`: id -> (registered_at, sha)) at a report: the ids to
    adopt (registered here by the admin route, now in the directory: the caller checks the entry's sha) and the ids
    to unregister. A registration from a directory entry goes when the entry's version changes or it is removed; one
    validated here but never adopted goes when the directory says it was removed, or after `ORPHAN_S` if the
    directory never had it."""
    adopt: list[str] = []
    drop: list[str] = []
    for adapter_id, (registered_at, _sha) in local.items():
        known = synced.get(adapter_id)
        if known is not None:
            if versions.get(adapter_id) != known.version:  # deleted, or registered again from elsewhere
                drop.append(adapter_id)
        elif adapter_id in versions:
            adopt.append(adapter_id)
        elif adapter_id in removed or now - registered_at > ORPHAN_S:
            drop.append(adapter_id)
    return adopt, drop
