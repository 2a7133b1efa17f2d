"""Helpers that set up and drive `runtime.Llama` the way an engine would: the oracle's adapters in slots, ragged
prefill, then decode steps, mixed adapters.

``meta`` goes with ``slot_rows`` (each slot's rank, as a lease gives it); both None run the base model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from adapter_manager import AdapterRegistry, RegistryConfig, RowOptions
from adapter_manager.kernels import LoRAKernelMeta
from adapter_manager.runtime.model.batch import ForwardBatch, SequenceChunk
from adapter_manager.runtime.model.checkpoint import load_model
from adapter_manager.runtime.model.llama import Llama
from adapter_manager.tiers.slot_pool import SlotPool, SlotPoolConfig
from tests.conftest import TINY_NAME
from tests.runtime._oracle import ADAPTERS, MAX_RANK, ROWS, SLOTTED, slots_of


def slotted_model(
    written,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    pack_weights: bool | None = None,
    quantize: str | None = None,
) -> tuple[Llama, AdapterRegistry, SlotPool, dict[int, int]]:
    """The base model (caches for ROWS; ``quantize`` as load_model's) with every adapter registered and SLOTTED in
    slots 0..3, attached, all in ``dtype`` on ``device``; returns it with the registry, the pool and each slot's
    rank."""
    model = load_model(written[None][0], dtype=dtype, device=device, pack_weights=pack_weights, quantize=quantize)
    model.setup_caches(max_batch=len(ROWS), max_seq_len=32)
    spec = model.config.to_spec(TINY_NAME)
    registry = AdapterRegistry(spec, RegistryConfig(rows=RowOptions(max_rank=MAX_RANK), dtype=dtype))
    for name in ADAPTERS:
        registry.register(str(written[name][0]), adapter_id=name)
    pool = SlotPool(
        spec, SlotPoolConfig(max_slots=len(SLOTTED), rows=RowOptions(max_rank=MAX_RANK), dtype=dtype, device=device)
    )
    for slot, name in enumerate(SLOTTED):
        pool.load(slot, registry.prepared(name))
    model.attach_lora(pool.stacks)
    rows = {slot: registry.prepared(name).rows for slot, name in enumerate(SLOTTED)}
    return model, registry, pool, rows


def step(
    model: Llama,
    chunks: Sequence[SequenceChunk],
    meta: LoRAKernelMeta | None = None,
    logits: str = "last",
    static: bool = False,
    slot_rows: Mapping[int, int] | None = None,
    forward: Callable[[ForwardBatch, LoRAKernelMeta | None], torch.Tensor] | None = None,
    slot_vectors: Mapping[int, str] | None = None,
) -> torch.Tensor:
    """One forward over the chunks (``forward``, default the model's own; e.g. captured decode steps'); prepares
    ``meta`` from the chunks' slots first (``slot_vectors``: the slots whose adapter has a vector row)."""
    batch = ForwardBatch.from_chunks(chunks, device=model.device, logits=logits, static=static)  # type: ignore[arg-type]
    if meta is not None:
        assert batch.slot_indices is not None
        meta.prepare(batch.slot_indices, slot_rows or {}, slot_vectors)
    with torch.no_grad():
        return (forward or model)(batch, meta)


def prefill_logits(
    model: Llama,
    prompts: Sequence[Sequence[int]],
    slots: Sequence[int] | None = None,
    meta: LoRAKernelMeta | None = None,
    static: bool = False,
    slot_rows: Mapping[int, int] | None = None,
    slot_vectors: Mapping[int, str] | None = None,
) -> list[torch.Tensor]:
    """Every prompt prefilled in one step (row i = cache row i); returns each prompt's [len, vocab] logits."""
    slots = slots or [-1] * len(prompts)
    chunks = [SequenceChunk(row, 0, tuple(p), slot) for row, (p, slot) in enumerate(zip(prompts, slots, strict=True))]
    out = step(model, chunks, meta, logits="all", static=static, slot_rows=slot_rows, slot_vectors=slot_vectors)
    return list(out.split([len(p) for p in prompts]))


def greedy(
    model: Llama,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    slots: Sequence[int] | None = None,
    meta: LoRAKernelMeta | None = None,
    static: bool = False,
    slot_rows: Mapping[int, int] | None = None,
    slot_vectors: Mapping[int, str] | None = None,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decoding of every prompt together: one prefill step, then one decode step per new token.

    Returns the generated ids per prompt and, per decode step, the [rows, vocab] logits it produced.
    """
    slots = slots or [-1] * len(prompts)
    chunks = [SequenceChunk(row, 0, tuple(p), slot) for row, (p, slot) in enumerate(zip(prompts, slots, strict=True))]
    logits = step(model, chunks, meta, static=static, slot_rows=slot_rows, slot_vectors=slot_vectors)  # [rows, vocab]
    generated: list[list[int]] = [[] for _ in prompts]
    step_logits = [logits]
    for i in range(new_tokens):
        next_ids = logits.argmax(-1).tolist()
        for row, token in enumerate(next_ids):
            generated[row].append(token)
        if i == new_tokens - 1:
            break
        chunks = [
            SequenceChunk(row, len(p) + i, (next_ids[row],), slot)
            for row, (p, slot) in enumerate(zip(prompts, slots, strict=True))
        ]
        logits = step(model, chunks, meta, static=static, slot_rows=slot_rows, slot_vectors=slot_vectors)
        step_logits.append(logits)
    return generated, step_logits


def decode_replays_vs_eager(model: Llama, registry: AdapterRegistry, pool: SlotPool, meta, rows, graphs) -> list[float]:
    """Prefill ROWS through ``graphs`` (eager: not a decode step), then decode steps each run twice, eagerly (the
    model's forward) and through ``graphs``: step 1 swaps "spare" into the slot of "patterns" (the pool written in
    place), step 2 has no adapter at all. Returns each step's max |replayed - eager| logit (the eager run writes the
    step's keys, the replay rewrites the same ones)."""
    prompts, adapters = [p for p, _ in ROWS], [a for _, a in ROWS]
    slots = slots_of(adapters, SLOTTED)
    chunks = [SequenceChunk(row, 0, tuple(p), s) for row, (p, s) in enumerate(zip(prompts, slots, strict=True))]
    prefill = step(model, chunks, meta, slot_rows=rows, forward=graphs.forward)  # not a decode step: eager
    next_ids = prefill.argmax(-1).tolist()
    assert graphs.captured == (), "a prefill step is never replayed"
    swapped, diffs = SLOTTED.index("patterns"), []
    for i in range(3):
        if i == 1:
            pool.load(swapped, registry.prepared("spare"))
            rows = {**rows, swapped: registry.prepared("spare").rows}
        if i == 2:
            slots = [-1] * len(slots)
        chunks = [
            SequenceChunk(row, len(p) + i, (next_ids[row],), s)
            for row, (p, s) in enumerate(zip(prompts, slots, strict=True))
        ]
        eager = step(model, chunks, meta, slot_rows=rows)
        replayed = step(model, chunks, meta, slot_rows=rows, forward=graphs.forward)
        assert replayed.shape == eager.shape == (len(ROWS), model.config.vocab_size)
        diffs.append((replayed.float() - eager.float()).abs().max().item())
        next_ids = eager.argmax(-1).tolist()
    return diffs
