"""How rows reach the pool's device: one row writer per device kind, chosen once (:func:`row_writer`), so the pool
itself never asks which device it is on.

- :class:`RowWriter` (CPU): zeros allocated in place; a load is one ``copy_`` into the range.
- :class:`SharedRowWriter` (CPU over N > 1 tensor-parallel shards, one process each): the same, but the rows live
  in shared memory (a memfd) that every shard's process maps (:attr:`RowWriter.shared_path`), each reading its own
  section of every row: a load is rank 0's one copy, seen by every shard, with no copy per shard.
- :class:`CudaRowWriter`: the host block is pinned (:attr:`RowWriter.pins_host`); a load is one async copy on a side
  stream that first waits for the compute stream's queued work (a kernel still reading the range's previous adapter),
  and the host waits on an event before the allocator publishes the slot.
- :class:`XlaRowWriter`: zeros made on the host and moved whole (device data, no graph to compile), each device's
  section marked over tensor-parallel shards; a load is an ``index_copy_`` whose start row is a device index (one
  graph per block size class for every slot), then a sync; loads serialise on the device lock (lazy-tensor tracing
  of one tensor from two threads is not safe); :meth:`XlaRowWriter.warm_up` compiles every block size's graph when
  the pool is made.
"""

from __future__ import annotations

import math
import os
import threading
import weakref

import torch

from ..sharding import TensorParallel
from ..spmd import MODEL_AXIS, mark, place_pieces


class RowWriter:
    """Plain copies (CPU). ``device``: where the pool lives; ``tensor_parallel``: its sections (XLA marks them)."""

    pins_host = False
    """Prepared blocks are worth pinning in host memory (an async copy reads them)."""
    fresh_views = False
    """The kernels get fresh views of the rows at each access (`SlotStacks`): XLA, where a view kept alive across
    syncs would be materialised as a copy of its own, and a slot load would switch a step between two graphs."""

    def __init__(self, device: torch.device, tensor_parallel: TensorParallel) -> None:
        self.device = device
        self.tensor_parallel = tensor_parallel
        self.lock = threading.RLock()
        """The device lock (re-entrant: the engine holds it around a whole traced step): what :meth:`write`
        serialises on where the device needs it."""
        self.shared_path: str | None = None
        """Where another process of this machine maps the sectioned rows (:class:`SharedRowWriter`); None: the
        rows are this process's own."""

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, sectioned: bool = False) -> torch.Tensor:
        """A zero tensor on the device; ``sectioned``: each device holds its section of dim 1 (over shards)."""
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def warm_up(self, rows: torch.Tensor, vectors: torch.Tensor | None, granule: int, units: list[int]) -> None:
        """Compile what a load needs, ahead (XLA: each block size's graph, into the free zero unit 0)."""

    def write(
        self,
        rows: torch.Tensor,
        start: int,
        block: torch.Tensor,
        padded_rows: int,
        vectors: torch.Tensor | None = None,
        slot: int = 0,
        vector: torch.Tensor | None = None,
    ) -> None:
        """``rows[start : start + r] = block`` (``block [r, ...]`` viewed as the range), and ``vectors[slot] =
        vector`` where given; returns once the copy has completed on the device. ``padded_rows``: the rows of the
        block's size class (the units it takes × granule), which a traced device copies whole."""
        rows[start : start + block.shape[0]].view(block.shape).copy_(block)
        if vector is not None:
            assert vectors is not None
            vectors[slot].copy_(vector)


