"""The `AdapterManager` facade: registry, host tier, slot pool, allocator, prefetcher and metrics behind one object.

Runtime calls the facade's methods, never its components (tests/test_layout.py checks). The engine uses it per step:

    lease = manager.acquire(adapter_id_per_request)     # pins the batch's slots, loading missing adapters
    indices = lease.slot_indices(adapter_id_per_token)  # [T] int32, -1 = no adapter
    ... forward with manager.stacks ...
    manager.release(lease)
    manager.prefetch(adapter_id_per_waiting_request)

and `manager.note_request(adapter_id)` once per submitted request: the popularity (TinyLFU sketch) the host and slot
tiers and the prefetcher act on, and the per-adapter request counts of the metrics.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Container, Iterable, Mapping, Sequence

import torch

from .base_model import BaseModelSpec, ModuleKey
from .manager_config import AdapterManagerConfig
from .metrics import AdapterMove, AdapterResidency, MetricsSnapshot, SwapMetrics
from .policy.admission import FrequencySketch
from .policy.prefetch import Prefetcher
from .registry import AdapterRecord, AdapterRegistry, RegisterResult, UnrestoredAdapter
from .sharding import TensorParallel
from .tiers.allocator import SlotAllocator, SlotLease
from .tiers.lease import SlotState
from .tiers.slot_pool import SlotPool, SlotStacks
from .tiers.vectors import BaseWeight

log = logging.getLogger(__name__)


class AdapterManager:
    """Serves many adapters through a rank-packed device row pool; thread-safe. Close it (or use `with`) when done."""

    def __init__(self, spec: BaseModelSpec, config: AdapterManagerConfig | None = None) -> None:
        self.spec = spec
        self.config = config or AdapterManagerConfig()
        self.swap_metrics = SwapMetrics()
        layout = self.config.rows.layout(spec)  # derived once: the registry prepares blocks in it, the pool holds it
        self.registry = AdapterRegistry(spec, self.config.registry_config(), self.swap_metrics, layout)
        self.pool = SlotPool(spec, self.config.pool_config(), layout)
        self.popularity = FrequencySketch(self.config.sketch) if self.config.admission == "tinylfu" else None
        frequency = self.popularity.estimate if self.popularity is not None else None
        self.allocator = SlotAllocator(
            self.pool,
            self.registry.prepared,
            self.rank_of,
            self.swap_metrics,
            frequency=frequency,
            peek=self.registry.peek,
        )
        if frequency is not None:
            self.registry.host.frequency = lambda key: frequency(key[0])  # host keys are (adapter id, digest)
        popular = self._popular if self.popularity is not None else None
        self.prefetcher = Prefetcher(
            self.registry.stage,
            self.allocator,
            self.config.prefetch_config(),
            popular,
            frequency,
            self.registry.generation,
        )
        self._retired_listeners: list[Callable[[str], None]] = []
        self.restored = self._restore()

    @property
    def num_slots(self) -> int:
        """Slot indices (pool units): the most adapters resident at once, all at the smallest rank."""
        return self.pool.num_slots

    @property
    def num_units(self) -> int:
        """Pool units in all: what the scheduler shares out between the adapters of running requests."""
        return self.pool.num_units

    @property
    def tensor_parallel_size(self) -> int:
        """N: the pool's rows hold N sections, one per device of the model's N-way tensor parallelism."""
        return self.pool.tensor_parallel.size

    @property
    def tensor_parallel(self) -> TensorParallel:
        """The plan the pool's sections follow: N, and whether every A and Bt is split (``fully_sharded_loras``)."""
        return self.pool.tensor_parallel

    @property
    def lora_vectors(self) -> bool:
        """Whether the pool keeps a vector row per slot (DoRA, lora_bias adapters are served)."""
        return self.pool.vectors is not None

    @property
    def lora_vocab(self) -> bool:
        """Whether the pool's rows have the vocabulary columns (embedding / lm_head LoRA, trainable tokens served)."""
        return self.pool.layout.vocab

    @property
    def pool_nbytes(self) -> int:
        """Device bytes of the row pool, every device's together."""
        return self.pool.nbytes

    @property
    def pool_device_nbytes(self) -> int:
        """Bytes of the row pool one device holds: its section of every row (``pool_nbytes / N`` over N shards)."""
        return self.pool.section_nbytes

    @property
    def max_rank(self) -> int:
        """R: the highest rank accepted, and the most pool rows one adapter takes."""
        return self.pool.max_rank

    @property
    def granule(self) -> int:
        """G: pool rows per unit; slot s starts at row s * G."""
        return self.pool.granule

    @property
    def stacks(self) -> Mapping[ModuleKey, SlotStacks]:
        """`A [N, in]` and `Bt [N, out]` row views of every module, for the LoRA linears."""
        return self.pool.stacks

    def attach_base_weights(self, base_weight: BaseWeight) -> None:
        """The served model's weights (``base_weight(key)``: a module's ``[out, in]`` as served), what DoRA adapters'
        scales are prepared from; an engine attaches its model's. Each call is made under the device lock (a prefetch
        thread's transfer off an XLA device stays out of a traced step). Prepared blocks already on the host are
        kept."""
        lock = self.pool.device_lock

        def locked(key: ModuleKey) -> torch.Tensor:
            with lock:
                return base_weight(key)

        self.registry.base_weight = locked

    @property
    def device_lock(self) -> threading.Lock:
        """The pool's XLA device lock: a traced step holds it while it traces and syncs, keeping slot loads out."""
        return self.pool.device_lock

    def record(self, adapter_id: str) -> AdapterRecord:
        """A registered adapter's record; `AdapterNotFoundError` if it is not registered."""
        return self.registry.get(adapter_id)

    def records(self) -> list[AdapterRecord]:
        """Every registered adapter's record, sorted by id."""
        return self.registry.list()

    def is_registered(self, adapter_id: str) -> bool:
        """Whether `adapter_id` is registered now (a registration that could not be restored is not)."""
        return adapter_id in self.registry

    def unrestored(self) -> list[UnrestoredAdapter]:
        """Durable registrations that could not be restored at start-up, sorted by id."""
        return self.registry.unrestored()

    def rank_of(self, adapter_id: str) -> int:
        """A registered adapter's rank (its highest module rank): the pool rows it takes."""
        return self.registry.get(adapter_id).rank

    def units_of(self, adapter_id: str) -> int:
        """Pool units a registered adapter takes."""
        return self.pool.units_for(self.rank_of(adapter_id))

    def register(self, ref: str, adapter_id: str | None = None, refresh: bool = False) -> RegisterResult:
        """Register a hub ref or local directory (see `AdapterRegistry.register`). An update to a new revision
        drops the old revision's slot (at once, or when the batches using it finish)."""
        result = self.registry.register(ref, adapter_id, refresh)
        if result.action == "updated":
            self.allocator.forget(result.record.adapter_id)
            self._retired(result.record.adapter_id)
        return result

    def unregister(self, adapter_id: str) -> AdapterRecord | None:
        """Forget an adapter: its durable row and host entry go at once, its slot at once if unpinned, else when
        the last in-flight batch using it releases it. None for a registration that could not be restored."""
        record = self.registry.unregister(adapter_id)
        self.prefetcher.forget(adapter_id)
        self.allocator.forget(adapter_id)
        self.swap_metrics.forget(adapter_id)
        if self.popularity is not None:
            self.popularity.discard(adapter_id)
        self._retired(adapter_id)
        return record

    def on_retired(self, listener: Callable[[str], None]) -> None:
        """Call `listener(adapter_id)` (on the caller's thread) whenever an adapter's revision stops being served:
        unregistered, or updated to a new sha. What was derived from it (an engine's cached prefix blocks) must go."""
        self._retired_listeners.append(listener)

    def off_retired(self, listener: Callable[[str], None]) -> None:
        """Stop calling a listener given to :meth:`on_retired` (a no-op for one not listening)."""
        if listener in self._retired_listeners:
            self._retired_listeners.remove(listener)

    def _retired(self, adapter_id: str) -> None:
        for listener in list(self._retired_listeners):
            listener(adapter_id)

    def _popular(self, n: int) -> list[str]:
        """Up to `n` registered adapters, most requested recently first (the sketch's tracked top)."""
        assert self.popularity is not None
        return [a for a in self.popularity.top(n + 8) if a in self.registry][:n]

    def note_request(self, adapter_id: str | None) -> None:
        """One request was submitted for `adapter_id` (None: the base model, not counted): feeds the popularity
        sketch and the per-adapter request counts."""
        if adapter_id is None:
            return
        if self.popularity is not None:
            self.popularity.record(adapter_id)
        self.swap_metrics.requested(adapter_id)

    def note_adapter_wait(self, seconds: float) -> None:
        """One request's adapter wait ended: `seconds` from its submit until its adapter was ready."""
        self.swap_metrics.adapter_waited(seconds)

    def is_ready(self, adapter_id: str) -> bool:
        """Whether a batch could place the adapter now without waiting for a move: resident in a slot, or prepared
        in the host tier (a host -> slot copy away) and not being copied into a slot by a prefetch worker (whose copy
        the batch would wait for). Always True with prefetching off, where `acquire` itself brings adapters up the
        tiers."""
        if not self.prefetcher.enabled:
            return True
        if self.allocator.slot_of(adapter_id) is not None:
            return True
        return self.registry.is_prepared(adapter_id) and not self.allocator.is_loading(adapter_id)

    def acquire(
        self, adapter_ids: Iterable[str | None], prepared_only: Container[str] = (), wait_s: float = 0.0
    ) -> SlotLease:
        """Pin the slots of one batch (one entry per request or token, None = no adapter); see
        `SlotAllocator.acquire`. A recorded prefetch failure of one of them (for its current registration) is raised
        here, once. An adapter in
        `prepared_only` is placed only from the host tier: if it is not prepared there, `AdapterNotReadyError`
        (nothing pinned) instead of a download or a preparation inside the caller's step. `wait_s`: how long a call
        that finds no room waits for some (releases, finished loads) before `SlotsExhaustedError`."""
        adapter_ids = list(adapter_ids)
        for adapter_id in dict.fromkeys(a for a in adapter_ids if a is not None):
            error = self.prefetcher.take_error(adapter_id)
            if error is not None:
                raise error
        return self.allocator.acquire(adapter_ids, prepared_only, wait_s)

    def release(self, lease: SlotLease) -> None:
        """Unpin the slots of a batch's lease (its adapters become evictable once no batch holds them)."""
        self.allocator.release(lease)

    def slot_of(self, adapter_id: str) -> int | None:
        """The adapter's slot if it is resident (its copy published), else None."""
        return self.allocator.slot_of(adapter_id)

    def slot_states(self) -> list[SlotState]:
        """Every occupied pool range now: adapter, slot, units, rank, state, in-flight pins and operator pin."""
        return self.allocator.states()

    def pin(self, adapter_id: str, wait_s: float = 0.0) -> int:
        """Operator pin: keep the adapter in its slot until `unpin`. Returns the slot. `wait_s`: how long to wait
        for room (batches finishing, unpins) before `SlotsExhaustedError`."""
        self.registry.get(adapter_id)
        slot = self.allocator.pin(adapter_id, wait_s)
        self.registry.set_pinned(adapter_id, True)
        return slot

    def unpin(self, adapter_id: str) -> None:
        """Drop an operator pin: the adapter stays in its slot until evicted."""
        self.allocator.unpin(adapter_id)
        self.registry.set_pinned(adapter_id, False)

    def prefetch(self, adapter_ids: Sequence[str | None], to_slot: bool = True) -> int:
        """Hand over the engine's waiting queue, in order; returns the prefetch jobs started. `to_slot` False: the
        queue's adapters go no further than the host tier (see `Prefetcher.prefetch`)."""
        return self.prefetcher.prefetch(adapter_ids, to_slot)

    def prepare(self, adapter_id: str) -> None:
        """Bring a registered adapter into the host tier now (downloaded and prepared as needed), placing no slot."""
        self.registry.prepared(adapter_id)

    @property
    def prefetching(self) -> bool:
        """Whether prefetch workers run (`prefetch_workers` > 0): admission is then gated on `is_ready`."""
        return self.prefetcher.enabled

    def on_prefetched(self, listener: Callable[[str], None]) -> None:
        """Call `listener(adapter_id)` (on a prefetch thread) whenever a prefetch job ends: moved, no room, failed."""
        self.prefetcher.on_done(listener)

    def off_prefetched(self, listener: Callable[[str], None]) -> None:
        """Stop calling a listener given to :meth:`on_prefetched` (a no-op for one not listening)."""
        self.prefetcher.off_done(listener)

    @property
    def shared_rows(self) -> str | None:
        """Where a tensor-parallel shard's process maps the slot pool's rows ``[N, width]`` (CPU over N > 1 shards:
        each reads its own section, and a slot load is one copy for all); None: the rows are this process's."""
        return self.pool.shared_rows

    def take_prefetch_errors(self) -> dict[str, BaseException]:
        """Every pending prefetch failure by adapter, once (the next request for each retries)."""
        return self.prefetcher.take_errors()

    def residency(self) -> dict[str, AdapterResidency]:
        """Where every registered adapter lives now (device slot, host, disk only) and when it was last used."""
        states = {s.adapter_id: s for s in self.allocator.states() if s.state == "ready"}
        last_used = self.allocator.last_used()
        host = self.registry.host.keys()
        residency = {}
        for record in self.registry.list():
            adapter_id = record.adapter_id
            state = states.get(adapter_id)
            tier = "slot" if state is not None else "host" if (adapter_id, record.digest) in host else "disk"
            pinned = state is not None and (state.pins > 0 or state.manual)
            slot = state.slot if state is not None else None
            residency[adapter_id] = AdapterResidency(adapter_id, tier, slot, pinned, last_used.get(adapter_id))
        return residency

    def metrics(self) -> MetricsSnapshot:
        """A plain snapshot: per-tier moves with latency percentiles, hits, misses, evictions, stall and
        per-adapter residency (`.to_dict()` for JSON)."""
        return self.swap_metrics.snapshot(self.residency())

    def moves(self, adapter_id: str) -> list[AdapterMove]:
        """The adapter's most recent tier moves, oldest first."""
        return self.swap_metrics.moves(adapter_id)

    def close(self) -> None:
        """Stop the prefetch workers and close the durable store."""
        self.prefetcher.close()
        self.registry.close()

    def _restore(self) -> list[str]:
        """With a state_dir: restore the durable registrations and their operator pins; the ids restored."""
        rows = self.registry.restore()
        for row in rows:
            if row.pinned:
                try:
                    self.allocator.pin(row.adapter_id)
                except Exception as err:  # noqa: BLE001 - a pin that no longer fits leaves the adapter registered
                    log.error("adapter %r restored but not pinned again: %s", row.adapter_id, err)
        return [row.adapter_id for row in rows]

    def __enter__(self) -> AdapterManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
