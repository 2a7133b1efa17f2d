"""One process per tensor-parallel shard on eager devices (CPU: gloo; CUDA: NCCL), the engine in the first: vLLM's
multiprocess executor.

The first process (rank 0) holds the engine, the scheduler and the adapter manager, whose pool keeps every shard's
section of every row on the host side of rank 0; it starts the other shards (:func:`start_shard_workers`), each of
which loads only its part of every weight and holds its own section of the pool. A slot load sends each shard its
section of the adapter's rows as it completes, on a process group of its own and from the loading thread (a thread
in each shard writes them), and returns once every shard holds them, before the allocator publishes the slot: a
swap never stalls a step. Every step, rank 0 sends each shard the step (its batch and the step's slots' ranks), then
all run the forward together: the row-parallel layers' all-reduces and the logits' all-gather keep them in step, and
rank 0 samples from the joined logits.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from adapter_manager import AdapterManager, RowLayout, TensorParallel
from adapter_manager.kernels import KernelConfig, LoRAKernelMeta, select_backend

from ..model.batch import ForwardBatch
from ..model.checkpoint import load_model
from ..model.llama import Llama
from ..model.shard_group import ShardGroup
from .config import EngineConfig

log = logging.getLogger(__name__)
_TIMEOUT_S = 7 * 24 * 3600  # a shard waits this long for rank 0's next step (an idle server sends none)
_STOP = -1  # a load header's start row that says stop


@dataclass(frozen=True)
class ShardLaunch:
    """What every shard's process loads: the same checkpoint, dtype and device kind, and where rank 0 listens."""

    folder: Path
    size: int  # N shards
    dtype: torch.dtype = torch.float32
    device: str = "cpu"  # cpu, or cuda (shard k on cuda:k)
    port: int = 0  # rank 0's loopback port; 0: a free one
    quantize: str | None = None

    def __post_init__(self) -> None:
        if torch.device(self.device).type != "cpu":
            raise ValueError(
                f"one process per shard runs on cpu (gloo) here; {self.device} would need NCCL and one device per "
                "shard, not built yet (XLA devices run tensor parallelism as one SPMD program instead)"
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
        return load_model(
            launch.folder, launch.dtype, torch.device("cpu"), pack_weights, launch.quantize, launch.size, self.group
        )

    def close(self) -> None:
        """Tell every shard to stop, wait for their processes, and leave the process group."""
        if self._closed:
            return
        self._closed = True
        if dist.is_initialized():
            for rank in range(1, self.launch.size):
                dist.send(torch.tensor([_STOP, 0]), rank, group=self.group.loads)
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
            launch = ShardLaunch(**{**launch.__dict__, "port": probe.getsockname()[1]})
    context = mp.get_context("spawn")
    processes = [context.Process(target=_worker, args=(launch, rank), daemon=True) for rank in range(1, launch.size)]
    for process in processes:
        process.start()
    loads = _join(launch, 0)
    return ShardWorkers(launch, processes, ShardGroup(launch.size, 0, loads))


class ShardChannel:
    """Rank 0's side of each step: the shards' messages; the forward itself is the eager runner's."""

    def __init__(self, model: Llama, meta: LoRAKernelMeta, manager: AdapterManager, config: EngineConfig) -> None:
        assert model.shard_group is not None
        self.size, self._loads = model.shard_group.size, model.shard_group.loads
        self._lock = threading.Lock()  # one load at a time on the loads group
        caches = model.kv_caches[0]
        sizes = (model.max_batch, model.max_seq_len, caches.num_blocks - 1, caches.block_size)
        meta_args = (meta.num_slots, meta.rank, meta.max_tokens, meta.granule, meta.active_buckets, config.kernels)
        with self._lock:  # the pool as it is now (adapters loaded before the engine); later loads follow it
            manager.on_slot_load(self._on_load)
            rows = [None] + [
                {key: (s.a[:, rank].clone(), s.bt[:, rank].clone()) for key, s in manager.stacks.items()}
                for rank in range(1, self.size)
            ]
        plan = manager.tensor_parallel  # the rows' sections: the base's split, or fully sharded
        _scatter([("setup", sizes, meta_args, rows[rank], plan) for rank in range(self.size)])

    def _on_load(self, start: int, block: torch.Tensor) -> None:
        """A slot load completed on rank 0: every other shard writes its section of ``block [r, N, W]`` (shard k's,
        ``block[:, k]``, is one contiguous piece: `RowLayout.block`) into its rows from ``start``; returns once all
        have."""
        with self._lock:  # a header (start, rows), then the section itself: its bytes as they are, no pickle
            for rank in range(1, self.size):
                dist.send(torch.tensor([start, block.shape[0]]), rank, group=self._loads)
                dist.send(block[:, rank], rank, group=self._loads)  # contiguous: section-major memory
            dist.barrier(group=self._loads)

    def send(self, batch: ForwardBatch, slot_rows: Mapping[int, int]) -> None:
        """Hand every shard the step: its batch and the slots' ranks."""
        _scatter([("step", batch, dict(slot_rows))] * self.size)


def _scatter(messages: list, group: object | None = None) -> object:
    """Rank 0 hands message k to rank k over ``group`` (None: the default one); every other rank receives its own
    (``messages`` is ignored there)."""
    received: list = [None]
    dist.scatter_object_list(received, messages if dist.get_rank() == 0 else None, src=0, group=group)
    return received[0]


def _join(launch: ShardLaunch, rank: int) -> object:
    """Join the shards' process group; returns the second group the slot loads travel on."""
    timeout = datetime.timedelta(seconds=_TIMEOUT_S)
    init = f"tcp://127.0.0.1:{launch.port}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=launch.size, timeout=timeout)
    return dist.new_group(backend="gloo", timeout=timeout)


def _worker(launch: ShardLaunch, rank: int) -> None:
    """Shard ``rank``'s process: load its part, then run every step rank 0 sends until it says stop (the slot loads
    arrive on a thread of their own)."""
    group = ShardGroup(launch.size, rank, _join(launch, rank))
    pool: list[torch.Tensor] = []  # this shard's section of the row pool, once rank 0's setup has come
    ready = threading.Event()
    loads = threading.Thread(target=_receive_loads, args=(group.loads, pool, ready), name="shard-loads")
    loads.start()
    device = torch.device("cpu")
    model = load_model(launch.folder, launch.dtype, device, None, launch.quantize, launch.size, group)
    meta = None
    while True:
        message = _scatter([])
        if message[0] == "stop":
            break
        if message[0] == "setup":
            (max_batch, max_seq_len, blocks, block_size), meta_args, rows_now, plan = message[1:]
            model.setup_caches(max_batch, max_seq_len, blocks, block_size)
            rows, meta = _own_pool(model, meta_args, device, rows_now, plan)
            pool.append(rows)
            ready.set()
            continue
        _, batch, slot_rows = message
        assert meta is not None
        meta.prepare(batch.slot_indices, slot_rows)
        with torch.inference_mode():
            model(batch, meta)
    loads.join()
    dist.destroy_process_group()


def _receive_loads(loads: object, pool: list[torch.Tensor], ready: threading.Event) -> None:
    """Receive every section of adapter rows rank 0 sends straight into this shard's pool rows, acknowledging each,
    until stop."""
    header = torch.empty(2, dtype=torch.int64)
    while True:
        dist.recv(header, 0, group=loads)
        start, rows = header.tolist()
        if start == _STOP:
            return
        ready.wait()  # the pool exists once the setup (which rank 0 sends before any load) has been applied
        dist.recv(pool[0][start : start + rows], 0, group=loads)  # a contiguous row range: received in place
        dist.barrier(group=loads)


def _own_pool(
    model: Llama, meta_args: tuple, device: torch.device, rows_now: Mapping, plan: TensorParallel
) -> tuple[torch.Tensor, LoRAKernelMeta]:
    """This shard's section of the row pool ``[N, W]`` as rank 0's pool holds it now (later loads arrive with the
    steps), attached to the model, and the step metadata rank 0's runner has."""
    num_slots, rank, max_tokens, granule, active_buckets, kernels = meta_args
    spec = model.config.to_spec()
    layout = RowLayout.of(spec, plan)
    rows = torch.zeros(num_slots * granule + 1, layout.section_width, dtype=model.dtype, device=device)
    stacks = {key: _Rows(rows, columns) for key, columns in layout.columns.items()}
    for key, (a, bt) in rows_now.items():
        stacks[key].a.copy_(a)
        stacks[key].bt.copy_(bt)
    model.attach_lora(stacks)
    backend = select_backend(device, kernels if isinstance(kernels, KernelConfig) else None)
    meta = LoRAKernelMeta.make(
        backend, num_slots, rank, max_tokens, device, granule=granule, active_buckets=active_buckets
    )
    return rows, meta


class _Rows:
    """One module's rows in this shard's section of the pool: ``A [N, in_s]``, ``Bt [N, out_s]`` views."""

    def __init__(self, rows: torch.Tensor, columns) -> None:  # noqa: ANN001 - a RowLayout's ModuleColumns
        self.a = rows[:, columns.a_start : columns.a_start + columns.in_features]
        self.bt = rows[:, columns.bt_start : columns.bt_start + columns.out_features]
        self.vector = None  # no vector rows under tensor parallelism (variants with one are refused)
