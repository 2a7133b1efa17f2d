"""The adapter registry: ref -> downloaded, validated, prepared adapter, and its record.

Registered is not resident: a record names the local files (HF cache or a local directory) an adapter can be
prepared from again at any time; the prepared weights live in the byte-bounded host tier and may be evicted.
`validation` says what an adapter must be to be accepted; `disk_files` reads its files and keeps the disk tier's books.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from ..base_model import BaseModelSpec
from ..errors import AdapterConflictError, AdapterNotFoundError, DiskTierFullError, UnsupportedAdapterError
from ..metrics import Move, SwapMetrics, Tier
from ..sources.hub import AdapterFiles, AdapterRef, HubResolver
from ..sources.peft_format import Variant
from ..tiers.disk import DiskTier
from ..tiers.host import HostTier
from ..tiers.prepare import PreparedAdapter, check_weights, prepare_adapter
from ..tiers.row_layout import RowLayout, checked_layout
from ..tiers.vectors import BaseWeight
from .disk_files import DiskFiles
from .needed import NeededRevisions
from .records import AdapterRecord, RegisterResult, RegistryConfig, check_adapter_id
from .state_store import Registration, StateStore, UnrestoredAdapter
from .validation import check_local_root, read_config

log = logging.getLogger(__name__)

_GIB = 1 << 30


class AdapterRegistry:
    """Registers adapters by hub ID or local directory, validates them against the base model, prepares them."""

    def __init__(
        self,
        spec: BaseModelSpec,
        config: RegistryConfig | None = None,
        metrics: SwapMetrics | None = None,
        layout: RowLayout | None = None,
    ):
        self.spec = spec
        self.config = config or RegistryConfig()
        self.metrics = metrics or SwapMetrics()
        self.layout = checked_layout(spec, self.config.rows, layout)
        """The row layout prepared blocks are built in (the manager's one, its pool's too): one section per shard."""
        self.base_weight: BaseWeight | None = None
        """The served base model's weight of a module (`tiers.vectors.BaseWeight`): what a DoRA adapter's scale and
        trainable tokens' rows are prepared from; None until a model is attached
        (`AdapterManager.attach_base_weights`)."""
        largest = self.config.rows.max_rank * self.layout.row_bytes(self.config.dtype)
        if self.config.host_cache_bytes < largest:
            raise ValueError(
                f"host_cache_bytes ({self.config.host_cache_bytes / _GIB:.3f} GiB) is smaller than one adapter at "
                f"max_rank {self.config.rows.max_rank} targeting every module ({largest / _GIB:.3f} GiB)"
            )
        self.host = HostTier(self.config.host_cache_bytes, self.metrics)
        self._resolver = HubResolver(self.config.hub)
        self._records: dict[str, AdapterRecord] = {}
        self._unrestored: dict[str, UnrestoredAdapter] = {}
        self._lock = threading.Lock()
        self._generations = itertools.count(1)
        self._id_locks: dict[str, threading.Lock] = {}
        self.store = StateStore(self.config.state_dir) if self.config.state_dir is not None else None
        self.disk: DiskTier | None = None
        self._needed = NeededRevisions()  # what the disk tier evicts last
        if self.config.disk_cache_bytes is not None:
            cache, bound = self._resolver.cache_dir, self.config.disk_cache_bytes
            self.disk = DiskTier(cache, bound, self.metrics, self._needed.view, self.store)
        self._disk_files = DiskFiles(self._resolver, self.disk, self.metrics)

    def register(self, ref: str, adapter_id: str | None = None, refresh: bool = False) -> RegisterResult:
        """Register `ref` under `adapter_id` (default: the repo id, or the local directory's name).

        Registering the same ref again changes nothing and touches no network unless `refresh` (re-resolve a branch,
        read a local directory again). An adapter is its content (`AdapterRecord.digest`): the same bytes at another
        revision are `unchanged` (the record follows the new revision; nothing derived from the adapter is dropped),
        other bytes are an update, fully validated before they replace the old ones, which stay served if the new
        ones fail. A different source under a registered id raises `AdapterConflictError`.
        """
        parsed = AdapterRef.parse(ref)
        check_local_root(parsed, ref, self.config.allowed_local_roots)
        adapter_id = check_adapter_id(adapter_id or (parsed.repo_id if parsed.repo_id else parsed.path.name))
        with self._id_lock(adapter_id):
            previous = self._records.get(adapter_id)
            if previous is not None:
                if (previous.ref.repo_id, previous.ref.path) != (parsed.repo_id, parsed.path):
                    raise AdapterConflictError(
                        adapter_id, f"already registered from {previous.ref}; unregister it before using {parsed}"
                    )
                if previous.ref == parsed and not refresh:
                    return RegisterResult(previous, "unchanged", None, 0.0, 0.0, 0)
            with self._disk_files.on_disk(parsed.repo_id):
                start = time.perf_counter()
                files = self._resolver.resolve(parsed, adapter_id)
                download_s = time.perf_counter() - start
                if not parsed.is_local:
                    self.metrics.record(Move.HUB_TO_DISK, adapter_id, download_s, files.downloaded_bytes)
                    (self.metrics.miss if files.downloaded_bytes else self.metrics.hit)(Tier.DISK)
                if previous is not None and previous.digest == files.digest:
                    record = replace(previous, ref=parsed, files=files, disk_bytes=files.nbytes())
                    self._persist(record)
                    self._publish(adapter_id, record)
                    self._disk_files.used(record, files.downloaded_bytes > 0)
                    return RegisterResult(record, "unchanged", None, download_s, 0.0, files.downloaded_bytes)
                record, prepared, prepare_s = self._load(adapter_id, parsed, files)
                record = replace(record, generation=next(self._generations))
                self._persist(record, keep_pin=previous is not None)
                self._publish(adapter_id, record)
            if prepared.complete:  # DoRA / trainable tokens before a model is attached: prepared at first use
                self.host.put((adapter_id, record.digest), prepared)
            if previous is not None:
                self.host.discard((adapter_id, previous.digest))
                log.info("adapter %r updated %s -> %s", adapter_id, previous.digest[:12], record.digest[:12])
        self._disk_files.used(record, files.downloaded_bytes > 0)
        action = "registered" if previous is None else "updated"
        return RegisterResult(
            record, action, previous.sha if previous else None, download_s, prepare_s, files.downloaded_bytes
        )

    def unregister(self, adapter_id: str) -> AdapterRecord | None:
        """Forget an adapter (its durable row first) and drop its prepared weights from the host tier. Its files
        stay in the HF cache (the disk tier evicts them first when bounded). Returns None for an adapter that
        was never restored."""
        with self._id_lock(adapter_id):
            with self._lock:
                known = adapter_id in self._records or adapter_id in self._unrestored
            if not known:
                raise AdapterNotFoundError(adapter_id, "not registered")
            if self.store is not None:
                self.store.delete(adapter_id)
            record = self._publish(adapter_id, None)
        if record is not None:
            self.host.discard((adapter_id, record.digest))
        return record

    def set_pinned(self, adapter_id: str, pinned: bool) -> None:
        """Record an operator pin durably (re-applied by the manager on restore)."""
        if self.store is not None:
            self.store.set_pinned(adapter_id, pinned)

    def restore(self) -> list[Registration]:
        """Register again every durable registration at its recorded sha, from the HF cache without contacting the
        hub (files that left the cache are downloaded again at that sha). One that fails is logged, counted and
        listed by `unrestored()`; the others go on. Returns the registrations restored.

        Restoring prepares nothing: each record is rebuilt from its files (both present, the config validated as at
        registration, the weights file's header checked: whole, keys, shapes, dtypes), and the adapter is prepared
        on first use through the host tier, as after a host eviction. What only reading every value finds (NaN or
        infinity) is found then, and fails that request as a cold load's would; the adapter stays registered.
        """
        restored, mismatched = [], []
        for row in self.store.load() if self.store is not None else []:
            try:
                if self._restore(row).warnings:
                    mismatched.append(row.adapter_id)
            except Exception as err:  # noqa: BLE001 - one broken adapter must not stop the others
                log.error("adapter %r (%s at %s) could not be restored: %s", row.adapter_id, row.ref, row.sha, err)
                self.metrics.restored(False)
                with self._lock:
                    self._unrestored[row.adapter_id] = UnrestoredAdapter(row, f"{type(err).__name__}: {err}")
                continue
            self.metrics.restored(True)
            restored.append(row)
        if mismatched:  # one line, not one per adapter (each record keeps its warning: /v1/adapters lists it)
            log.warning(
                "%d restored adapters were trained on another base model, e.g. %r: %s",
                len(mismatched),
                mismatched[0],
                self.get(mismatched[0]).warnings[0],
            )
        if self.disk is not None:
            self.disk.enforce()  # also applies a bound lowered since the last run
        return restored

    def unrestored(self) -> list[UnrestoredAdapter]:
        """Durable registrations that could not be restored, sorted by id (unregister or register them again)."""
        with self._lock:
            return sorted(self._unrestored.values(), key=lambda u: u.registration.adapter_id)

    def get(self, adapter_id: str) -> AdapterRecord:
        with self._lock:
            record = self._records.get(adapter_id)
        if record is None:
            raise AdapterNotFoundError(adapter_id, "not registered")
        return record

    def list(self) -> list[AdapterRecord]:
        """Every registered adapter, sorted by id."""
        with self._lock:
            return sorted(self._records.values(), key=lambda r: r.adapter_id)

    def __contains__(self, adapter_id: object) -> bool:
        with self._lock:
            return adapter_id in self._records

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def prepared(self, adapter_id: str) -> PreparedAdapter:
        """The adapter's prepared weights: from the host tier, else prepared again from its local files (fetched
        again, pinned to the registered sha, only if they have left the disk; a bounded disk tier short of room
        waits up to the hub timeout for it)."""
        return self._prepared(self.get(adapter_id), self.config.hub.timeout_s)

    def _prepared(self, record: AdapterRecord, disk_wait_s: float) -> PreparedAdapter:
        adapter_id = record.adapter_id

        def load() -> PreparedAdapter:
            with self._disk_files.on_disk(record.ref.repo_id):
                files = self._disk_files.files(record, disk_wait_s)
                prepared = self._prepare(adapter_id, files, record.modules, record.variant)[0]
            self._disk_files.used(record, files.downloaded_bytes > 0)
            if not prepared.complete:
                raise UnsupportedAdapterError(
                    adapter_id, "DoRA's scale and trainable tokens' rows need the base model's weights, and none are "
                    "attached (an Engine attaches its model's: AdapterManager.attach_base_weights)"
                )  # fmt: skip
            return prepared

        return self.host.get_or_load((adapter_id, record.digest), load)

    def peek(self, adapter_id: str) -> PreparedAdapter | None:
        """The adapter's prepared weights if the host tier holds them now, else None: never a download or a
        preparation (what an engine step may wait for)."""
        record = self.get(adapter_id)
        return self.host.get((adapter_id, record.digest))

    def is_prepared(self, adapter_id: str) -> bool:
        """Whether the host tier holds the adapter's prepared weights now (no hit or miss counted)."""
        with self._lock:
            record = self._records.get(adapter_id)
        return record is not None and (adapter_id, record.digest) in self.host

    def generation(self, adapter_id: str) -> int | None:
        """The adapter's current registration (`AdapterRecord.generation`), None when it is not registered: what
        a failure recorded against it (a prefetch's) belongs to."""
        with self._lock:
            record = self._records.get(adapter_id)
        return record.generation if record is not None else None

    def stage(self, adapter_id: str, keep: Iterable[str] = (), ceiling: int | None = None, wait: bool = True) -> bool:
        """A prefetch's hub -> disk -> host: room in the host tier first (evicting no adapter in `keep` and, with
        `ceiling`, none estimated more popular than it), then a download only if the files left the disk (its bytes
        reserved in a bounded disk tier first; `wait`: for room there, else none), then the preparation. True when
        the adapter is prepared (now or already); False when there was no room, having downloaded and prepared
        nothing. A failed download or preparation raises, as in `prepared`."""
        record = self.get(adapter_id)
        key = (adapter_id, record.digest)
        if key in self.host:
            return True
        with self._lock:
            kept = {(a, self._records[a].digest) for a in keep if a in self._records}
        if not self.host.reserve(key, record.nbytes, kept, ceiling):
            return key in self.host  # prepared meanwhile by someone else, else no room
        try:
            self._prepared(record, self.config.hub.timeout_s if wait else 0.0)
        except DiskTierFullError:
            return False
        finally:
            self.host.unreserve(key)
        return True

    def _restore(self, row: Registration) -> AdapterRecord:
        if row.is_local:
            ref = AdapterRef(None, None, Path(row.ref))
        else:
            ref = AdapterRef.parse(row.ref + (f"@{row.revision}" if row.revision else ""))
        check_adapter_id(row.adapter_id)
        with self._id_lock(row.adapter_id), self._disk_files.on_disk(ref.repo_id):
            # A stand-in record at the recorded sha and content: `DiskFiles.files` finds (or fetches) exactly that
            # revision, and refuses a local directory whose content changed since (a row written before digests
            # were recorded takes the directory as it is).
            files = AdapterFiles(Path(), Path(), row.sha, 0, row.digest or "")
            stand_in = AdapterRecord(row.adapter_id, ref, files, {}, 0, None, row.registered_at)
            found = self._disk_files.on_hand(stand_in)
            if found is None and row.config is not None and row.digest and row.disk_bytes is not None:
                # a hub revision the disk bound evicted: its stored config stands for the files, which the first
                # preparation fetches again (as after an eviction while running), its weights checked there
                config, warnings, modules = read_config(row.adapter_id, row.config, self.spec, self.config, True)
                disk_bytes = row.disk_bytes
            else:
                files = found or self._disk_files.files(stand_in)  # a row from before configs were stored: fetched
                config, warnings, modules = read_config(row.adapter_id, files, self.spec, self.config, True)
                check_weights(row.adapter_id, files.weights_path, modules, self.spec, config.variant)
                disk_bytes = files.nbytes()
            nbytes = self._nbytes(modules, config.variant)
            base = config.base_model_name_or_path
            record = AdapterRecord(
                row.adapter_id,
                ref,
                files,
                modules,
                nbytes,
                base,
                row.registered_at,
                warnings,
                disk_bytes,
                next(self._generations),
                config.variant,
            )
            self._publish(row.adapter_id, record)
        # the disk bound is enforced once all are restored
        self._disk_files.used(record, files.downloaded_bytes > 0, enforce=False)
        return record

    def _persist(self, record: AdapterRecord, keep_pin: bool = True) -> None:
        """Commit the registration to the durable store (before it is published or answered)."""
        if self.store is None:
            return
        ref = record.ref
        source = ref.repo_id if ref.repo_id is not None else str(ref.path)
        config = record.files.config_path.read_text(encoding="utf-8")  # validated: the restore needs no files
        row = Registration(
            record.adapter_id,
            source,
            ref.revision,
            record.sha,
            False,
            record.registered_at,
            record.digest,
            config,
            record.disk_bytes,
        )
        self.store.put(row, keep_pin)

    @contextmanager
    def _id_lock(self, adapter_id: str) -> Iterator[None]:
        with self._lock:
            lock = self._id_locks.setdefault(adapter_id, threading.Lock())
        with lock:
            yield

    def _publish(self, adapter_id: str, record: AdapterRecord | None) -> AdapterRecord | None:
        """Make `record` the adapter's (None: forget it); returns the one it replaced. Its hub revision is counted
        needed before it is published, the old one's no more after."""
        self._needed.count(record, 1, self.disk)
        with self._lock:
            old = self._records.pop(adapter_id, None)
            if record is not None:
                self._records[adapter_id] = record
            self._unrestored.pop(adapter_id, None)
        self._needed.count(old, -1, self.disk)
        return old

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    def _load(self, adapter_id: str, ref: AdapterRef, files: AdapterFiles):
        start = time.perf_counter()
        config, warnings, modules = read_config(adapter_id, files, self.spec, self.config)
        prepared, _ = self._prepare(adapter_id, files, modules, config.variant, start)
        base = config.base_model_name_or_path
        record = AdapterRecord(
            adapter_id, ref, files, modules, self._nbytes(modules, config.variant), base, time.time(), warnings,
            files.nbytes(), 0, config.variant,
        )  # fmt: skip
        return record, prepared, time.perf_counter() - start

    def _nbytes(self, modules, variant: Variant) -> int:
        """Bytes of the adapter's prepared block (its highest rank's rows) and vector row, if its variant has one."""
        vector = 0 if variant.vector is None else self.layout.vector_width * self.config.dtype.itemsize
        return max(m.rank for m in modules.values()) * self.layout.row_bytes(self.config.dtype) + vector

    def _prepare(self, adapter_id: str, files: AdapterFiles, modules, variant: Variant, start: float | None = None):
        start = time.perf_counter() if start is None else start
        prepared = prepare_adapter(
            adapter_id,
            files.sha,
            files.weights_path,
            modules,
            self.spec,
            self.config.dtype,
            self.config.pin_memory,
            self.layout,
            files.digest,
            variant,
            self.base_weight,
        )
        if self._resolver.digest(files.config_path, files.weights_path) != files.digest:
            raise AdapterConflictError(adapter_id, f"its files in {files.weights_path.parent} changed while being read")
        seconds = time.perf_counter() - start
        self.metrics.record(Move.DISK_TO_HOST, adapter_id, seconds, prepared.nbytes)
        return prepared, seconds
