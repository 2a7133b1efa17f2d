"""The generation engine: continuous batching over one model and one AdapterManager.

Each step: plan (adapter-aware scheduler) -> pin the step's adapters (``manager.acquire``) -> order the step's
sequences by slot, so every LoRA layer sees one contiguous run of tokens per adapter -> one forward over prefill
chunks and decode tokens together -> sample -> release the pins -> hand the waiting queue to the prefetcher.
A request whose adapter cannot be loaded fails alone; everyone else goes on.

A step never waits for a move another request needs. With prefetching on, `submit` hands the queue to the
prefetcher at once (hub -> disk -> host on its workers), a waiting request is admitted only once its adapter is
ready (`AdapterManager.is_ready`: resident, or prepared on the host), and the step's `acquire` may copy a newly
admitted adapter from the host but never download or prepare one (``prepared_only``; one the host evicted meanwhile
puts its requests back to wait). A step with nothing ready to run waits for the prefetcher instead of spinning.

How a step reaches the device is its step runner's business (:mod:`.step_runner`, chosen once from the backend): on a
traced (XLA) device static shapes, buckets and padding, and ``warm_up`` compiling each graph once, after which steps,
echoes, slot swaps and changing adapter mixes compile nothing; on cuda the CUDA graphs of decode steps. The engine
schedules and hands it a batch.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

import torch

from adapter_manager import (
    PROJECTIONS,
    AdapterManager,
    AdapterNotFoundError,
    ModuleKey,
    SlotLease,
    SlotsExhaustedError,
)
from adapter_manager.kernels import platform_for, select_backend

from ..model.llama import Llama
from .config import EngineConfig, StepStats
from .kv_blocks import BlockPool
from .kv_space import KVSpace, block_bytes
from .kv_stats import KVMetrics, kv_metrics
from .request import Request, RequestHandle, checked_prompt
from .sampling import SamplingParams, sample_step
from .scheduler import ScheduledChunk, StepPlan, plan_step
from .step_batch import place_chunks
from .step_lease import acquire_step, hold_contents
from .step_loop import StepLoop
from .step_runner import make_runner
from .step_sampling import plan_sampling, record_sampling

log = logging.getLogger(__name__)


class Engine:
    """Continuous batching with adapter-aware scheduling. `submit` is thread-safe; `step` runs one step in the
    calling thread; `start` runs steps in a background thread until `stop`."""

    def __init__(self, model: Llama, manager: AdapterManager, config: EngineConfig | None = None) -> None:
        if not model.plan.reads(manager.tensor_parallel):  # one plan: the model's linears read the pool's split
            raise ValueError(
                f"the model is sharded as {model.tensor_parallel}, the adapter pool as {manager.tensor_parallel}: give "
                "both the same tensor_parallel_size and fully_sharded_loras"
            )
        self.model = model
        self.manager = manager
        self.config = config or EngineConfig()
        eos = self.config.eos_ids if self.config.eos_ids is not None else model.config.eos_token_ids
        self.eos_ids: frozenset[int] = frozenset(eos)  # end every request not submitted with ignore_eos
        model.set_deterministic(self.config.deterministic)
        backend = select_backend(model.device, self.config.kernels, self.config.deterministic)
        max_batch = self.config.max_batch
        block_size = self.config.kv_block_size
        per_block = block_bytes(model.config, model.dtype, block_size)
        num_blocks = self.config.kv_blocks(per_block, platform_for(model.device).free_bytes())
        model.setup_caches(max_batch, self.config.max_seq_len, num_blocks, block_size)
        pool = BlockPool(num_blocks, caching=self.config.prefix_caching)
        self._kv = KVSpace(pool, block_size, max_batch, self._digest_of)
        self._kv_bytes = num_blocks * per_block
        model.attach_lora(manager.stacks)
        manager.attach_base_weights(model.base_weight)
        self._runner = make_runner(model, backend, manager, self.config)
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # in admission order: the newest is preempted first
        self._ids = itertools.count()
        self._step = 0
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._loop = StepLoop(self.step, self._work, lambda: bool(self._waiting or self._running))
        self._finished_in_step = 0
        manager.on_prefetched(self._adapter_moved)
        manager.on_retired(self._adapter_retired)

    def submit(
        self, prompt: Sequence[int], adapter_id: str | None = None, params: SamplingParams | None = None
    ) -> RequestHandle:
        """Queue a request. Raises `AdapterNotFoundError` for an unregistered adapter and ValueError for a prompt
        that cannot fit; the request's own later failure is reported through its handle."""
        params = params or SamplingParams()
        prompt = checked_prompt(prompt, params, self.model.config.vocab_size, self.config.max_seq_len)
        if adapter_id is not None:
            self.manager.record(adapter_id)
        self.manager.note_request(adapter_id)
        generator = None
        if params.temperature > 0:
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
            generator = torch.Generator().manual_seed(seed)
        with self._work:
            stops = frozenset(params.stop_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
            request = Request(next(self._ids), prompt, adapter_id, params, self._step, generator, stops)
            self._waiting.append(request)
            self._work.notify()
        self._prefetch()  # its adapter starts up the tiers now, not when a step first schedules it
        return RequestHandle(request)

    @property
    def decode_mode(self) -> str:
        """How decode steps run: ``"cuda_graphs"`` (replayed) or ``"eager"``."""
        return self._runner.decode_mode

    @property
    def token_buckets(self) -> tuple[int, ...]:
        """The token buckets steps are padded to; empty on eager devices (no padding)."""
        return self._runner.token_buckets

    def warm_up(self) -> int:
        """Compile the step graph of every (token bucket, active-adapter bucket, logits rows) once; returns the
        graphs run (0 on eager devices).

        The logits rows are ``max_batch``, and one per token for a step that scores prompt tokens (echo,
        ``prompt_logprobs``). Each warm-up step is padding only and traces the exact graph a real step of its shape
        traces (see `warm_up_batches`): the graph never depends on which slots or ranks. The pool compiles its load
        graphs when made; afterwards steps, echoes, swaps, ranks and adapter mixes compile nothing. With vector rows
        on XLA it also reads one layer's weights to the host: the transfer a DoRA adapter's preparation makes
        compiles once per weight shape, here rather than at the first DoRA adapter.
        """
        tables = self._kv.tables([], self.config.max_batch + 1, self._table_width)
        if self.manager.lora_vectors and platform_for(self.model.device).static_shapes:
            with self.manager.device_lock:
                for proj in PROJECTIONS:
                    self.model.base_weight(ModuleKey(0, proj))
        return self._runner.warm_up(tables)

    @property
    def has_work(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._running)

    def step(self) -> StepStats:
        """Run one scheduling + forward step (no-op when idle). With requests waiting but none of them ready to run,
        it waits (up to `_IDLE_WAIT_S`) for the prefetcher to make one ready: nothing else is running to stall."""
        self._finished_in_step = 0
        self._drop_cancelled()
        self._fail_prefetch_errors()
        plan, pinned = self._plan()
        deadline = time.monotonic() + _IDLE_WAIT_S
        while not (plan.chunks or plan.unplaceable) and self._waiting_for_adapters():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._loop.stopping:
                break
            with self._work:
                self._work.wait(min(remaining, _IDLE_POLL_S))
            self._prefetch()  # a job that found no room tries again
            self._drop_cancelled()
            self._fail_prefetch_errors()
            plan, pinned = self._plan()
        with self._lock:
            if plan.admitted or plan.unplaceable:  # one pass over the queue, not one list scan per request
                taken = {id(r) for r in (*plan.admitted, *plan.unplaceable)}
                self._waiting = deque(r for r in self._waiting if id(r) not in taken)
            for request in plan.preempted:
                self._preempt(request)
            for request in plan.admitted:
                self._kv.admit(request)
                self._running.append(request)
            plan = dataclasses.replace(plan, chunks=place_chunks(plan.chunks, self._kv, self._preempt))
            self._step += 1
        unpinned = self.manager.num_units - sum(pinned.values())
        for request in plan.unplaceable:  # operator pins leave no room for its adapter: waiting cannot help
            needed = self._units_of(request.adapter_id)
            error = SlotsExhaustedError((request.adapter_id,), needed, unpinned, 0, self.manager.num_units)
            self._finish(request, "error", error)
        chunks = list(plan.chunks)
        running = {r.adapter_id for r in self._running if r not in plan.admitted}
        fail = lambda request, err: self._finish(request, "error", err)
        lease = acquire_step(self.manager, chunks, plan.admitted, running, self._requeue, fail)
        hold_contents(chunks, lease, self._restart, fail)
        try:
            if chunks:
                self._forward(chunks, lease)
        finally:
            try:
                self._prefetch()  # while the step's adapters are pinned: running ones are warm before evictable
            finally:
                self.manager.release(lease)
        adapters = len({c.request.adapter_id for c in chunks} - {None})
        return StepStats(sum(c.count for c in chunks), len(chunks), adapters, self._finished_in_step)

    def _plan(self) -> tuple[StepPlan, dict[str, int]]:
        """The scheduler's plan for the next step (not yet applied) and the operator pins it counted; marks the
        waiting requests whose adapter it found ready (their adapter wait ends here)."""
        now = time.perf_counter()

        def is_ready(adapter_id: str) -> bool:
            ready = self.manager.is_ready(adapter_id)
            if ready:
                newly_ready.append(adapter_id)
            return ready

        newly_ready: list[str] = []
        with self._lock:
            pinned = {s.adapter_id: s.units for s in self.manager.slot_states() if s.manual}
            plan = plan_step(
                self.config.scheduler,
                self._step,
                self._running,
                list(self._waiting),
                self._kv,
                self.manager.num_units,
                self._units_of,
                pinned,
                is_ready,
            )
            ready = set(newly_ready)
            running = {r.adapter_id for r in self._running}
            for request in self._waiting:
                if request.adapter_ready_at is None and request.adapter_id is not None:
                    if request.adapter_id in ready or request.adapter_id in running:
                        request.adapter_ready_at = now
                        self.manager.note_adapter_wait(now - request.submitted_at)
        return plan, pinned

    def _waiting_for_adapters(self) -> bool:
        """Whether requests wait while nothing runs (each for an adapter that is not ready, or for room)."""
        with self._lock:
            return bool(self._waiting) and not self._running and self.manager.prefetching

    def _adapter_moved(self, adapter_id: str) -> None:
        """A prefetch job ended (prefetcher thread): a step waiting for an adapter looks again."""
        with self._work:
            self._work.notify_all()

    def _fail_prefetch_errors(self) -> None:
        """Fail the waiting requests whose adapter's prefetch failed (the next request for it retries)."""
        errors = self.manager.take_prefetch_errors()
        if not errors:
            return
        with self._lock:
            failed = [r for r in self._waiting if r.adapter_id in errors]
            if failed:
                dropped = {id(r) for r in failed}
                self._waiting = deque(r for r in self._waiting if id(r) not in dropped)
        for request in failed:
            self._finish(request, "error", errors[request.adapter_id])

    def run_until_idle(self, max_steps: int | None = None) -> int:
        """Step until no request is waiting or running; returns the steps taken."""
        steps = 0
        while self.has_work and (max_steps is None or steps < max_steps):
            self.step()
            steps += 1
        return steps

    def start(self) -> None:
        """Run steps in a daemon thread whenever there is work."""
        self._loop.start()

    def close(self) -> None:
        """Done with the manager: stop the loop and stop listening to its prefetcher (which would otherwise keep
        calling, and keep alive, an engine nobody uses). The manager stays open for its owner to close."""
        self.stop()
        self.manager.off_prefetched(self._adapter_moved)
        self.manager.off_retired(self._adapter_retired)

    def stop(self) -> None:
        self._loop.stop()

    def _units_of(self, adapter_id: str) -> int:
        try:
            return self.manager.units_of(adapter_id)
        except AdapterNotFoundError:
            return 1  # unregistered since submit: its acquire fails the request alone

    def _forward(self, chunks: list[ScheduledChunk], lease: SlotLease) -> None:
        chunks.sort(key=lambda c: lease.slots.get(c.request.adapter_id, -1))  # one token run per slot
        # a traced step's host -> device transfers must not interleave with a slot load in a prefetch thread
        with self._runner.device_lock:
            with self._lock:
                tables = self._kv.tables([c.request for c in chunks], *self._runner.table_shape(self._table_width))
            batch, device, pad_logits = self._runner.batch(chunks, lease.slots, tables)
            batch, sampling, draws = plan_sampling(chunks, batch, self.model.config.vocab_size, device, pad_logits)
            logits = self._runner.run(batch, lease.slot_rows, lease.slot_vectors)  # [N, vocab]: `sampling`'s rows
        finished = record_sampling(chunks, draws, sample_step(logits, sampling))
        with self._lock:
            for chunk in chunks:  # the blocks this step filled join the prefix cache
                self._kv.commit(chunk.request)
        for request, reason in finished:
            self._finish(request, reason)

    @property
    def _table_width(self) -> int:
        """MB: the blocks of a sequence of max_seq_len tokens (a traced step's tables are this wide)."""
        return self._kv.blocks_for(self.config.max_seq_len)

    def _finish(self, request: Request, reason: str, error: BaseException | None = None) -> None:
        with self._lock:
            if request in self._running:
                self._running.remove(request)
                self._kv.release(request)
        request.finish(reason, error)
        self._finished_in_step += 1

    def _drop_cancelled(self) -> None:
        with self._lock:
            cancelled = [r for r in (*self._waiting, *self._running) if r.cancelled.is_set()]
            if cancelled:
                dropped = {id(r) for r in cancelled}
                self._waiting = deque(r for r in self._waiting if id(r) not in dropped)
        for request in cancelled:
            self._finish(request, "cancelled")

    def _requeue(self, request: Request) -> None:
        """A request admitted in this step goes back to the head of the queue (its adapter cannot be placed now)."""
        with self._lock:
            self._running.remove(request)
            self._kv.reset(request)
            self._waiting.appendleft(request)

    def _restart(self, request: Request) -> None:
        """A running request with no token yet goes back to waiting, to begin again on its adapter's new content."""
        with self._lock:
            request.content = None
            self._preempt(request)

    def _preempt(self, request: Request) -> None:
        """Under the lock: a running request gives its blocks back and waits again at its arrival place; it will
        recompute its prompt and the output it has (its cached blocks likely still there), losing nothing."""
        self._running.remove(request)
        self._kv.reset(request)
        self._kv.stats.preemptions += 1
        later = next((i for i, r in enumerate(self._waiting) if r.request_id > request.request_id), None)
        self._waiting.insert(len(self._waiting) if later is None else later, request)

    def _digest_of(self, adapter_id: str) -> str:
        try:
            return self.manager.record(adapter_id).digest
        except AdapterNotFoundError:
            return "unregistered"  # its acquire fails the request alone; nothing of it is cached under a live name

    def _adapter_retired(self, adapter_id: str) -> None:
        """The manager forgot an adapter's content (unregistered, or refreshed to new bytes): its cached prefix
        blocks go, and no request reads them again (a request begun on the old content: `hold_contents`)."""
        with self._lock:
            self._kv.drop(adapter_id)

    def kv_metrics(self) -> KVMetrics:
        """The KV blocks and the prefix cache now: blocks used / free / cached, hit rates, preemptions."""
        with self._lock:
            return kv_metrics(self._kv, self._kv_bytes, len(self._running), len(self._waiting))

    def _prefetch(self) -> None:
        # Running requests' adapters go first: needed sooner than any waiting one's, so never a prefetch victim.
        # Called with an empty queue too: the prefetcher also keeps the most popular adapters warm.
        # With no seat or no free KV block (saturated) a waiting adapter goes no further than the host tier: copied
        # into a slot ahead of its turn it would only make its request warm and reorder the queue (bench_many at 1.5x
        # load: TTFT p50 ~2.2 s against ~0.7 s, 92.7 % of all-resident throughput against 95.8 % without prefetch).
        with self._lock:
            queued = [r.adapter_id for r in self._running] + [r.adapter_id for r in self._waiting]
            room = self._kv.seats > 0 and self._kv.free > self._kv.reserve
        if queued:
            self.manager.prefetch(queued, to_slot=room)


_IDLE_WAIT_S = 1.0  # longest a step with nothing ready waits for the prefetcher before it returns empty
_IDLE_POLL_S = 0.05  # and how often it looks again without being woken (a job that found no room retries)
