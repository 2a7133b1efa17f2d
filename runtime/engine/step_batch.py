"""What one step hands the model: the LoRA metadata sized for the engine, the KV blocks its chunks need, and the
flat token batch over the step's block tables. Also the KV pool's size in bytes."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

import torch

from kernels import LoRAKernelMeta

from ..model.batch import ForwardBatch, SequenceChunk, StaticPadding
from ..model.config import LlamaConfig
from .kv_space import KVSpace
from .request import Request
from .scheduler import ScheduledChunk


def block_bytes(config: LlamaConfig, dtype: torch.dtype, block_size: int) -> int:
    """Bytes of one KV block: ``block_size`` positions of every layer's K and V."""
    per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * dtype.itemsize
    return block_size * per_token


def device_free_bytes(device: torch.device) -> int | None:
    """Free memory of the device the caches live on (CPU: available RAM); None where it cannot be asked (XLA)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu" and hasattr(os, "sysconf"):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


def step_meta(backend, pool, max_batch: int, max_tokens: int, device: torch.device) -> LoRAKernelMeta:
    """The engine's LoRA metadata: ``max_tokens`` per step, active buckets up to the most distinct adapters a step
    can have (one per sequence, and no more than the pool holds)."""
    most_active = min(max_batch, pool.num_slots)
    active_buckets = tuple(b for b in (1, 2, 4, 8, 16, 64, 256, 1024) if b < most_active) + (most_active,)
    return LoRAKernelMeta.make(
        backend,
        pool.num_slots,
        pool.max_rank,
        max_tokens,
        device,
        granule=pool.granule,
        active_buckets=active_buckets,
    )


def place_chunks(
    chunks: Sequence[ScheduledChunk], kv: KVSpace, preempt: Callable[[Request], None]
) -> tuple[ScheduledChunk, ...]:
    """The step's chunks with their KV blocks allocated (after admission): an admitted request that found less of
    its prefix cached than planned computes a chunk that much earlier; one whose blocks no longer fit (an adapter's
    blocks were dropped in between) is preempted."""
    placed = []
    for chunk in chunks:
        request = chunk.request
        count = min(chunk.count, len(request.context) - request.prefilled) if request.in_prefill else 1
        if kv.grow(request, count):
            placed.append(ScheduledChunk(request, count))
        else:
            preempt(request)
    return tuple(placed)


def step_batch(
    chunks: Sequence[ScheduledChunk],
    slots: Mapping[str, int],
    tables: torch.Tensor,
    device: torch.device,
    padding: tuple[Sequence[int], int, int] | None = None,
) -> ForwardBatch:
    """The step's batch: chunk i is row i of ``tables``; ``slots``: the lease's slot per adapter. ``padding`` on a
    traced device: (token buckets, logits rows, the spare table row)."""
    sequences = []
    for row, chunk in enumerate(chunks):
        request = chunk.request
        if request.in_prefill:
            tokens = request.context[request.prefilled : request.prefilled + chunk.count]
            start = request.prefilled
        else:
            tokens, start = (request.output[-1],), request.position
        slot = slots[request.adapter_id] if request.adapter_id is not None else -1
        sequences.append(SequenceChunk(row, start, tuple(tokens), slot))
    static = None
    if padding is not None:
        buckets, logits, spare_row = padding
        count = sum(len(s.tokens) for s in sequences)
        static = StaticPadding(next(b for b in buckets if b >= count), logits, spare_row)
    return ForwardBatch.from_chunks(sequences, device=device, padding=static, block_tables=tables)


def xla_sync() -> None:
    """Cut the lazy graph of every live tensor on the XLA device and run it (a traced step's one sync)."""
    import torch_xla

    torch_xla.sync()
