"""The disk tier's eviction order: every cached revision of its owned repositories, revisions no registration needs
before any that one does, each kind least recently used first.

Two binary heaps of ``(used_at, seq, repo_id, sha, needed)`` entries, one per kind, with lazy deletion: a revision's
current entry is the one ``_current`` holds; a touch, a re-read or a change of kind pushes a new entry and leaves the
old one in its heap until it surfaces (or a heap grown past twice its live entries is rebuilt). Every change is
O(log N) and the pick amortized O(log N), skipping only the revisions of busy repositories at the heaps' heads.
``seq`` orders revisions used at the same moment by when they were filed, as the tier's list of repos did.

    Worked example: a@1 filed at t=5 (needed), b@2 at t=3 (needed), c@3 at t=9 (needed by none):
    oldest() -> c@3 (nobody needs it); then, c gone, -> b@2; with b's repo busy -> a@1.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Container
from typing import NamedTuple

Revision = tuple[str, str]  # (repo_id, commit sha)


class _Entry(NamedTuple):
    used_at: float
    seq: int
    repo_id: str
    sha: str
    needed: bool


class EvictionOrder:
    """Owned revisions in eviction order; not thread-safe (the disk tier's lock guards it)."""

    def __init__(self) -> None:
        self._heaps: dict[bool, list[_Entry]] = {False: [], True: []}  # needed -> its revisions, a heap
        self._current: dict[Revision, _Entry] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._current)

    def __contains__(self, revision: object) -> bool:
        return revision in self._current

    def put(self, revision: Revision, used_at: float, needed: bool) -> None:
        """File `revision` (again) as used at `used_at` and needed or not, after every revision filed before."""
        self._push(_Entry(used_at, next(self._seq), *revision, needed))

    def touch(self, revision: Revision, used_at: float) -> None:
        """A filed revision was used at `used_at`: it moves behind every revision filed before; a no-op for one not
        filed."""
        entry = self._current.get(revision)
        if entry is not None:
            self._push(entry._replace(used_at=used_at, seq=next(self._seq)))

    def set_needed(self, revision: Revision, needed: bool) -> None:
        """Move a filed revision to the other kind, keeping its place in time; a no-op if it is already there."""
        entry = self._current.get(revision)
        if entry is not None and entry.needed != needed:
            self._push(entry._replace(needed=needed))

    def remove(self, revision: Revision) -> None:
        """Forget `revision` (its heap entry goes when it surfaces); a no-op for one not filed."""
        self._current.pop(revision, None)

    def oldest(self, busy: Container[str], needed: Callable[[], Container[Revision]]) -> Revision | None:
        """The revision to evict first: the least recently used one nobody needs, else the least recently used
        needed one, never one of a `busy` repository; None when every revision is busy. Its kind is checked against
        `needed()` (asked once, only when something is filed) and a revision filed under the wrong one refiled."""
        now: Container[Revision] | None = None
        for kind in (False, True):
            heap, skipped = self._heaps[kind], []
            try:
                while heap:
                    entry = heap[0]
                    if self._current.get((entry.repo_id, entry.sha)) is not entry:
                        heapq.heappop(heap)  # superseded or removed
                        continue
                    if entry.repo_id in busy:
                        skipped.append(heapq.heappop(heap))
                        continue
                    now = needed() if now is None else now
                    if ((entry.repo_id, entry.sha) in now) == kind:
                        return entry.repo_id, entry.sha
                    if kind:  # needed by none now: it goes first
                        return entry.repo_id, entry.sha
                    self._push(entry._replace(needed=True))
            finally:
                for entry in skipped:
                    heapq.heappush(heap, entry)
        return None

    def _push(self, entry: _Entry) -> None:
        self._current[(entry.repo_id, entry.sha)] = entry
        heap = self._heaps[entry.needed]
        heapq.heappush(heap, entry)
        if len(heap) > 2 * len(self._current) + 64:  # mostly superseded entries: keep only the live ones
            live = [e for e in heap if self._current.get((e.repo_id, e.sha)) is e]
            heapq.heapify(live)
            self._heaps[entry.needed] = live