class SharedRowWriter(RowWriter):
    """CPU rows every tensor-parallel shard's process maps: a memfd (anonymous shared memory, gone with its last
    mapping or descriptor, never a file left behind) whose bytes are reserved when the pool is made, so a full
    /dev/shm fails here and not at a later write. Other processes open it by :attr:`shared_path`
    (``/proc/<pid>/fd/<fd>``, which this writer keeps open while it lives) and map it shared."""

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, sectioned: bool = False) -> torch.Tensor:
        if not sectioned:
            return super().zeros(shape, dtype)
        assert self.shared_path is None, "one shared tensor per writer"
        nbytes = dtype.itemsize * shape[0] * shape[1]
        fd = os.memfd_create("adapter-manager-rows", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as err:
            os.close(fd)
            raise RuntimeError(f"no room for the {nbytes} B row pool in shared memory: {err}") from err
        weakref.finalize(self, os.close, fd)
        self.shared_path = f"/proc/{os.getpid()}/fd/{fd}"
        return map_shared(self.shared_path, shape, dtype)


def map_shared(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The shared rows at ``path`` (:attr:`RowWriter.shared_path`) mapped into this process: writes from any
    process mapping them are seen by all."""
    return torch.from_file(path, shared=True, size=math.prod(shape), dtype=dtype).view(shape)


class CudaRowWriter(RowWriter):
    pins_host = True

    def __init__(self, device: torch.device, tensor_parallel: TensorParallel) -> None:
        super().__init__(device, tensor_parallel)
        self._stream = torch.cuda.Stream(device)

    def write(
        self,
        rows: torch.Tensor,
        start: int,
        block: torch.Tensor,
        padded_rows: int,
        vectors: torch.Tensor | None = None,
        slot: int = 0,
        vector: torch.Tensor | None = None,
    ) -> None:
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            rows[start : start + block.shape[0]].view(block.shape).copy_(block, non_blocking=True)
            if vector is not None:
                assert vectors is not None
                vectors[slot].copy_(vector, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()  # keeps the host block alive until read, and the slot unpublished until written


class XlaRowWriter(RowWriter):
    fresh_views = True

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, sectioned: bool = False) -> torch.Tensor:
        tensor = torch.zeros(shape, dtype=dtype).to(self.device)
        if sectioned and self.tensor_parallel.size > 1:
            mark(tensor, self.tensor_parallel.size, (None, MODEL_AXIS))
        return tensor

    def warm_up(self, rows: torch.Tensor, vectors: torch.Tensor | None, granule: int, units: list[int]) -> None:
        with self.lock:
            # a first copy into the freshly transferred rows traces a graph of its own: do it once more below
            for count in [1, *units]:
                self._copy(rows, 0, torch.zeros(count * granule, rows.shape[1], dtype=rows.dtype))
            if vectors is not None:
                for _ in range(2):  # the vector row's load graph, once past the fresh transfer's own
                    self._copy_vector(vectors, 0, torch.zeros(vectors.shape[1], dtype=vectors.dtype))

    def write(
        self,
        rows: torch.Tensor,
        start: int,
        block: torch.Tensor,
        padded_rows: int,
        vectors: torch.Tensor | None = None,
        slot: int = 0,
        vector: torch.Tensor | None = None,
    ) -> None:
        with self.lock:
            if block.dim() == 2:
                padded = block.new_zeros(padded_rows, block.shape[1])
            else:  # [r, N, W_s] over section-major memory (`RowLayout.block`): each section one contiguous piece
                padded = block.new_zeros(block.shape[1], padded_rows, block.shape[2]).transpose(0, 1)
            padded[: block.shape[0]].copy_(block)  # the graph depends on the block size class only
            self._copy(rows, start, padded)
            if vector is not None:
                assert vectors is not None
                self._copy_vector(vectors, slot, vector)

    def _copy(self, rows: torch.Tensor, start: int, block: torch.Tensor) -> None:
        # The start row is a device index tensor, never a Python int: one graph per block size for every slot.
        index = (torch.arange(block.shape[0]) + start).to(self.device)  # [rows]
        if block.dim() == 2:
            placed = block.to(self.device)
        else:  # [units·G, N, W_s]: each device gets its section, one contiguous piece
            placed = place_pieces(list(block.transpose(0, 1)), 1).view(block.shape[0], -1)
        rows.index_copy_(0, index, placed)
        _sync()

    def _copy_vector(self, vectors: torch.Tensor, slot: int, vector: torch.Tensor) -> None:
        index = torch.tensor([slot]).to(self.device)  # a device index: one graph for every slot
        vectors.index_copy_(0, index, vector[None].to(self.device))
        _sync()


def _sync() -> None:
    """Cut the lazy graph and wait for the device to finish it (the slot is complete when this returns)."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch_xla.sync()
    xm.wait_device_ops()


_WRITERS: dict[str, type[RowWriter]] = {"cpu": RowWriter, "cuda": CudaRowWriter, "xla": XlaRowWriter}


def check_device(device: torch.device | str) -> None:
    """Refuse, by name, a device the pool has no row writer for."""
    if torch.device(device).type not in _WRITERS:
        raise ValueError(f"device must be cpu, cuda or xla, got {device}")


def row_writer(device: torch.device | str, tensor_parallel: TensorParallel) -> RowWriter:
    """The row writer of ``device``'s kind (cpu, cuda, xla; anything else refused by name); on CPU over N > 1
    shards (one process each) the rows are shared memory."""
    check_device(device)
    device = torch.device(device)
    if device.type == "cpu" and tensor_parallel.size > 1:
        return SharedRowWriter(device, tensor_parallel)
    return _WRITERS[device.type](device, tensor_parallel)


def pins_host(device: torch.device | str) -> bool:
    """Whether prepared blocks for a pool on ``device`` are worth pinning in host memory (CUDA)."""
    return _WRITERS.get(torch.device(device).type, RowWriter).pins_host
