"""The hub revisions registrations point at, counted: what a bounded disk tier evicts last.

The disk tier asks the live view (`NeededRevisions.view`, O(1) to ask) when it files a revision, and is told
(`DiskTier.needed_changed`) whenever a revision's count reaches or leaves zero, so nobody computes the set over every
registration again.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Set

from ..tiers.disk import DiskTier
from .records import AdapterRecord


class NeededRevisions:
    """(repo_id, sha) -> the registrations pointing at it; thread-safe."""

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def view(self) -> Set[tuple[str, str]]:
        """The revisions some registration points at now: a live view, not a copy."""
        return self._counts.keys()

    def count(self, record: AdapterRecord | None, step: int, disk: DiskTier | None) -> None:
        """One registration more (`step` 1) or fewer (-1) points at `record`'s hub revision (none for a local
        directory or no record); `disk` refiles the revision when it became needed or stopped being."""
        if record is None or record.ref.repo_id is None:
            return
        revision = (record.ref.repo_id, record.sha)
        with self._lock:
            self._counts[revision] += step
            left = self._counts[revision]
            if not left:
                del self._counts[revision]
        if disk is not None and left == (1 if step > 0 else 0):  # 0 -> 1 or 1 -> 0: it became needed or not
            disk.needed_changed(*revision)
