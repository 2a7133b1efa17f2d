"""A registered adapter's files on disk: a local directory as registered, or its hub revision in the HF cache,
fetched again at the recorded sha if it left, kept in the bounded disk tier's books.

The registry reads files only through here, so every read holds its repo against eviction (`on_disk`), every
download again reserves its bytes first, and every use refreshes the repo's LRU place (`used`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import AdapterConflictError
from ..metrics import Move, SwapMetrics, Tier
from ..sources.hub import AdapterFiles, AdapterRef, HubResolver
from ..tiers.disk import DiskTier
from .records import AdapterRecord

log = logging.getLogger(__name__)


class DiskFiles:
    """The registry's way to adapter files: the hub resolver and the disk tier (None: the HF cache unbounded)."""

    def __init__(self, resolver: HubResolver, disk: DiskTier | None, metrics: SwapMetrics) -> None:
        self.resolver = resolver
        self.disk = disk
        self.metrics = metrics

    def files(self, record: AdapterRecord, disk_wait_s: float = 0.0) -> AdapterFiles:
        """The record's files on disk now (:meth:`on_hand`), or the hub revision at the recorded sha fetched again (a
        disk miss) when it left the cache, its bytes reserved first in a bounded disk tier (waiting up to
        `disk_wait_s` for room)."""
        found = self.on_hand(record)
        if found is not None:
            return found
        adapter_id = record.adapter_id
        self.metrics.miss(Tier.DISK)
        start = time.perf_counter()
        with self._download_room(record, disk_wait_s):
            files = self.resolver.resolve(AdapterRef(record.ref.repo_id, record.sha, None), adapter_id)
        self.metrics.record(Move.HUB_TO_DISK, adapter_id, time.perf_counter() - start, files.downloaded_bytes)
        return files

    def on_hand(self, record: AdapterRecord) -> AdapterFiles | None:
        """The record's files without fetching anything: a local dir whose content is unchanged since registration
        (`AdapterConflictError` otherwise), or the hub revision at the recorded sha if it is in the cache (a disk
        hit); None when it left the cache."""
        if record.ref.is_local:
            files = self.resolver.resolve(record.ref, record.adapter_id)
            if record.digest and files.digest != record.digest:
                raise AdapterConflictError(
                    record.adapter_id, f"files in {record.ref} changed since registration; register with refresh=True"
                )
            return files
        cached = self.resolver.cached(record.ref.repo_id, record.sha)
        if cached is not None:
            self.metrics.hit(Tier.DISK)
        return cached

    @contextmanager
    def on_disk(self, repo_id: str | None) -> Iterator[None]:
        """Keep a hub repo's cached files from disk-tier eviction while the block downloads or reads them."""
        if self.disk is None or repo_id is None:
            yield
            return
        with self.disk.using(repo_id):
            yield

    def used(self, record: AdapterRecord, grew: bool, enforce: bool = True) -> None:
        """A hub adapter's files were just used: refresh their LRU position and, if a download `grew` the cache,
        count the repo's new size and (`enforce`) bring the disk tier back under its bound (a disk hit reads
        nothing)."""
        if self.disk is None or record.ref.repo_id is None:
            return
        self.disk.touch(record.ref.repo_id, record.sha)
        if grew:
            try:
                self.disk.landed(record.ref.repo_id)
                if enforce:
                    self.disk.enforce()
            except OSError as err:
                log.error("disk tier: eviction failed: %s", err)

    @contextmanager
    def _download_room(self, record: AdapterRecord, wait_s: float) -> Iterator[None]:
        """Hold the bytes of the record's files in a bounded disk tier while they are downloaded again."""
        if self.disk is None or record.ref.repo_id is None:
            yield
            return
        with self.disk.downloading(record.ref.repo_id, record.disk_bytes, record.adapter_id, wait_s):
            yield
