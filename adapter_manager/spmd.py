"""One SPMD program over a mesh of devices (torch_xla's GSPMD): the mesh a tensor-parallel size runs on, and the
sharding marks that place each tensor's shards.

The mesh is ``(D / N, N)`` over every device the runtime has, axes ``("data", "model")``: tensor parallelism shards
over ``model`` (N devices) and nothing is sharded over ``data``, so with D > N each group of N devices holds a whole
copy. GSPMD partitions the traced step from the marks: a weight or pool row tensor marked on ``model`` lives 1/N on
each device, and the collectives the math needs (the row-parallel sums) are inserted by the partitioner.
"""

from __future__ import annotations

from typing import Any

MODEL_AXIS = "model"


def mesh(size: int) -> Any:
    """The global mesh for ``size``-way tensor parallelism, made once (SPMD mode switched on first: call before any
    tensor is placed on the XLA device). Raises ValueError when the devices cannot hold ``size`` shards."""
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    if not xr.is_spmd():
        xr.use_spmd()
    current = xs.get_global_mesh()
    if current is not None and current.mesh_shape[1] == size:
        return current
    devices = xr.global_runtime_device_count()
    if size < 1 or devices % size:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the {devices} XLA devices "
            "(on the CPU device: PJRT_DEVICE=CPU CPU_NUM_DEVICES=N)"
        )
    made = xs.Mesh(np.arange(devices), (devices // size, size), ("data", MODEL_AXIS))
    xs.set_global_mesh(made)
    return made


def mark(tensor: Any, size: int, spec: tuple[str | None, ...]) -> None:
    """Shard ``tensor`` (on the XLA device) over ``size`` devices along the dims ``spec`` names ``"model"``; None
    dims are whole on every device."""
    import torch_xla.distributed.spmd as xs

    if tensor.device.type != "xla":
        raise ValueError(f"tensor parallelism over {size} devices runs on XLA; the tensor is on {tensor.device}")
    xs.mark_sharding(tensor, mesh(size), spec)


class Shards:
    """The marks a sharded linear of the traced step makes over ``size`` devices (``kernels.linear_lora.ShardHooks``):
    pin an intermediate's sharding, and run a backend's kernels per shard between manual-sharding marks (what GSPMD
    cannot partition, the Pallas kernels, sees one device's shapes there)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def pin(self, tensor: Any, dim: int | None) -> Any:
        """Mark ``tensor``, an intermediate of the traced step, split along ``dim`` (None: whole on every device), and
        return it: the partitioner then moves it there, where its own choice can cost a collective elsewhere. A
        tensor off the XLA device is returned as it is."""
        if tensor.device.type == "xla":
            mark(tensor, self.size, _spec(tensor.dim(), dim))
        return tensor

    def local(self, tensor: Any, dim: int | None) -> Any:
        import torch_xla.distributed.spmd as xs

        return xs.enable_manual_sharding(tensor, _spec(tensor.dim(), dim), mesh=mesh(self.size)).global_tensor

    def join(self, tensor: Any, dim: int | None, shape: tuple[int, ...]) -> Any:
        import torch
        import torch_xla.distributed.spmd as xs

        spec, full = _spec(len(shape), dim), torch.Size(shape)
        return xs.disable_manual_sharding(tensor, spec, full, mesh=mesh(self.size)).global_tensor


def _spec(rank: int, dim: int | None) -> tuple[str | None, ...]:
    return tuple(MODEL_AXIS if axis == dim else None for axis in range(rank))


def place(tensor: Any, size: int, dim: int) -> Any:
    """A host tensor as an XLA tensor split over ``size`` devices along ``dim``, each device receiving only its own
    piece (with more devices than ``size``, each replica of it): the host sends the tensor's bytes once per replica,
    where ``tensor.to(device)`` would send all of it to every device."""
    width = tensor.shape[dim] // size
    return place_pieces([tensor.narrow(dim, s * width, width).contiguous() for s in range(size)], dim)


def place_pieces(pieces: list[Any], dim: int) -> Any:
    """The host tensors ``pieces`` (N, contiguous, equal shapes) joined along ``dim`` as one XLA tensor split over N
    devices, device piece s holding ``pieces[s]``: no host copy beyond the transfer itself."""
    import torch_xla
    import torch_xla.runtime as xr

    size = len(pieces)
    placed = mesh(size)
    shards = [pieces[d % size] for d in range(xr.global_runtime_device_count())]  # device d: mesh column d % size
    return torch_xla._XLAC._global_tensor_from_cpu_shards(shards, placed.get_op_sharding(_spec(pieces[0].dim(), dim)))
