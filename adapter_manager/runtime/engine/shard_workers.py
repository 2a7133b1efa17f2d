"""One process per tensor-parallel shard on eager devices (CPU: gloo; CUDA: NCCL), the engine in the first: vLLM's
multiprocess executor.

The first process (rank 0) holds the engine, the scheduler and the adapter manager, whose pool keeps every shard's
section of every row on the host side of rank 0; it starts the other shards (:func:`start_shard_workers`), each of
which loads only its part of every weight and holds its own section of the pool. Every step, rank 0 sends each shard
the step (its batch and the step's slots' ranks), then all run the forward together: the row-parallel layers'
all-reduces and the logits' all-gather keep them in step, and rank 0 samples from the joined logits.

On CPU each shard's section of the pool lives in shared memory (:class:`SharedSection`: a file in /dev/shm that
rank 0 makes and both map, unlinked once every shard has mapped it), so a slot load is rank 0 copying each section
of the block straight into that shard's rows, from the loading thread, before the allocator publishes the slot: a
swap never stalls a step. No signal follows the copy. The rows are written only while the allocator keeps the range
out of every step (unpublished, and no step's pin on it): rank 0's pins last until its step's logits all-gather has
returned, by when every shard has computed its logits, so no shard still reads the range's old adapter; and a shard
reads the new rows only in a step rank 0 sends after publishing them, the copy ordered before that message by the
allocator's lock and the socket it travels on.
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
import socket
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from adapter_manager import AdapterManager, RowLayout, TensorParallel
from adapter_manager.kernels import KernelConfig, LoRAKernelMeta, platform_for, select_backend

from ..model.batch import ForwardBatch
from ..model.checkpoint import load_model
from ..model.llama import Llama
from ..model.shard_group import ShardGroup
from .config import EngineConfig

log = logging.getLogger(__name__)
_TIMEOUT_S = 7 * 24 * 3600  # a shard waits this long for rank 0's next step (an idle server sends none)


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
        return load_model(
            launch.folder, launch.dtype, torch.device("cpu"), pack_weights, launch.quantize, launch.size, self.group
        )

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
            launch = ShardLaunch(**{**launch.__dict__, "port": probe.getsockname()[1]})
    context = mp.get_context("spawn")
    processes = [context.Process(target=_worker, args=(launch, rank), daemon=True) for rank in range(1, launch.size)]
    for process in processes:
        process.start()
    _join(launch, 0)
    return ShardWorkers(launch, processes, ShardGroup(launch.size, 0))


class ShardChannel:
    """Rank 0's side of each step: the shards' messages and their pool sections in shared memory; the forward itself
    is the eager runner's."""

    def __init__(self, model: Llama, meta: LoRAKernelMeta, manager: AdapterManager, config: EngineConfig) -> None:
        assert model.shard_group is not None
        self.size = model.shard_group.size
        caches = model.kv_caches[0]
        sizes = (model.max_batch, model.max_seq_len, caches.num_blocks - 1, caches.block_size)
        meta_args = (meta.num_slots, meta.rank, meta.max_tokens, meta.granule, meta.active_buckets, config.kernels)
        plan = manager.tensor_parallel  # the rows' sections: the base's split, or fully sharded
        layout = RowLayout.of(model.config.to_spec(), plan)
        shape = (meta.num_slots * meta.granule + 1, layout.section_width)
        self._sections: list[SharedSection] = []  # shards 1..N-1's
        self._ready = threading.Event()  # set once the sections hold the pool as it was when loads began to follow
        try:
            for _ in range(1, self.size):
                self._sections.append(SharedSection.make(shape, model.dtype))
            manager.on_slot_load(self._on_load)
            for rank, shared in enumerate(self._sections, start=1):  # the pool now (adapters loaded before the engine)
                stacks = {key: _Rows(shared.rows, columns) for key, columns in layout.columns.items()}
                for key, rows in manager.stacks.items():
                    stacks[key].a.copy_(rows.a[:, rank])
                    stacks[key].bt.copy_(rows.bt[:, rank])
            self._ready.set()
            paths = [None] + [str(shared.path) for shared in self._sections]
            _scatter([("setup", sizes, meta_args, paths[rank], plan) for rank in range(self.size)])
            dist.barrier()  # every shard has mapped its section
        finally:
            self._ready.set()
            for shared in self._sections:
                shared.unlink()

    def _on_load(self, start: int, block: torch.Tensor) -> None:
        """A slot load completed on rank 0: copy every other shard's section of ``block [r, N, W]`` (shard k's,
        ``block[:, k]``, one contiguous piece: `RowLayout.block`) into its shared rows from ``start``; returns once
        all are written."""
        self._ready.wait()  # a load that raced the setup's snapshot is written after it
        for rank, shared in enumerate(self._sections, start=1):
            shared.rows[start : start + block.shape[0]].copy_(block[:, rank])

    def send(self, batch: ForwardBatch, slot_rows: Mapping[int, int]) -> None:
        """Hand every shard the step: its batch and the slots' ranks."""
        _scatter([("step", batch, dict(slot_rows))] * self.size)


