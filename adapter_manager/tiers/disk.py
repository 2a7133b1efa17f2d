"""The disk tier: the adapter repositories this manager downloaded into the HF cache, kept under a byte bound.

Only repositories the manager itself resolved are counted and evicted (`own`); anything else in the cache, such as
the base model's checkpoint, is never touched. Eviction goes through huggingface_hub's own cache API
(`scan_cache_dir` and `HFCacheInfo.delete_revisions(...).execute()`), least recently used revision first, revisions
no registration needs before any that one does. A repository is pinned while one of its revisions is downloaded or
prepared (`using`), and a pinned repository is never evicted, so a preparation never loses its files mid-read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import CachedRepoInfo, CachedRevisionInfo, HFCacheInfo, scan_cache_dir
from huggingface_hub.errors import CacheNotFound

from ..metrics import SwapMetrics, Tier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiskUsage:
    """The disk tier at one moment."""

    used_bytes: int  # bytes on disk of the owned repositories
    capacity_bytes: int
    revisions: int  # cached revisions of owned repositories


class DiskTier:
    """Bounds the bytes of owned adapter repositories in one HF cache directory; thread-safe.

    `needed` tells which (repo_id, sha) revisions registrations point at: revisions nobody needs go first.
    """

    def __init__(
        self,
        cache_dir: Path,
        capacity_bytes: int,
        metrics: SwapMetrics,
        needed: Callable[[], set[tuple[str, str]]] = set,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"disk_cache_bytes must be positive, got {capacity_bytes}")
        self.cache_dir = Path(cache_dir)
        self.capacity_bytes = capacity_bytes
        self._metrics = metrics
        self._needed = needed
        self._lock = threading.Lock()
        self._owned: set[str] = set()
        self._pins: dict[str, int] = {}
        self._last_used: dict[tuple[str, str], float] = {}
        self.evicted_bytes = 0

    def own(self, repo_id: str) -> None:
        """Count `repo_id` as one of the manager's adapter repositories (evictable)."""
        with self._lock:
            self._owned.add(repo_id)

    @contextmanager
    def using(self, repo_id: str) -> Iterator[None]:
        """Pin every revision of `repo_id` while the block runs (a download or a preparation)."""
        with self._lock:
            self._owned.add(repo_id)
            self._pins[repo_id] = self._pins.get(repo_id, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._pins[repo_id] -= 1
                if not self._pins[repo_id]:
                    del self._pins[repo_id]

    def touch(self, repo_id: str, sha: str) -> None:
        """Mark a revision used now (LRU order)."""
        with self._lock:
            self._last_used[(repo_id, sha)] = time.time()

    def usage(self) -> DiskUsage:
        with self._lock:
            repos = self._owned_repos(self._scan())
        return DiskUsage(sum(r.size_on_disk for r in repos), self.capacity_bytes, sum(len(r.revisions) for r in repos))

    def enforce(self) -> int:
        """Evict least recently used unpinned revisions until the owned repositories fit; returns bytes freed.
        Revisions of pinned repositories are kept (logged when they alone exceed the bound)."""
        freed, kept = 0, set()
        with self._lock:
            while True:
                info = self._scan()
                repos = self._owned_repos(info)
                used = sum(r.size_on_disk for r in repos)
                candidates = [
                    (r.repo_id, rev)
                    for r in repos
                    if r.repo_id not in self._pins
                    for rev in r.revisions
                    if rev.commit_hash not in kept
                ]
                if used <= self.capacity_bytes or not candidates:
                    break
                needed = self._needed()
                repo_id, revision = min(
                    candidates, key=lambda c: ((c[0], c[1].commit_hash) in needed, self._used_at(c[0], c[1]))
                )
                holders = [r for r in info.repos for rev in r.revisions if rev.commit_hash == revision.commit_hash]
                if len(holders) > 1:  # delete_revisions would delete it from every holder, owned or not
                    log.warning(
                        "disk tier: %s@%s shares its sha with another repo; kept", repo_id, revision.commit_hash
                    )
                    kept.add(revision.commit_hash)
                    continue
                strategy = info.delete_revisions(revision.commit_hash)
                strategy.execute()
                freed += strategy.expected_freed_size
                self._last_used.pop((repo_id, revision.commit_hash), None)
                self._metrics.evicted(Tier.DISK)
                log.info("disk tier: evicted %s@%s (%d bytes)", repo_id, revision.commit_hash[:12], freed)
            self.evicted_bytes += freed
            self._metrics.disk_usage(used, self.capacity_bytes, self.evicted_bytes)
            if used > self.capacity_bytes:
                log.warning(
                    "disk tier: %d bytes in use, over the %d byte bound: the rest is in use", used, self.capacity_bytes
                )
        return freed

    def _scan(self) -> HFCacheInfo | None:
        try:
            return scan_cache_dir(self.cache_dir)
        except CacheNotFound:
            return None

    def _owned_repos(self, info: HFCacheInfo | None) -> list[CachedRepoInfo]:
        if info is None:
            return []
        return [r for r in info.repos if r.repo_type == "model" and r.repo_id in self._owned]

    def _used_at(self, repo_id: str, revision: CachedRevisionInfo) -> float:
        return self._last_used.get((repo_id, revision.commit_hash), revision.last_modified)
