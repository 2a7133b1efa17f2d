"""The slot pool: preallocated device stacks `A_stack [S, R, in]` and `Bt_stack [S, R, out]` per LoRA-able module.

A slot `s` is one index of every stack. `SlotPool.load(s, prepared)` writes an adapter into slot `s` of every stack
in place and returns only once the copy has completed on the device; which slots hold which adapter, and when a slot
may be published to the kernels, is the allocator's business (`allocator.py`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from .base_model import BaseModelSpec, ModuleKey
from .errors import SlotLoadError
from .prepare import PreparedAdapter

_GIB = 1 << 30


def bytes_needed(spec: BaseModelSpec, max_slots: int, max_rank: int, dtype: torch.dtype) -> int:
    """Device bytes a pool of `max_slots` slots at `max_rank` takes: S * R * sum over modules of (in + out)."""
    return max_slots * spec.max_adapter_bytes(max_rank, dtype.itemsize)


def slots_for_budget(spec: BaseModelSpec, budget_bytes: int, max_rank: int, dtype: torch.dtype) -> int:
    """The most slots whose stacks fit in `budget_bytes`; ValueError if not even one does."""
    per_slot = bytes_needed(spec, 1, max_rank, dtype)
    if budget_bytes < per_slot:
        raise ValueError(
            f"memory_budget_bytes ({budget_bytes / _GIB:.3f} GiB) is smaller than one slot at max_rank {max_rank} "
            f"in {dtype} ({per_slot / _GIB:.3f} GiB)"
        )
    return budget_bytes // per_slot


@dataclass
class SlotPoolConfig:
    """Size, dtype and device of the slot stacks."""

    max_slots: int | Literal["auto"] = 8  # S; "auto": as many as fit in memory_budget_bytes
    max_rank: int = 64  # R: every slot holds adapters zero-padded to this rank
    dtype: torch.dtype = torch.float32  # serving dtype; prepared adapters must match it
    device: torch.device | str = "cpu"  # cpu, cuda[:i] or xla[:i]
    memory_budget_bytes: int | None = None  # with max_slots="auto": device bytes the stacks may take

    def __post_init__(self) -> None:
        if self.max_slots == "auto":
            if not isinstance(self.memory_budget_bytes, int) or self.memory_budget_bytes <= 0:
                raise ValueError(
                    f"max_slots='auto' needs a positive memory_budget_bytes, got {self.memory_budget_bytes!r}"
                )
        elif not isinstance(self.max_slots, int) or isinstance(self.max_slots, bool) or self.max_slots <= 0:
            raise ValueError(f"max_slots must be a positive int or 'auto', got {self.max_slots!r}")
        if not isinstance(self.max_rank, int) or self.max_rank <= 0:
            raise ValueError(f"max_rank must be a positive int, got {self.max_rank!r}")
        if not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point dtype, got {self.dtype}")
        self.device = torch.device(self.device)
        if self.device.type not in ("cpu", "cuda", "xla"):
            raise ValueError(f"device must be cpu, cuda or xla, got {self.device}")

    def resolve_slots(self, spec: BaseModelSpec) -> int:
        """S: `max_slots`, or for "auto" the most slots that fit in `memory_budget_bytes`."""
        if self.max_slots == "auto":
            assert self.memory_budget_bytes is not None
            return slots_for_budget(spec, self.memory_budget_bytes, self.max_rank, self.dtype)
        return self.max_slots


@dataclass(frozen=True)
class SlotStacks:
    """The two stacks of one module, as the kernels take them."""

    a: torch.Tensor  # Shape: [S, R, in]
    bt: torch.Tensor  # Shape: [S, R, out]


class SlotPool:
    """Every module's stacks on one device, allocated once (zero-filled), written slot by slot in place.

    `load` is safe to call from several threads for *different* slots (the allocator guarantees a slot has one
    writer); on XLA loads are serialised, as lazy-tensor tracing of one stack from two threads is not.
    """

    def __init__(self, spec: BaseModelSpec, config: SlotPoolConfig | None = None) -> None:
        self.spec = spec
        self.config = config or SlotPoolConfig()
        self.num_slots = self.config.resolve_slots(spec)
        self.max_rank = self.config.max_rank
        self.dtype = self.config.dtype
        self.device = torch.device(self.config.device)
        self._stacks: dict[ModuleKey, SlotStacks] = {}
        xla = self.device.type == "xla"
        for key in spec.module_keys():
            fan_in, fan_out = spec.projection_shape(key.proj)
            shape_a, shape_bt = (self.num_slots, self.max_rank, fan_in), (self.num_slots, self.max_rank, fan_out)
            if xla:  # zeros made on the host and moved whole: device data at once, no graph to compile
                a, bt = torch.zeros(shape_a, dtype=self.dtype), torch.zeros(shape_bt, dtype=self.dtype)
                self._stacks[key] = SlotStacks(a=a.to(self.device), bt=bt.to(self.device))
            else:
                self._stacks[key] = SlotStacks(
                    a=torch.zeros(shape_a, dtype=self.dtype, device=self.device),  # [S, R, in]
                    bt=torch.zeros(shape_bt, dtype=self.dtype, device=self.device),  # [S, R, out]
                )
        # Per slot, every module's (key, A view [R, in], Bt view [R, out]): made once, reused by every load (eager
        # devices only; on XLA a slot view would bake the slot number into the graph).
        self._views: list[list[tuple[ModuleKey, torch.Tensor, torch.Tensor]]] = []
        if self.device.type != "xla":
            self._views = [
                [(k, s.a[slot], s.bt[slot]) for k, s in self._stacks.items()] for slot in range(self.num_slots)
            ]
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._xla_lock = threading.Lock()
        # XLA: every module's (A, Bt) element range in one slot's flat host layout; the load graph slices the moved
        # buffer at these fixed offsets, so it is the same graph for every slot and every adapter.
        self._xla_layout: list[tuple[ModuleKey, int, int]] = []
        self._xla_numel = 0
        if xla:
            for key, stacks in self._stacks.items():
                a_numel, bt_numel = math.prod(stacks.a.shape[1:]), math.prod(stacks.bt.shape[1:])
                self._xla_layout.append((key, self._xla_numel, self._xla_numel + a_numel))
                self._xla_numel += a_numel + bt_numel
            with self._xla_lock:  # compile the load graph now (slot 0 is free and zero): no load compiles later
                self._copy_xla(0, torch.zeros(self._xla_numel, dtype=self.dtype))

    @property
    def device_lock(self) -> threading.Lock:
        """XLA: serialises lazy-tensor tracing and syncs on the device. A sync cuts the graph of *every* live tensor,
        so a step traced in one thread must not interleave with a slot load in another: the engine holds this lock
        while it traces and syncs a step; `load` holds it on XLA."""
        return self._xla_lock

    @property
    def stacks(self) -> Mapping[ModuleKey, SlotStacks]:
        """Every module's stacks, layer-major; the tensors never change identity, only their contents."""
        return self._stacks

    @property
    def nbytes(self) -> int:
        return bytes_needed(self.spec, self.num_slots, self.max_rank, self.dtype)

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one slot over every stack: the most one adapter can move host -> slot."""
        return bytes_needed(self.spec, 1, self.max_rank, self.dtype)

    def load(self, slot: int, prepared: PreparedAdapter) -> None:
        """Write `prepared` into slot `slot` of every stack in place; modules it does not target are zeroed.

        Semantics:
            for key in modules: A_stack[key][slot] = prepared.a[key] if targeted else 0   # [R, in]
                                Bt_stack[key][slot] = prepared.bt[key] if targeted else 0  # [R, out]
        Returns once the copy has completed on the device. Raises `SlotLoadError` (naming the adapter) on a bad
        rank, dtype, module or shape, before writing anything; if a copy itself fails the slot may be partly
        written and must not be published.
        """
        if not 0 <= slot < self.num_slots:
            raise SlotLoadError(prepared.adapter_id, f"slot {slot} is outside 0..{self.num_slots - 1}")
        if prepared.max_rank != self.max_rank or prepared.dtype != self.dtype:
            raise SlotLoadError(
                prepared.adapter_id,
                f"prepared at rank {prepared.max_rank} in {prepared.dtype}, the pool holds rank {self.max_rank} "
                f"in {self.dtype}",
            )
        unknown = sorted(set(prepared.modules) - set(self._stacks))
        if unknown:
            raise SlotLoadError(prepared.adapter_id, f"modules {unknown} are not in the base model")
        if self.device.type == "xla":
            with self._xla_lock:
                self._load_xla(slot, prepared)
            return
        copies, zeros = self._plan(slot, prepared)
        if self.device.type == "cuda":
            self._load_cuda(prepared, copies, zeros)
        else:
            if copies:
                torch._foreach_copy_([dst for dst, _ in copies], [src for _, src in copies])
            if zeros:
                torch._foreach_zero_(zeros)

    def _plan(self, slot: int, prepared: PreparedAdapter) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list]:
        """(slot view, host source) for each targeted stack, and the slot views to zero; every shape is checked
        before anything is written, so a refused adapter leaves the slot as it was."""
        copies, zeros = [], []
        modules = prepared.modules
        for key, dst_a, dst_bt in self._views[slot]:  # [R, in], [R, out]
            weights = modules.get(key)
            if weights is None:
                zeros += [dst_a, dst_bt]
                continue
            if weights.a.shape != dst_a.shape or weights.bt.shape != dst_bt.shape:
                _check_shape(prepared.adapter_id, key, "a", weights.a, dst_a)
                _check_shape(prepared.adapter_id, key, "bt", weights.bt, dst_bt)
            copies += [(dst_a, weights.a), (dst_bt, weights.bt)]
        return copies, zeros

    def _load_cuda(self, prepared: PreparedAdapter, copies: list, zeros: list[torch.Tensor]) -> None:
        # One host -> device copy of the adapter's flat (pinned) buffer into a staging buffer, then one fused
        # device -> device copy into the slot views, all on a side stream. The side stream first waits for work
        # already queued on the compute stream (a kernel still reading the slot's previous adapter); the host waits
        # on an event before the allocator publishes the slot, which also keeps the host buffer alive until read.
        assert self._stream is not None
        storage = prepared.storage
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            staged = storage.to(self.device, non_blocking=True)  # [N]
            sources = []
            for _, src in copies:
                offset = (src.data_ptr() - storage.data_ptr()) // storage.element_size()
                sources.append(staged.as_strided(src.shape, src.stride(), offset))
            if copies:
                torch._foreach_copy_([dst for dst, _ in copies], sources)
            if zeros:
                torch._foreach_zero_(zeros)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()

    def _load_xla(self, slot: int, prepared: PreparedAdapter) -> None:
        # One host buffer in the slot's flat layout (zeros where the adapter does not target a module), one transfer,
        # one graph whatever the slot and the adapter: the slot is a device index tensor, never a Python int.
        flat = torch.zeros(self._xla_numel, dtype=self.dtype)  # [sum over modules of R * (in + out)]
        for key, offset_a, offset_bt in self._xla_layout:
            weights = prepared.modules.get(key)
            if weights is None:
                continue
            stacks = self._stacks[key]
            _check_shape(prepared.adapter_id, key, "a", weights.a, stacks.a.shape[1:])
            _check_shape(prepared.adapter_id, key, "bt", weights.bt, stacks.bt.shape[1:])
            flat[offset_a:offset_bt].view_as(weights.a).copy_(weights.a)
            flat[offset_bt : offset_bt + weights.bt.numel()].view_as(weights.bt).copy_(weights.bt)
        self._copy_xla(slot, flat)

    def _copy_xla(self, slot: int, flat: torch.Tensor) -> None:
        index = torch.tensor([slot], dtype=torch.long).to(self.device)  # [1]
        source = flat.to(self.device)
        for key, offset_a, offset_bt in self._xla_layout:
            stacks = self._stacks[key]
            bt_end = offset_bt + math.prod(stacks.bt.shape[1:])
            a = source[offset_a:offset_bt].view(1, *stacks.a.shape[1:])  # [1, R, in]
            bt = source[offset_bt:bt_end].view(1, *stacks.bt.shape[1:])  # [1, R, out]
            stacks.a.index_copy_(0, index, a)  # [1, R, in] -> [S, R, in]
            stacks.bt.index_copy_(0, index, bt)  # [1, R, out] -> [S, R, out]
        _xla_sync()


def _check_shape(adapter_id: str, key: ModuleKey, name: str, src: torch.Tensor, dst: torch.Tensor | torch.Size):
    expected = dst if isinstance(dst, torch.Size) else dst.shape
    if src.shape != expected:
        raise SlotLoadError(
            adapter_id, f"{key.module_name} {name} has shape {list(src.shape)}, the slot expects {list(expected)}"
        )


def _xla_sync() -> None:
    """Cut the lazy graph and wait for the device to finish it (the slot is complete when this returns)."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch_xla.sync()
    xm.wait_device_ops()
