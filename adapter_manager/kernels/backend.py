"""The one seam that picks a shrink/expand backend, from the device, the config and the measured table."""

from __future__ import annotations

import importlib
import warnings

import torch

from adapter_manager.kernels.config import BackendKind, KernelConfig, LoRAForm
from adapter_manager.kernels.protocol import KernelBackend

_EAGER_DEVICES = ("cpu", "cuda")
_TORCH_FORMS = (BackendKind.TORCH, BackendKind.CPU)


def _build(kind: BackendKind, config: KernelConfig, deterministic: bool = False) -> KernelBackend:
    if deterministic and kind not in (BackendKind.CPU, BackendKind.REFERENCE):
        raise ValueError(
            f"the deterministic mode applies the LoRA per token: the cpu backend's fused loops or the reference's; "
            f"backend {kind.value!r} has no batch-invariant form yet"
        )
    if kind is BackendKind.REFERENCE:
        from adapter_manager.kernels.reference import ReferenceBackend

        return ReferenceBackend()
    if kind is BackendKind.TORCH:
        from adapter_manager.kernels.dispatch_table import TorchDispatchTable
        from adapter_manager.kernels.torch_eager import TorchEagerBackend

        return TorchEagerBackend(TorchDispatchTable.load(config.dispatch_table), form=config.torch_form)
    if kind is BackendKind.CPU:
        from adapter_manager.kernels.cpu.backend import CpuFusedBackend
        from adapter_manager.kernels.dispatch_table import TorchDispatchTable

        table = TorchDispatchTable.load(config.dispatch_table)
        return CpuFusedBackend(
            table, form=config.torch_form, fused_max_tokens=config.fused_max_tokens, deterministic=deterministic
        )
    if kind is BackendKind.XLA:
        from adapter_manager.kernels.xla_laned import XlaLanedBackend

        return XlaLanedBackend()
    if kind is BackendKind.PALLAS:
        from adapter_manager.kernels.pallas.backend import PallasBackend
        from adapter_manager.kernels.pallas.block_sizes import BlockSizeTable

        return PallasBackend(BlockSizeTable.load(config.block_size_table), interpret=config.pallas_interpret)
    if kind is BackendKind.TRITON:
        from adapter_manager.kernels.dispatch_table import TorchDispatchTable
        from adapter_manager.kernels.triton.backend import TritonBackend
        from adapter_manager.kernels.triton.block_sizes import TritonBlockTable

        blocks = TritonBlockTable.load(config.triton_block_size_table)
        return TritonBackend(TorchDispatchTable.load(config.dispatch_table), blocks, config.bgmv_max_tokens)
    raise ValueError(f"no backend for {kind!r}")


def _deterministic(device_type: str, config: KernelConfig) -> KernelBackend:
    """The deterministic mode's backend: the cpu backend's per-token loops on a CPU with the library built, else
    the reference's per-token loops (CUDA, a CPU without the library); refused on XLA (docs/engine.md)."""
    if device_type not in _EAGER_DEVICES:
        raise ValueError(f"the deterministic mode runs on eager devices (cpu, cuda), got {device_type!r}")
    kind = config.backend
    if kind is BackendKind.AUTO:
        from adapter_manager.kernels.cpu import load

        kind = BackendKind.CPU if device_type == "cpu" and load() else BackendKind.REFERENCE
    if kind is BackendKind.CPU and device_type != "cpu":
        raise ValueError(f"backend 'cpu' runs on CPU tensors only, got device type {device_type!r}")
    return _build(kind, config, deterministic=True)


def triton_unavailable_reason() -> str | None:
    """Why the triton backend cannot run here (triton not importable), or None."""
    try:
        importlib.import_module("triton")
    except ImportError as err:  # the optional extra is not installed
        return f"triton cannot be imported ({err}); install the 'triton' extra"
    return None


def triton_interpreting() -> bool:
    """Whether Triton would decorate kernels for its interpreter now (``TRITON_INTERPRET=1``); needs triton. The
    backend's build also checks that triton was imported in the same mode."""
    from adapter_manager.kernels.triton.kernels import interpret_mode

    return interpret_mode()


