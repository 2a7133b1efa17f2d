#!/usr/bin/env python3
"""A decode step over many distinct adapters of mixed ranks: 16 sequences, 16 adapters of ranks 8/16/32/64 (4 each).

The bench model (fp32, packed base weights) with a rank-packed pool of max rank 64 holding all 16; one decode step
of 16 sequences at context ``--context``, each on its own adapter (the batch ordered by adapter, as the engine orders
it), timed round-robin against the base step (no LoRA) and the same step on the torch forms, medians of
``--repeats``. Floor: the 16 adapters' weight bytes ÷ the base's weight bytes (shared/DESIGN.md, Floors); target
≤ 1.25× the floor. Also counts the step's operator calls (profiler events) for 1, 4 and 16 distinct adapters.
Writes out/bench_mixed.json.

  .venv/bin/python -m scripts.bench_mixed [--context 144] [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from adapter_manager import AdapterManager, AdapterManagerConfig, RowOptions
from adapter_manager.kernels import BackendKind, KernelConfig, LoRAKernelMeta, select_backend
from adapter_manager.runtime.model.batch import ForwardBatch, SequenceChunk
from adapter_manager.runtime.model.checkpoint import load_model
from adapter_manager.runtime.model.config import LlamaConfig
from scripts.harness import decode_floor, interleaved_ms, op_calls, write_adapters, write_checkpoint, write_json

RANKS = (8, 16, 32, 64) * 4
SEQS = len(RANKS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=144)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("out/bench_mixed.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig.bench()
    spec = config.to_spec("bench")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = load_model(write_checkpoint(root / "model", config), pack_weights=True)
        ids = [f"m{i}" for i in range(SEQS)]
        folders = write_adapters(root, spec, ids, RANKS)
        manager = AdapterManager(
            spec, AdapterManagerConfig(max_slots=8, rows=RowOptions(max_rank=64), prefetch_workers=0)
        )
        try:
            for adapter_id, folder in zip(ids, folders, strict=True):
                manager.register(str(folder), adapter_id=adapter_id)
            lease = manager.acquire(ids)  # all 16 resident (480 of the pool's 512 rows), pinned for the run
            model.setup_caches(SEQS, args.context + 2)
            model.attach_lora(manager.stacks)
            gen = torch.Generator().manual_seed(0)
            prompts = [torch.randint(0, config.vocab_size, (args.context,), generator=gen) for _ in range(SEQS)]
            prefill = [SequenceChunk(row, 0, tuple(p.tolist())) for row, p in enumerate(prompts)]
            with torch.inference_mode():
                model(ForwardBatch.from_chunks(prefill, device="cpu"))

            def step(distinct: int | None, kernel: KernelConfig):
                backend = select_backend("cpu", kernel)
                meta = LoRAKernelMeta.make(
                    backend, manager.num_slots, manager.max_rank, SEQS, "cpu", granule=manager.granule
                )
                slots = [-1] * SEQS if distinct is None else [lease.slots[ids[i % distinct]] for i in range(SEQS)]
                # ordered by adapter, as the engine orders a step; cache rows 0..15 in that order for every config,
                # so the attention plan (one view of the rows) is the same whatever the adapter mix
                chunks = [SequenceChunk(row, args.context, (1,), slot) for row, slot in enumerate(sorted(slots))]

                def run() -> torch.Tensor:
                    batch = ForwardBatch.from_chunks(chunks, device="cpu")
                    assert batch.slot_indices is not None
                    if distinct is not None:
                        meta.prepare(batch.slot_indices, lease.slot_rows)
                    with torch.inference_mode():
                        return model(batch, meta if distinct is not None else None)

                return run

            auto, torch_forms = KernelConfig(), KernelConfig(backend=BackendKind.TORCH)
            fns = {"base": step(None, auto), "mixed16": step(SEQS, auto), "mixed16_torch": step(SEQS, torch_forms)}
            ms = interleaved_ms(fns, args.repeats)
            calls = {f"{d}_adapters": op_calls(step(d, auto)) for d in (1, 4, SEQS)}
            calls_torch = {f"{d}_adapters": op_calls(step(d, torch_forms)) for d in (1, 4, SEQS)}
            manager.release(lease)
        finally:
            manager.close()
    floor = sum(decode_floor(config, rank, 1) for rank in RANKS)  # the 16 adapters' bytes / the base's
    cost = {name: ms[name] / ms["base"] - 1 for name in ("mixed16", "mixed16_torch")}
    result = {"ms": ms, "cost": cost, "floor": floor, "x_floor": cost["mixed16"] / floor, "op_calls": calls}
    result["op_calls_torch"] = calls_torch
    print(
        f"decode step, {SEQS} sequences, 16 adapters of ranks 8/16/32/64 (ms): "
        + json.dumps({k: round(v, 2) for k, v in ms.items()})
    )
    print(
        f"  cpu backend cost {100 * cost['mixed16']:+.1f} % = {cost['mixed16'] / floor:.2f}x its floor "
        f"{100 * floor:.1f} % (target <= 1.25x); torch forms in the same run {100 * cost['mixed16_torch']:+.1f} %"
    )
    print(f"  operator calls per step: cpu backend {calls}; torch forms {calls_torch}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
