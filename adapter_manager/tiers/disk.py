"""The disk tier: the adapter repositories this manager downloaded into the HF cache, kept under a byte bound.

Only repositories the manager itself resolved are counted and evicted (`own`); anything else in the cache, such as
the base model's checkpoint, is never touched. With a `store` (the state directory's `StateStore`) ownership is
durable: a tier built after a restart still owns, and evicts, the repos of adapters unregistered before it. Eviction
goes through huggingface_hub's own cache API (its per-repo scan and `HFCacheInfo.delete_revisions(...).execute()`),
least recently used revision first, revisions no registration needs before any that one does; a revision is deleted
from its own repo alone (another repo holding the same commit sha, a mirror say, keeps its files). A repository is
pinned while one of its revisions is downloaded or prepared (`using`), and a pinned repository is never evicted, so a
preparation never loses its files mid-read.

The bound holds at every moment, downloads in flight included: a download first reserves its bytes (`downloading`),
evicting what it must then, and the reservation counts against the bound until the download has landed (or failed
and left nothing). With no room — the rest pinned or reserved — a download that may not wait is refused at once
(`DiskTierFullError`; a prefetch then costs nothing), one that may waits for pins and reservations to go.

Sizes are kept incrementally: each owned repo's folder is read when the tier starts or first owns it, again when a
download lands in it (`landed`) and after an eviction from it; the rest of the cache is never walked. So is the
eviction order (`disk_order.EvictionOrder`): each revision is filed when its repo is read, as needed by a registration
or not (`needed()`, asked then: it must answer in O(1), as the registry's live view does), moved when it is used
(`touch`) or when a registration starts or stops pointing at it (`needed_changed`); a pick costs O(log N) at any
number of owned repos.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Container, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from huggingface_hub import CachedRepoInfo, HFCacheInfo
from huggingface_hub.errors import CorruptedCacheException
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import _cache_manager  # _scan_cached_repo: scan_cache_dir's reading of one repo

from ..errors import DiskTierFullError
from ..metrics import SwapMetrics, Tier
from .disk_order import EvictionOrder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiskUsage:
    """The disk tier at one moment."""

    used_bytes: int  # bytes on disk of the owned repositories
    capacity_bytes: int
    revisions: int  # cached revisions of owned repositories
    reserved_bytes: int = 0  # held for downloads under way (counted against the bound beside used_bytes)


class OwnershipStore(Protocol):
    """Where a disk tier keeps the repos it owns across restarts (`registry.StateStore`)."""

    def owned_repos(self, cache_dir: Path) -> set[str]: ...

    def set_owned(self, cache_dir: Path, repo_id: str, owned: bool) -> None: ...


class DiskTier:
    """Bounds the bytes of owned adapter repositories in one HF cache directory; thread-safe.

    `needed` tells which (repo_id, sha) revisions registrations point at (cheap to ask: a live view, whose changes
    are reported with `needed_changed`): revisions nobody needs go first. `store` keeps ownership durable; without
    one it lives as long as the tier.
    """

    def __init__(
        self,
        cache_dir: Path,
        capacity_bytes: int,
        metrics: SwapMetrics,
        needed: Callable[[], Container[tuple[str, str]]] = set,
        store: OwnershipStore | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"disk_cache_bytes must be positive, got {capacity_bytes}")
        self.cache_dir = Path(cache_dir)
        self.capacity_bytes = capacity_bytes
        self._metrics = metrics
        self._needed = needed
        self._store = store
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a pin, reservation or eviction went: room may have come
        self._reserved: dict[str, int] = {}  # repo -> bytes held for its download under way
        self._owned: set[str] = set()
        self._repos: dict[str, CachedRepoInfo] = {}  # owned repo -> its folder as last read; absent: not cached
        self._on_disk = 0  # the sum of _repos' sizes on disk, kept as they are read
        self._pins: dict[str, int] = {}
        self._last_used: dict[tuple[str, str], float] = {}  # revision -> when touched last (survives its eviction)
        self._order = EvictionOrder()  # every revision of _repos, in eviction order
        self.evicted_bytes = 0
        with self._lock:
            for repo_id in sorted(store.owned_repos(self.cache_dir)) if store is not None else ():
                self._owned.add(repo_id)
                if not self._read(repo_id):
                    self._disown(repo_id)  # left the cache while the manager was down

    def own(self, repo_id: str) -> None:
        """Count `repo_id` as one of the manager's adapter repositories (evictable)."""
        with self._lock:
            self._own(repo_id)

    @contextmanager
    def using(self, repo_id: str) -> Iterator[None]:
        """Pin every revision of `repo_id` while the block runs (a download or a preparation)."""
        with self._lock:
            self._own(repo_id)
            self._pins[repo_id] = self._pins.get(repo_id, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._pins[repo_id] -= 1
                if not self._pins[repo_id]:
                    del self._pins[repo_id]
                self._changed.notify_all()

    @contextmanager
    def downloading(self, repo_id: str, nbytes: int, adapter: str, wait_s: float = 0.0) -> Iterator[None]:
        """Hold `nbytes` of the bound for a download into `repo_id` while the block runs, evicting least recently
        used unpinned revisions first as needed; afterwards the repo's folder is read again (what landed is counted)
        and the hold given back. Raises `DiskTierFullError` for `adapter` when there is no room within `wait_s`."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            self._own(repo_id)
            while not self._make_room(nbytes):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DiskTierFullError(
                        adapter,
                        f"no room in the disk tier for its {nbytes} B download: {self._used()} B of "
                        f"{self.capacity_bytes} B are held by repos being read or downloaded",
                    )
                self._changed.wait(remaining)
            self._reserved[repo_id] = self._reserved.get(repo_id, 0) + nbytes
        try:
            yield
        finally:
            with self._lock:
                self._reserved[repo_id] -= nbytes
                if not self._reserved[repo_id]:
                    del self._reserved[repo_id]
                self._read(repo_id)
                self._changed.notify_all()

    def landed(self, repo_id: str) -> None:
        """A download into `repo_id` finished: read that repo's folder again (its new size), nothing else."""
        with self._lock:
            self._own(repo_id)
            self._read(repo_id)

    def touch(self, repo_id: str, sha: str) -> None:
        """Mark a revision used now (LRU order)."""
        with self._lock:
            self._last_used[(repo_id, sha)] = now = time.time()
            self._order.touch((repo_id, sha), now)

    def needed_changed(self, repo_id: str, sha: str) -> None:
        """A registration started or stopped pointing at this revision: file it by what `needed()` says now."""
        with self._lock:
            self._order.set_needed((repo_id, sha), (repo_id, sha) in self._needed())

    def usage(self) -> DiskUsage:
        with self._lock:
            repos, reserved = list(self._repos.values()), sum(self._reserved.values())
        used = sum(r.size_on_disk for r in repos)
        return DiskUsage(used, self.capacity_bytes, sum(len(r.revisions) for r in repos), reserved)

    def enforce(self) -> int:
        """Evict least recently used unpinned revisions until the owned repositories fit; returns bytes freed.
        Revisions of pinned repositories are kept (logged when they alone exceed the bound)."""
        with self._lock:
            before = self.evicted_bytes
            self._make_room(0)
            used = self._used()
            if used > self.capacity_bytes:
                log.warning(
                    "disk tier: %d bytes in use, over the %d byte bound: the rest is in use", used, self.capacity_bytes
                )
            return self.evicted_bytes - before

    def _used(self) -> int:
        """Bytes counted against the bound: owned repos on disk plus reservations. Lock held."""
        return self._on_disk + sum(self._reserved.values())

    def _make_room(self, nbytes: int) -> bool:
        """Evict least recently used revisions of unpinned, unreserved repos (ones no registration needs first)
        until `nbytes` more fit under the bound; whether they do. Lock held."""
        while self._used() + nbytes > self.capacity_bytes:
            busy = self._pins.keys() | self._reserved.keys()
            victim = self._order.oldest(busy, self._needed)
            if victim is None:
                break
            repo, sha = self._repos[victim[0]], victim[1]
            info = HFCacheInfo(
                size_on_disk=repo.size_on_disk,
                repos=frozenset({repo}),
                incomplete_files=frozenset(),
                warnings=[],
                cache_dir=self.cache_dir,
            )
            strategy = info.delete_revisions(sha)  # within this one repo: a repo sharing the sha keeps its own files
            strategy.execute()
            self.evicted_bytes += strategy.expected_freed_size
            self._last_used.pop((repo.repo_id, sha), None)
            if not self._read(repo.repo_id):
                self._disown(repo.repo_id)
            self._metrics.evicted(Tier.DISK)
            log.info("disk tier: evicted %s@%s (%d bytes)", repo.repo_id, sha[:12], strategy.expected_freed_size)
        self._metrics.disk_usage(self._on_disk, self.capacity_bytes, self.evicted_bytes)
        return self._used() + nbytes <= self.capacity_bytes

    def _own(self, repo_id: str) -> None:
        """Own `repo_id` (durably, before anything is downloaded into it) and read its folder if new. Lock held."""
        if repo_id in self._owned:
            return
        if self._store is not None:
            self._store.set_owned(self.cache_dir, repo_id, True)
        self._owned.add(repo_id)
        self._read(repo_id)

    def _disown(self, repo_id: str) -> None:
        """`repo_id` has left the cache: own it no more (it is owned again when downloaded again). Lock held."""
        if self._store is not None:
            self._store.set_owned(self.cache_dir, repo_id, False)
        self._owned.discard(repo_id)

    def _read(self, repo_id: str) -> bool:
        """Read one owned repo's folder into `_repos` and its revisions into the eviction order; False when the repo
        is not in the cache. Lock held."""
        path = self.cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model")
        old = self._repos.pop(repo_id, None)
        self._on_disk -= old.size_on_disk if old is not None else 0
        for revision in old.revisions if old is not None else ():
            self._order.remove((repo_id, revision.commit_hash))
        if not path.is_dir():
            return False
        try:
            self._repos[repo_id] = info = _cache_manager._scan_cached_repo(path)
            self._on_disk += info.size_on_disk
        except CorruptedCacheException as err:  # a download under way, or broken by hand: counted as empty
            log.warning("disk tier: %s not counted: %s", repo_id, err)
            return True
        needed = self._needed() if info.revisions else ()
        for revision in info.revisions:  # filed after every other repo's: ties in time go to the repo read first
            key = (repo_id, revision.commit_hash)
            self._order.put(key, self._last_used.get(key, revision.last_modified), key in needed)
        return True