def first_contact(backend: KernelBackend, device: torch.device | str, config: KernelConfig) -> KernelBackend:
    """``backend`` if its kernels compile and run right on ``device`` (one small fused step, checked against the
    fp32 loop reference), else the torch forms for the process, with one warning that says why: a Triton kernel the
    device's compiler refuses must not take the server down, nor serve wrong numbers. A cuda device this process
    cannot reach (no GPU: a selection only) is not tried."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        return backend
    from adapter_manager.kernels.meta import LoRAKernelMeta
    from adapter_manager.kernels.ops import apply_parts
    from adapter_manager.kernels.reference import ReferenceBackend

    try:
        gen = torch.Generator().manual_seed(0)
        rows, rank, features = 9, 8, 64  # one slot of rank 8 and the zero row
        x, a, bt = (torch.randn(n, features, generator=gen) for n in (2, rows, rows))
        slots, ranks = torch.zeros(2, dtype=torch.int32), {0: rank}
        outputs = []
        for candidate in (backend, ReferenceBackend()):
            meta = LoRAKernelMeta.make(candidate, 1, rank, 2, device, granule=rank)
            meta.prepare(slots, ranks)
            y = torch.zeros(2, features, device=device)
            apply_parts(y, x.to(device), a.to(device).unsqueeze(1), [bt.to(device)], meta)
            outputs.append(y.cpu())
        diff = (outputs[0] - outputs[1]).abs().max().item()
        if not diff <= 1e-3 * (1 + outputs[1].abs().max().item()):  # also a NaN
            raise RuntimeError(f"a fused step differs from the fp32 loop reference by {diff:.3g}")
    except Exception as err:  # noqa: BLE001 - a compile or launch failure on this device: keep the torch forms
        warnings.warn(
            f"{device}: the torch LoRA forms, not the {type(backend).__name__} kernels, which failed here: "
            f"{type(err).__name__}: {err}",
            RuntimeWarning,
            stacklevel=3,
        )
        return _build(BackendKind.TORCH, config)
    return backend


def select_backend(
    device: torch.device | str, config: KernelConfig | None = None, deterministic: bool = False
) -> KernelBackend:
    """Pick the backend once, outside the hot path: cpu -> cpu (the torch forms plus the C++ kernel; torch, with a
    warning, where the kernel cannot be built), cuda -> triton (torch, with one warning naming why, where triton cannot
    be imported), xla -> ``config.xla_backend``.

    A forced ``config.backend`` wins, except that eager-only backends (torch, cpu, reference, triton) refuse an XLA
    device, the cpu backend refuses anything but a CPU device (and a machine where its kernel cannot be built), the
    triton backend refuses a machine without triton and a CPU device unless Triton interprets (``TRITON_INTERPRET=1``
    before triton is first imported and when the backend is built: its kernels then run in numpy on CPU tensors), and
    the Pallas backend refuses anything
    but an XLA device; a forced ``torch_form`` needs the torch or cpu backend (FUSED: cpu). AUTO never picks triton
    on a CPU device. ``deterministic``: a backend whose LoRA is per token (:func:`_deterministic`: the cpu backend,
    else the reference; any other choice, and XLA, refused).
    """
    config = config or KernelConfig()
    device_type = torch.device(device).type
    if deterministic:
        return _deterministic(device_type, config)
    kind = config.backend
    if kind is BackendKind.AUTO:
        if device_type == "cpu" and config.torch_form in (LoRAForm.AUTO, LoRAForm.FUSED):
            from adapter_manager.kernels.cpu import load

            kind = BackendKind.CPU if load() else BackendKind.TORCH
        elif device_type == "cuda" and config.torch_form is LoRAForm.AUTO:
            reason = triton_unavailable_reason()
            if reason is not None:
                warnings.warn(f"cuda: the torch LoRA forms, not the Triton kernels: {reason}", stacklevel=2)
                return _build(BackendKind.TORCH, config)
            return first_contact(_build(BackendKind.TRITON, config), device, config)
        elif device_type in _EAGER_DEVICES:
            kind = BackendKind.TORCH
        elif device_type == "xla":
            kind = config.xla_backend
        else:
            raise ValueError(f"no kernel backend for device type {device_type!r}; expected cpu, cuda or xla")
    if kind in (*_TORCH_FORMS, BackendKind.REFERENCE, BackendKind.TRITON) and device_type == "xla":
        raise ValueError(f"backend {kind.value!r} is eager-only (host syncs per step); device is {device_type!r}")
    if kind is BackendKind.CPU:
        from adapter_manager.kernels.cpu import load, unavailable_reason

        if device_type != "cpu":
            raise ValueError(f"backend 'cpu' runs on CPU tensors only, got device type {device_type!r}")
        if not load():
            raise ValueError(f"backend 'cpu': its kernel cannot be built here ({unavailable_reason()})")
    if kind is BackendKind.TRITON:
        reason = triton_unavailable_reason()
        if reason is not None:
            raise ValueError(f"backend 'triton': {reason}")
        if device_type == "cpu" and not triton_interpreting():
            raise ValueError(
                "backend 'triton' runs on CUDA tensors; on a CPU device only in Triton's interpret mode "
                "(TRITON_INTERPRET=1, set before triton is first imported)"
            )
    if kind is BackendKind.PALLAS and device_type != "xla":
        raise ValueError(f"backend 'pallas' needs an xla device (torch_xla), got {device_type!r}")
    if config.torch_form is not LoRAForm.AUTO and kind not in _TORCH_FORMS:
        raise ValueError(
            f"torch_form={config.torch_form.value!r} applies to the torch and cpu backends only; got {kind.value!r}"
        )
    if config.torch_form is LoRAForm.FUSED and kind is not BackendKind.CPU:
        raise ValueError(f"torch_form='fused' needs the cpu backend (its C++ kernel); got {kind.value!r}")
    return _build(kind, config, deterministic)