class SharedSection:
    """One shard's section of the row pool ``[N, W_s]`` in shared memory: a file rank 0 makes (in /dev/shm where
    there is one), mapped by rank 0 and by the shard, unlinked once both have mapped it (the memory lives until the
    last mapping goes: once the setup is over nothing is left in /dev/shm, however the processes end)."""

    def __init__(self, path: Path, rows: torch.Tensor) -> None:
        self.path, self.rows = path, rows

    @classmethod
    def make(cls, shape: tuple[int, int], dtype: torch.dtype) -> SharedSection:
        """A zero-filled section, its bytes reserved now: a full /dev/shm fails here, not at a later write."""
        folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        path = folder / f"adapter-manager-tp-{os.getpid()}-{secrets.token_hex(8)}"
        nbytes = shape[0] * shape[1] * dtype.itemsize
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as err:
            os.unlink(path)
            raise RuntimeError(f"no room for a {nbytes} B pool section in {folder}: {err}") from err
        finally:
            os.close(fd)
        return cls(path, cls.map(path, shape, dtype))

    @staticmethod
    def map(path: Path | str, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """The section at ``path`` mapped into this process: writes go to every process mapping it."""
        return torch.from_file(str(path), shared=True, size=shape[0] * shape[1], dtype=dtype).view(shape)

    def unlink(self) -> None:
        """Remove the file (the mappings stay); a no-op once gone."""
        self.path.unlink(missing_ok=True)


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
    """Shard ``rank``'s process: load its part, then run every step rank 0 sends until it says stop (its section of
    the pool, in shared memory, is written by rank 0 directly)."""
    _join(launch, rank)
    group = ShardGroup(launch.size, rank)
    device = torch.device("cpu")
    model = load_model(launch.folder, launch.dtype, device, None, launch.quantize, launch.size, group)
    meta = None
    while True:
        message = _scatter([])
        if message[0] == "stop":
            break
        if message[0] == "setup":
            (max_batch, max_seq_len, blocks, block_size), meta_args, path, plan = message[1:]
            model.setup_caches(max_batch, max_seq_len, blocks, block_size)
            meta = _own_pool(model, meta_args, device, path, plan)
            dist.barrier()  # mapped: rank 0 may unlink the file
            continue
        _, batch, slot_rows = message
        assert meta is not None
        meta.prepare(batch.slot_indices, slot_rows)
        with torch.inference_mode():
            model(batch, meta)
    dist.destroy_process_group()


def _own_pool(model: Llama, meta_args: tuple, device: torch.device, path: str, plan: TensorParallel) -> LoRAKernelMeta:
    """This shard's section of the row pool ``[N, W]``, mapped from rank 0's shared file (which holds the pool as it
    is now and takes every later load), attached to the model; returns the step metadata rank 0's runner has."""
    num_slots, rank, max_tokens, granule, active_buckets, kernels = meta_args
    layout = RowLayout.of(model.config.to_spec(), plan)
    rows = SharedSection.map(path, (num_slots * granule + 1, layout.section_width), model.dtype)
    model.attach_lora({key: _Rows(rows, columns) for key, columns in layout.columns.items()})
    backend = select_backend(device, kernels if isinstance(kernels, KernelConfig) else None)
    return LoRAKernelMeta.make(
        backend, num_slots, rank, max_tokens, device, granule=granule, active_buckets=active_buckets
    )


class _Rows:
    """One module's rows in this shard's section of the pool: ``A [N, in_s]``, ``Bt [N, out_s]`` views."""

    def __init__(self, rows: torch.Tensor, columns) -> None:  # noqa: ANN001 - a RowLayout's ModuleColumns
        self.a = rows[:, columns.a_start : columns.a_start + columns.in_features]
        self.bt = rows[:, columns.bt_start : columns.bt_start + columns.out_features]
        self.vector = None  # no vector rows under tensor parallelism (variants with one are refused)
