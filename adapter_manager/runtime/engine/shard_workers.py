"""One process per tensor-parallel shard on CPU (gloo on loopback), the engine in the first: vLLM's multiprocess
executor.

The first process (rank 0) holds the engine, the scheduler and the adapter manager, whose pool holds every shard's
section of every row; it starts the other shards (:func:`start_shard_workers`), each of which loads only its part of
every weight and maps the pool, reading only its own section. Every step, rank 0 sends each shard
the step (its batch and the step's slots' ranks), then all run the forward together: the row-parallel layers'
all-reduces and the logits' all-gather keep them in step, and rank 0 samples from the joined logits.

On CPU the pool's rows live in shared memory (the lifecycle's row writer makes them a memfd when the pool is made
over N > 1 shards): every shard's process maps the same rows and reads only its own section of each, so a slot load
is rank 0's one copy, from the loading thread, before the allocator publishes the slot: a swap never stalls a step,
and no signal follows the copy. The rows are written only while the allocator keeps the range out of every step
(unpublished, and no step's pin on it): rank 0's pins last until its step's logits all-gather has returned, by when
every shard has computed its logits, so no shard still reads the range's old adapter; and a shard reads the new rows
only in a step rank 0 sends after publishing them, the copy ordered before that message by the allocator's lock and
the socket it travels on.
"""

from __future__ import annotations

import datetime
import logging
import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from adapter_manager import AdapterManager, ModuleKey, RowLayout, SlotStacks, TensorParallel, map_shared
from adapter_manager.kernels import KernelConfig, LoRAKernelMeta, platform_for, select_backend

from ..model.batch import ForwardBatch
from ..model.checkpoint import load_model
from ..model.llama import Llama
from ..model.shard_plan import ShardGroup
from .config import EngineConfig

log = logging.getLogger(__name__)
_TIMEOUT_S = 7 * 24 * 3600  # a shard waits this long for rank 0's next step (an idle server sends none)


@dataclass(frozen=True)
class ShardLaunch:
    """What every shard's process loads: the same checkpoint, dtype and device kind, and where rank 0 listens."""

    folder: Path
    tensor_parallel: TensorParallel  # N shards, and whether the LoRA shrink is sharded too
    dtype: torch.dtype = torch.float32
    device: str = "cpu"  # cpu, or cuda (shard k on cuda:k)
    port: int = 0  # rank 0's loopback port; 0: a free one
    quantize: str | None = None

    @property
    def size(self) -> int:
        return self.tensor_parallel.size

    def __post_init__(self) -> None:
        if not platform_for(self.device).computes_on_host:  # the pool's sections are shared host memory
            raise ValueError(
                f"one process per shard runs on cpu (gloo, shared memory) here; {self.device} would need NCCL and one "
                "device per shard, not built yet (XLA devices run tensor parallelism as one SPMD program instead)"
            )
        if self.size < 2:
            raise ValueError(f"shard workers need a tensor_parallel_size of 2 or more, got {self.size}")


class ShardWorkers:
    """The shards 1..N-1 (their processes) as rank 0 sees them; :meth:`close` stops them."""

    def __init__(self, launch: ShardLaunch, processes: list, group: ShardGroup) -> None:
        self.launch, self.processes, self.group = launch, processes, group
        self._closed = False

    def load_model(self, pack_weights: bool | None = None) -> Llama:
        """Rank 0's shard of the model."""
        launch = self.launch
        cpu, plan = torch.device("cpu"), launch.tensor_parallel
        return load_model(launch.folder, launch.dtype, cpu, pack_weights, launch.quantize, plan, self.group)

    def close(self) -> None:
        """Tell every shard to stop, wait for their processes, and leave the process group."""
        if self._closed:
            return
        self._closed = True
        if dist.is_initialized():
            _scatter([("stop",)] * self.launch.size)
            dist.destroy_process_group()
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


def start_shard_workers(launch: ShardLaunch) -> ShardWorkers:
    """Start shards 1..N-1 (spawned processes, each loading its part of the checkpoint) and join them as rank 0."""
    if launch.port == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            launch = replace(launch, port=probe.getsockname()[1])
    context = mp.get_context("spawn")
    processes = [context.Process(target=_worker, args=(launch, rank), daemon=True) for rank in range(1, launch.size)]
    for process in processes:
        process.start()
    _join(launch, 0)
    return ShardWorkers(launch, processes, ShardGroup(launch.size, 0))


