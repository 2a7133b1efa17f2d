"""What one step hands the model: the LoRA metadata sized for the engine, the KV blocks its chunks need, and the
flat token batch over the step's block tables."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from adapter_manager import AdapterManager
from adapter_manager.kernels import LoRAKernelMeta

from ..model.batch import ForwardBatch, SequenceChunk, StaticPadding
from .kv_space import KVSpace
from .request import Request
from .scheduler import ScheduledChunk


def step_meta(
    backend, manager: AdapterManager, max_batch: int, max_tokens: int, device: torch.device
) -> LoRAKernelMeta:
    """The engine's LoRA metadata for the manager's row pool: ``max_tokens`` per step, active buckets up to the most
    distinct adapters a step can have (one per sequence, and no more than the pool holds)."""
    most_active = min(max_batch, manager.num_slots)
    active_buckets = tuple(b for b in (1, 2, 4, 8, 16, 64, 256, 1024) if b < most_active) + (most_active,)
    return LoRAKernelMeta.make(
        backend,
        manager.num_slots,
        manager.max_rank,
        max_tokens,
        device,
        granule=manager.granule,
        active_buckets=active_buckets,
        vectors=manager.lora_vectors,
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
