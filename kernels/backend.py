"""The one seam that picks a shrink/expand backend, from the device, the config and the measured table."""

from __future__ import annotations

from typing import Protocol

import torch

from kernels.config import BackendKind, KernelConfig

_EAGER_DEVICES = ("cpu", "cuda")


class KernelBackend(Protocol):
    """What every backend provides; ops in :mod:`kernels.ops` validate, then call these."""

    traced: bool
    """True when the ops trace into a graph (XLA): static shapes, no host sync, expand returns a new tensor."""
    laned_output: bool
    """True when shrink's h is laned ``[T, S·R]`` rather than ``[T, R]``."""
    max_segment_runs: int
    """Eager: at most max(this, 2 × active slots) runs of equal slots -> per-run row slices; 0 = never."""

    def prefers_laned(self, num_tokens: int, num_slots: int, rank: int) -> bool: ...

    def shrink(self, x: torch.Tensor, a_stack: torch.Tensor, meta: object) -> torch.Tensor: ...

    def expand(
        self, y: torch.Tensor, h: torch.Tensor, bt_stack: torch.Tensor, meta: object, accumulate: bool
    ) -> torch.Tensor: ...


def _build(kind: BackendKind, config: KernelConfig) -> KernelBackend:
    if kind is BackendKind.REFERENCE:
        from kernels.reference import ReferenceBackend

        return ReferenceBackend()
    if kind is BackendKind.TORCH:
        from kernels.dispatch_table import TorchDispatchTable
        from kernels.torch_eager import TorchEagerBackend

        return TorchEagerBackend(TorchDispatchTable.load(config.dispatch_table))
    if kind is BackendKind.XLA:
        from kernels.xla_laned import XlaLanedBackend

        return XlaLanedBackend()
    if kind is BackendKind.PALLAS:
        from kernels.block_sizes import BlockSizeTable
        from kernels.pallas_backend import PallasBackend

        return PallasBackend(BlockSizeTable.load(config.block_size_table), interpret=config.pallas_interpret)
    raise ValueError(f"no backend for {kind!r}")


def select_backend(device: torch.device | str, config: KernelConfig | None = None) -> KernelBackend:
    """Pick the backend once, outside the hot path: cpu/cuda -> torch, xla -> ``config.xla_backend``.

    A forced ``config.backend`` wins, except that eager-only backends (torch, reference) refuse an XLA device and the
    Pallas backend refuses anything but an XLA device.
    """
    config = config or KernelConfig()
    device_type = torch.device(device).type
    kind = config.backend
    if kind is BackendKind.AUTO:
        if device_type in _EAGER_DEVICES:
            kind = BackendKind.TORCH
        elif device_type == "xla":
            kind = config.xla_backend
        else:
            raise ValueError(f"no kernel backend for device type {device_type!r}; expected cpu, cuda or xla")
    if kind in (BackendKind.TORCH, BackendKind.REFERENCE) and device_type == "xla":
        raise ValueError(f"backend {kind.value!r} is eager-only (host syncs per step); device is {device_type!r}")
    if kind is BackendKind.PALLAS and device_type != "xla":
        raise ValueError(f"backend 'pallas' needs an xla device (torch_xla), got {device_type!r}")
    return _build(kind, config)
