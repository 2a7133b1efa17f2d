"""The device decided once (vLLM's ``Platform``): a :class:`Platform` per device kind holds what differs between
them, so no other module asks which device it runs on.

- :class:`CpuPlatform`: eager steps, the cpu room's layer kernels (packed weights, the C++ decode glue), the math on
  the host (a step's tensors are host memory), free memory from the OS, one process per tensor-parallel shard.
- :class:`CudaPlatform`: eager steps, the torch forms plus the Triton paged decode attention, decode steps captured
  as CUDA graphs, free memory from the driver.
- :class:`XlaPlatform`: traced steps (static shapes, one sync a step: :meth:`Platform.sync`), the torch forms with
  norms in their unfused math, views of the pool handed out fresh per step, a weight read back to the host,
  checkpoints assembled on the host, tensor-parallel shards as one SPMD program.

:func:`platform_for` is the one selection point: one object per device, made on first use. Each platform also names
its shrink / expand backend (:func:`kernels.backend.select_backend`, whose executor runs every linear of a step).
"""

from __future__ import annotations

import functools
import os

import torch

from adapter_manager.kernels.backend import select_backend
from adapter_manager.kernels.config import KernelConfig
from adapter_manager.kernels.cpu.layer_kernels import CpuLayerKernels
from adapter_manager.kernels.device_kernels import LayerKernels
from adapter_manager.kernels.layer_reference import UnfusedDecodeOps
from adapter_manager.kernels.protocol import DecodeOps, KernelBackend
from adapter_manager.kernels.triton.layer_kernels import CudaLayerKernels


class Platform:
    """One device kind's answers; an instance is bound to one device (:func:`platform_for`)."""

    kind = ""
    static_shapes = False
    """Steps run at static shapes, traced into graphs compiled ahead (no host sync inside a step, tensors updated out
    of place): the engine's traced runner, a traced backend's executor, transfers warmed up before serving."""
    computes_on_host = False
    """The host's CPU runs the math: a step tensor is host memory (reading it syncs nothing), and the host's
    instruction set decides which dtypes are fast."""
    spmd = False
    """Tensor-parallel shards run as one SPMD program over this kind's devices (XLA); False: one process per shard."""
    loads_on_host = False
    """A checkpoint's parameters are assembled on the host and placed whole (XLA: each device receives its shard
    once, and no parameter is left a view of slice writes); False: written in place on the device."""
    captures_graphs = False
    """Decode steps may be captured and replayed as device graphs (``runtime.engine.cuda_graphs``)."""
    keeps_views = True
    """A view of the row pool kept across steps stays a view (XLA: the pool hands out fresh views per step, and a
    kept one would be materialised as a copy of its own)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._kernels: dict[bool, LayerKernels] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"

    def _make_kernels(self, deterministic: bool) -> LayerKernels:
        return LayerKernels(deterministic)

    def layer_kernels(self, deterministic: bool = False) -> LayerKernels:
        """The device's base matmuls, weight layouts and decode glue (one object per mode, kept). ``deterministic``:
        batch-invariant base matmuls and norms (eager devices; refused on XLA)."""
        if deterministic not in self._kernels:
            self._kernels[deterministic] = self._make_kernels(deterministic)
        return self._kernels[deterministic]

    def backend(self, config: KernelConfig | None = None, deterministic: bool = False) -> KernelBackend:
        """The shrink / expand backend for this device (:func:`kernels.backend.select_backend`)."""
        return select_backend(self.device, config, deterministic)

    def free_bytes(self) -> int | None:
        """Free memory where the caches live (the KV pool's default bound); None where it cannot be asked."""
        return None

    def sync(self) -> None:
        """Run the work queued on the device (a traced step's one sync); eager devices: nothing to do."""

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` readable on the host: itself where the host reads device memory directly (CPU) or the caller
        copies it anyway (CUDA), a host copy on XLA."""
        return tensor


class CpuPlatform(Platform):
    kind = "cpu"
    computes_on_host = True

    def _make_kernels(self, deterministic: bool) -> LayerKernels:
        return CpuLayerKernels(deterministic)

    def free_bytes(self) -> int | None:
        if not hasattr(os, "sysconf"):
            return None
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class CudaPlatform(Platform):
    kind = "cuda"
    captures_graphs = True

    def _make_kernels(self, deterministic: bool) -> LayerKernels:
        return CudaLayerKernels(deterministic)

    def free_bytes(self) -> int | None:
        return torch.cuda.mem_get_info(self.device)[0]


class XlaLayerKernels(LayerKernels):
    """XLA's layer kernels: the torch forms, the norms in their unfused math (``F.rms_norm`` would be one more op the
    graph lowers differently from the model's own rounding)."""

    def __init__(self, deterministic: bool = False) -> None:
        if deterministic:
            raise ValueError("the deterministic mode runs on eager devices (cpu, cuda), got 'xla'")
        super().__init__()

    def decode_ops(self, like: torch.Tensor, compiled: bool = True) -> DecodeOps:
        return UnfusedDecodeOps()


class XlaPlatform(Platform):
    kind = "xla"
    static_shapes = True
    keeps_views = False
    spmd = True
    loads_on_host = True

    def _make_kernels(self, deterministic: bool) -> LayerKernels:
        return XlaLayerKernels(deterministic)

    def sync(self) -> None:
        import torch_xla

        torch_xla.sync()

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.cpu()


class MetaPlatform(Platform):
    """The meta device (a model built before its weights load): shapes only, the torch forms."""

    kind = "meta"


_PLATFORMS: dict[str, type[Platform]] = {p.kind: p for p in (CpuPlatform, CudaPlatform, XlaPlatform, MetaPlatform)}


@functools.cache
def _platform(device: torch.device) -> Platform:
    kind = _PLATFORMS.get(device.type)
    if kind is None:
        raise ValueError(f"no platform for device type {device.type!r}; expected cpu, cuda or xla")
    return kind(device)


def platform_for(device: torch.device | str) -> Platform:
    """The platform of ``device`` (one object per device, made on first use)."""
    return _platform(torch.device(device))
