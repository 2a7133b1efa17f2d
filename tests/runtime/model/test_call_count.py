"""The cost structure of a decode step: its operator calls do not grow with the number of distinct adapters.

Counted with torch's profiler (every operator the step dispatches, LoRA and base alike), never timed.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from adapter_manager import AdapterRegistry, RegistryConfig, RowOptions, write_synthetic_adapter
from adapter_manager.kernels import BackendKind, KernelConfig, LoRAKernelMeta, WeightLayout, select_backend
from adapter_manager.runtime.model.batch import ForwardBatch, SequenceChunk
from adapter_manager.runtime.model.checkpoint import load_model
from adapter_manager.tiers.slot_pool import SlotPool, SlotPoolConfig
from tests.conftest import TINY_NAME

SLOTS, RANK, SEQUENCES = 16, 8, 16


@pytest.fixture(scope="module")
def sixteen(written, tmp_path_factory):
    """The tiny model with 16 synthetic adapters (ranks 4 and 8) in 16 slots."""
    model = load_model(written[None][0])
    model.setup_caches(max_batch=SEQUENCES, max_seq_len=16)
    spec = model.config.to_spec(TINY_NAME)
    registry = AdapterRegistry(spec, RegistryConfig(rows=RowOptions(max_rank=RANK)))
    pool = SlotPool(spec, SlotPoolConfig(max_slots=SLOTS, rows=RowOptions(max_rank=RANK), granule=RANK))
    root = tmp_path_factory.mktemp("sixteen")
    for slot in range(SLOTS):
        rank = 4 if slot % 2 else 8
        folder = write_synthetic_adapter(root / f"s{slot}", spec, r=rank, lora_alpha=2 * rank, seed=slot)
        registry.register(str(folder), adapter_id=f"s{slot}")
        pool.load(slot, registry.prepared(f"s{slot}"))
    model.attach_lora(pool.stacks)
    return model, {slot: 4 if slot % 2 else 8 for slot in range(SLOTS)}


def decode_step_ops(model, slot_rows, backend: BackendKind, distinct: int) -> tuple[int, int]:
    """(operator calls, LoRA kernel calls: lora_apply, or lora_blocked / lora_onednn on a packed weight) of one decode
    step of 16 sequences over ``distinct`` adapters, the batch ordered by adapter as the engine orders it; the lm_head's
    base-only lora_blocked call (a blocked weight) is not counted."""
    meta = LoRAKernelMeta.make(select_backend("cpu", KernelConfig(backend=backend)), SLOTS, RANK, 64, "cpu")
    slots = sorted(t % distinct for t in range(SEQUENCES))
    chunks = [SequenceChunk(row, 3, (5 + row,), slot) for row, slot in enumerate(slots)]
    batch = ForwardBatch.from_chunks(chunks, device="cpu", logits="last")
    assert batch.slot_indices is not None
    with torch.no_grad():
        meta.prepare(batch.slot_indices, slot_rows)
        model(batch, meta)  # once outside the profiler: caches and first-call paths warm
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(batch, meta)
    names = [event.name for event in prof.events()]
    kernels = ("adapter_manager::lora_apply", "adapter_manager::lora_onednn", "adapter_manager::lora_blocked")
    head = 1 if model.output.layout is WeightLayout.BLOCKED else 0
    return len(names), sum(names.count(name) for name in kernels) - head


def test_decode_step_calls_do_not_grow_with_distinct_adapters(sixteen):
    model, slot_rows = sixteen
    counts = {distinct: decode_step_ops(model, slot_rows, BackendKind.AUTO, distinct) for distinct in (1, 8, 16)}
    layers = len(model.layers)
    assert {applies for _, applies in counts.values()} == {4 * layers}, counts  # q/k/v, o, gate/up, down
    assert len({ops for ops, _ in counts.values()}) == 1, counts


def test_the_torch_forms_grow_with_distinct_adapters(sixteen):
    """The same count on the torch forms (one matmul per run, part and layer) grows: the test above can fail."""
    model, slot_rows = sixteen
    one, eight = (decode_step_ops(model, slot_rows, BackendKind.TORCH, d)[0] for d in (1, 8))
    assert eight > one + 7 * 7 * len(model.layers)  # at least one more call per part and layer per extra adapter