@dataclass(frozen=True)
class ShardSetup:
    """What rank 0 hands every shard once its engine is made: the KV caches' sizes, the step metadata's, the kernels'
    config, and where the pool's shared rows are."""

    max_batch: int
    max_seq_len: int
    kv_blocks: int
    block_size: int
    num_slots: int
    rank: int  # the pool's max rank
    max_tokens: int
    granule: int
    active_buckets: tuple[int, ...] | None
    kernels: KernelConfig | None
    rows: str  # the pool's rows ``[N, width]`` in shared memory (`AdapterManager.shared_rows`)
    num_rows: int
    tensor_parallel: TensorParallel

    def meta(self, device: torch.device) -> LoRAKernelMeta:
        """The step metadata rank 0's runner has."""
        backend = select_backend(device, self.kernels)
        return LoRAKernelMeta.make(
            backend,
            self.num_slots,
            self.rank,
            self.max_tokens,
            device,
            granule=self.granule,
            active_buckets=self.active_buckets,
        )


class ShardChannel:
    """Rank 0's side of each step: the shards' messages; the forward itself is the eager runner's (the pool's rows
    reach the shards through shared memory: nothing to send on a slot load)."""

    def __init__(self, model: Llama, meta: LoRAKernelMeta, manager: AdapterManager, config: EngineConfig) -> None:
        assert model.shard_group is not None
        if manager.shared_rows is None:
            raise ValueError(
                "one process per shard needs the adapter pool's rows in shared memory (a cpu pool over N > 1)"
            )
        self.size = model.shard_group.size
        caches = model.kv_caches[0]
        kernels = config.kernels if isinstance(config.kernels, KernelConfig) else None
        buckets = None if meta.active_buckets is None else tuple(meta.active_buckets)
        setup = ShardSetup(
            model.max_batch,
            model.max_seq_len,
            caches.num_blocks - 1,
            caches.block_size,
            meta.num_slots,
            meta.rank,
            meta.max_tokens,
            meta.granule,
            buckets,
            kernels,
            manager.shared_rows,
            meta.num_slots * meta.granule + 1,
            manager.tensor_parallel,
        )
        _scatter([("setup", setup)] * self.size)
        dist.barrier()  # every shard has mapped the rows

    def send(self, batch: ForwardBatch, slot_rows: Mapping[int, int]) -> None:
        """Hand every shard the step: its batch and the slots' ranks."""
        _scatter([("step", batch, dict(slot_rows))] * self.size)


def _scatter(messages: list, group: object | None = None) -> object:
    """Rank 0 hands message k to rank k over ``group`` (None: the default one); every other rank receives its own
    (``messages`` is ignored there)."""
    received: list = [None]
    dist.scatter_object_list(received, messages if dist.get_rank() == 0 else None, src=0, group=group)
    return received[0]


def _join(launch: ShardLaunch, rank: int) -> None:
    """Join the shards' process group (gloo on loopback: the steps and the forward's collectives)."""
    timeout = datetime.timedelta(seconds=_TIMEOUT_S)
    init = f"tcp://127.0.0.1:{launch.port}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=launch.size, timeout=timeout)


def _worker(launch: ShardLaunch, rank: int) -> None:
    """Shard ``rank``'s process: load its part, then run every step rank 0 sends until it says stop (the pool's rows,
    in shared memory, are written by rank 0 directly)."""
    _join(launch, rank)
    group = ShardGroup(launch.size, rank)
    device = torch.device("cpu")
    model = load_model(launch.folder, launch.dtype, device, None, launch.quantize, launch.tensor_parallel, group)
    meta = None
    while True:
        message = _scatter([])
        if message[0] == "stop":
            break
        if message[0] == "setup":
            setup: ShardSetup = message[1]
            model.setup_caches(setup.max_batch, setup.max_seq_len, setup.kv_blocks, setup.block_size)
            model.attach_lora(_shared_stacks(model, setup))
            meta = setup.meta(device)
            dist.barrier()  # mapped: rank 0 goes on
            continue
        _, batch, slot_rows = message
        assert meta is not None
        meta.prepare(batch.slot_indices, slot_rows)
        with torch.inference_mode():
            model(batch, meta)
    dist.destroy_process_group()


def _shared_stacks(model: Llama, setup: ShardSetup) -> dict[ModuleKey, SlotStacks]:
    """Every module's rows ``[N, S, in_s]`` / ``[N, S, out_s]`` of the pool rank 0 shares (the model reads its own
    section of each: `Llama.attach_lora`)."""
    layout = RowLayout.of(model.config.to_spec(), setup.tensor_parallel)
    rows = map_shared(setup.rows, (setup.num_rows, layout.width), model.dtype)
    return {key: SlotStacks(rows, layout, key, None) for key in layout.columns}
