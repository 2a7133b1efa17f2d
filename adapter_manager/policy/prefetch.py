"""The prefetcher: moves the adapters an engine's waiting queue will need up the tiers before they are scheduled.

Every move is budgeted: a job first reserves room in the tier it moves into and only then does the work, so a job
that finds no room costs nothing. hub -> disk -> host (the registry's `stage`): room in the host tier that evicts no
adapter queued ahead of this one (the disk tier's bytes, too, are reserved before a download), then the download if
the files left the disk, then the preparation; host -> slot only into a free slot or in place of an LRU victim that
nothing queued ahead of the adapter needs and no queued request needs resident (warm work stays warm), so it never
evicts something needed sooner than what it brings in.

Work is bounded (`depth` adapters not yet in a slot per call, `workers` threads), a newer queue cancels the jobs of
adapters it no longer holds, and a failure is recorded against its adapter's registration (the `generation` it had when
the job started) until the engine fails its waiting requests with it (or the manager raises it at `acquire`); one whose
adapter was unregistered or registered again since is dropped, never raised for the new registration. Each job's outcome
is counted in the metrics (``prefetch``: ``host_to_slot`` slot loads, ``skipped_no_room`` when no free or evictable
range could take the adapter, ``host_no_room`` when the host tier had no room for it: nothing downloaded or prepared,
``to_host`` when the caller asked for no slot copy). Listeners (`on_done`) hear of every job that ended, so an engine
waiting for an adapter wakes as soon as it is prepared.

Popularity: beside the queue, each call also brings up the `popular` most requested adapters (the manager's TinyLFU
sketch) that are not resident, so a hot adapter evicted by a burst is back before its next request. Such a job evicts
nothing any queued or running request needs (the whole head of the queue is protected) and, in both tiers, only
adapters strictly less popular than the one it brings in; it never waits for disk room. Its outcome counts as
``popular_to_slot`` / ``popular_no_room`` (no slot room: it may still have been prepared on the host) /
``popular_no_host_room`` (nothing downloaded or prepared), and its failure is only logged (no request waits for it).
Workers run torch ops on one intra-op thread (`workers.background_executor`), so a prefetch never slows the engine's
own parallel ops.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from ..tiers.allocator import SlotAllocator
from .workers import PREFETCH_NICE, background_executor

log = logging.getLogger(__name__)


@dataclass
class PrefetchConfig:
    """How much the prefetcher does at once."""

    workers: int = 2  # threads moving adapters up the tiers; 0 turns prefetching off
    depth: int = 16  # the most queued adapters not in a slot one `prefetch` call moves (the head of the queue)
    popular: int = 4  # the most popular adapters (by the popularity source) kept warm beside the queue; 0: none

    def __post_init__(self) -> None:
        if not isinstance(self.popular, int) or self.popular < 0:
            raise ValueError(f"prefetch popular must be an int >= 0, got {self.popular!r}")
        if not isinstance(self.workers, int) or self.workers < 0:
            raise ValueError(f"prefetch workers must be an int >= 0, got {self.workers!r}")
        if not isinstance(self.depth, int) or self.depth <= 0:
            raise ValueError(f"prefetch depth must be a positive int, got {self.depth!r}")


class Prefetcher:
    """A small worker pool fed with the engine's waiting queue, in order."""

    def __init__(
        self,
        stage: Callable[[str, frozenset[str], int | None, bool], bool],
        allocator: SlotAllocator,
        config: PrefetchConfig | None = None,
        popular: Callable[[int], Sequence[str]] | None = None,
        frequency: Callable[[str], int] | None = None,
        generation: Callable[[str], object] | None = None,
    ) -> None:
        self.config = config or PrefetchConfig()
        self._popular = popular  # n -> up to n adapter ids, most popular first (None: queue only)
        self._frequency = frequency  # adapter id -> estimated recent requests: a popular job's eviction ceiling
        self._stage = stage  # (adapter, keep, ceiling, wait) -> prepared? (the registry's `stage`)
        # adapter id -> its registration now (None: not registered); a recorded error belongs to one registration
        self._generation = generation or (lambda adapter_id: None)
        self._allocator = allocator
        self._listeners: list[Callable[[str], None]] = []
        self._warm: frozenset[str] = frozenset()  # resident adapters queued (or running) requests need, as of now
        self._lock = threading.RLock()  # re-entrant: Future.cancel() runs the done callback, which takes it, at once
        self._jobs: dict[str, Future] = {}
        self._errors: dict[str, tuple[object, BaseException]] = {}  # adapter id -> (its registration, error)
        self._queue: tuple[str, ...] = ()
        workers = self.config.workers
        self._executor = background_executor(workers, "adapter-prefetch", PREFETCH_NICE) if workers else None
        # host -> slot copies at the engine's own priority: a reserved range is held (and a step may wait for it)
        # until its copy is done, so a copy must not wait for idle CPU the way a preparation may
        self._copier = background_executor(1, "adapter-copy") if workers else None

    def prefetch(self, adapter_ids: Sequence[str | None], to_slot: bool = True) -> int:
        """Start moving the head of a waiting queue (one entry per waiting request, None = no adapter) up the
        tiers. Jobs for adapters no longer in the head are cancelled if not started. Returns the jobs started.
        `to_slot` False: the queue's adapters go up to the host tier only (an engine with no room to admit them:
        copying one into a slot now would only reorder its queue, measured in scripts/bench_many.py at 1.5x load);
        popular ones may still take a slot."""
        if self._executor is None:
            return 0
        head: dict[str, None] = {}
        to_move = 0
        for adapter_id in adapter_ids:  # stops at `depth` distinct adapters not in a slot: linear in what it reads
            if adapter_id is not None and adapter_id not in head:
                head[adapter_id] = None  # a resident one stays in the head: what it protects from eviction
                if self._allocator.slot_of(adapter_id) is None:
                    to_move += 1
                    if to_move == self.config.depth:
                        break
        queue = tuple(head)
        popular: tuple[str, ...] = ()
        if self._popular is not None and self.config.popular:
            popular = tuple(a for a in self._popular(self.config.popular) if a not in head)
        # A resident adapter any queued request needs (warm work: the scheduler runs it without a swap) is never a
        # victim, wherever that request waits: evicting it would turn warm work cold.
        wanted = {a for a in adapter_ids if a is not None}
        warm = frozenset(s.adapter_id for s in self._allocator.states() if s.adapter_id in wanted)
        started = 0
        with self._lock:
            self._warm = warm  # read again by jobs already under way: they protect what is warm now, too
            self._queue = queue + popular
            for adapter_id, job in list(self._jobs.items()):
                if adapter_id not in self._queue and job.cancel():
                    self._jobs.pop(adapter_id, None)
            everything = frozenset(queue) | warm
            for position, adapter_id in enumerate(self._queue):
                if adapter_id in self._jobs or self._allocator.slot_of(adapter_id) is not None:
                    continue
                is_popular = position >= len(queue)
                ahead = everything if is_popular else frozenset(queue[:position]) | warm
                job = self._executor.submit(self._run, adapter_id, ahead, is_popular, to_slot or is_popular)
                self._jobs[adapter_id] = job
                job.add_done_callback(lambda _, adapter_id=adapter_id, job=job: self._done(adapter_id, job))
                started += 1
        return started

    @property
    def enabled(self) -> bool:
        """Whether jobs run at all (``workers`` > 0)."""
        return self._executor is not None

    def on_done(self, listener: Callable[[str], None]) -> None:
        """Call `listener(adapter_id)` (on a worker thread) whenever a job ends: prepared, no room, or failed."""
        with self._lock:
            self._listeners.append(listener)

    def off_done(self, listener: Callable[[str], None]) -> None:
        """Stop calling a listener given to :meth:`on_done` (a no-op for one not listening)."""
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def take_errors(self) -> dict[str, BaseException]:
        """Every pending prefetch error of an adapter's current registration, once (the next request for each
        retries)."""
        with self._lock:
            errors, self._errors = self._errors, {}
        return {a: error for a, (generation, error) in errors.items() if generation == self._generation(a)}

    def take_error(self, adapter_id: str) -> BaseException | None:
        """The error of the adapter's last failed prefetch, once (the next request retries); None also when it
        failed for an earlier registration of the id."""
        with self._lock:
            generation, error = self._errors.pop(adapter_id, (None, None))
        return error if error is not None and generation == self._generation(adapter_id) else None

    def errors(self) -> dict[str, str]:
        """Pending prefetch errors by adapter, as messages."""
        with self._lock:
            return {adapter_id: str(error) for adapter_id, (_, error) in self._errors.items()}

    def forget(self, adapter_id: str) -> None:
        """The adapter was unregistered: cancel its job, or wait for a running one (so it cannot load the adapter
        into a slot after the allocator has forgotten it), and drop its recorded error."""
        with self._lock:
            job = self._jobs.get(adapter_id)
            if job is not None and job.cancel():
                self._jobs.pop(adapter_id, None)
                job = None
        if job is not None:
            try:
                job.result()
            except BaseException:  # noqa: BLE001 - the job records its own errors
                pass
        with self._lock:
            self._errors.pop(adapter_id, None)

    def cancel(self) -> None:
        """Cancel every job not yet started."""
        with self._lock:
            self._queue = ()
            for adapter_id, job in list(self._jobs.items()):
                if job.cancel():
                    self._jobs.pop(adapter_id, None)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the jobs started so far have finished (for tests and benchmarks)."""
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            try:
                job.result(timeout)
            except BaseException:  # noqa: BLE001 - recorded by _run, surfaced through take_error
                pass

    def close(self) -> None:
        if self._executor is not None:
            self.cancel()
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._copier.shutdown(wait=True)

    def _run(self, adapter_id: str, ahead: frozenset[str], popular: bool = False, to_slot: bool = True) -> None:
        with self._lock:
            if adapter_id not in self._queue:
                return
        generation = self._generation(adapter_id)  # read before the job reads the adapter's record
        try:
            # hub -> disk -> host, room first; a popular job evicts only strictly less popular adapters
            ceiling = self._frequency(adapter_id) - 1 if popular and self._frequency is not None else None
            if not self._stage(adapter_id, ahead | self._warm, ceiling, not popular):
                self._allocator.metrics.prefetched("popular_no_host_room" if popular else "host_no_room")
                return
            if not to_slot:
                self._allocator.metrics.prefetched("to_host")
                return
            # host -> slot, evicting nothing needed sooner (and for a popular one, nothing as popular as it); what
            # is warm is read when the slot is planned, so an adapter that became a running request's since this
            # job was queued is not a victim either
            protect = _Protected(ahead, self)
            copy = self._copier.submit(self._allocator.preload, adapter_id, protect=protect, strict=popular)
            loaded = copy.result()
            if self._allocator.slot_of(adapter_id) is None:
                self._allocator.metrics.prefetched("popular_no_room" if popular else "skipped_no_room")
            elif loaded:
                self._allocator.metrics.prefetched("popular_to_slot" if popular else "host_to_slot")
        except Exception as error:
            log.warning("prefetch of adapter %r failed: %s", adapter_id, error)
            if not popular:
                with self._lock:
                    self._errors[adapter_id] = (generation, error)

    def _done(self, adapter_id: str, job: Future) -> None:
        with self._lock:
            if self._jobs.get(adapter_id) is job:
                self._jobs.pop(adapter_id, None)
            listeners = list(self._listeners)
        for listener in listeners:
            listener(adapter_id)


class _Protected:
    """What a job may not evict: the adapters queued ahead of it when it was started, and the warm set as the latest
    `prefetch` call saw it (read at each lookup, under the allocator's lock while it plans)."""

    def __init__(self, ahead: frozenset[str], prefetcher: Prefetcher) -> None:
        self._ahead = ahead
        self._prefetcher = prefetcher

    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id in self._ahead or adapter_id in self._prefetcher._warm
