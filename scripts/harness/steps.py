"""One model's decode and prefill steps as closures: its KV cache prefilled, the adapters' leases pinned, and the LoRA
metadata of each backend built once, so that benchmarks time exactly the model's forward of a step."""

from __future__ import annotations

from collections.abc import Callable

import torch

from adapter_manager.kernels import KernelConfig, LoRAKernelMeta, select_backend
from adapter_manager.runtime.model.batch import ForwardBatch, SequenceChunk
from adapter_manager.runtime.model.llama import Llama
from adapter_manager.runtime.model.projection import LoRALinear
from scripts.harness.workload import EngineWorkload


def base_linears(model: Llama) -> list[LoRALinear]:
    """Every LoRALinear of ``model``, in module order (the step's order; lm_head last)."""
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


class StepSetup:
    """One model (packed or plain), its KV cache of ``seqs`` rows prefilled to ``context``, and the LoRA meta."""

    def __init__(self, work: EngineWorkload, model: Llama, seqs: int, context: int, max_tokens: int) -> None:
        self.work, self.model, self.manager = work, model, work.manager
        self.seqs, self.context, self.max_tokens = seqs, context, max_tokens
        model.setup_caches(seqs, context + max_tokens + 2)
        model.attach_lora(self.manager.stacks)  # "base" runs with no metadata: exactly the base model's path
        self.metas: dict[KernelConfig, LoRAKernelMeta] = {}
        self.leases = [self.manager.acquire(self.adapters(cfg)) for cfg in ("lora_1", "lora_8")]  # pinned for the run
        gen = torch.Generator().manual_seed(0)
        self.prompts = [torch.randint(0, model.config.vocab_size, (context,), generator=gen) for _ in range(seqs)]
        chunks = [SequenceChunk(row, 0, tuple(p.tolist())) for row, p in enumerate(self.prompts)]
        self.forward(chunks, None, None)

    def meta_for(self, kernel: KernelConfig) -> LoRAKernelMeta:
        """LoRA metadata of the backend ``kernel`` selects (default: the cpu backend, FUSED at decode)."""
        if kernel not in self.metas:
            manager = self.manager
            backend = select_backend(self.model.device, kernel)
            self.metas[kernel] = LoRAKernelMeta.make(
                backend,
                manager.num_slots,
                manager.max_rank,
                self.max_tokens,
                self.model.device,
                granule=manager.granule,
            )
        return self.metas[kernel]

    def adapters(self, config: str) -> list[str | None]:
        return self.work.mix(config, self.seqs)

    def forward(self, chunks: list[SequenceChunk], meta: LoRAKernelMeta | None, slot_rows) -> torch.Tensor:  # noqa: ANN001
        batch = ForwardBatch.from_chunks(chunks, device=self.model.device)
        if meta is not None:
            assert batch.slot_indices is not None
            meta.prepare(batch.slot_indices, slot_rows)
        with torch.inference_mode():
            return self.model(batch, meta)

    def step_fn(
        self, config: str, prefill: int | None, kernel: KernelConfig | None = None
    ) -> Callable[[], torch.Tensor]:
        """A closure running one decode step (prefill=None) or one prefill of ``prefill`` tokens for ``config``."""
        adapters = self.adapters(config)
        slots, slot_rows = [-1] * self.seqs, {}
        if config != "base":
            lease = self.leases[0] if config == "lora_1" else self.leases[1]
            slots = [-1 if a is None else lease.slots[a] for a in adapters]
            slot_rows = lease.slot_rows
        meta = None if config == "base" else self.meta_for(kernel or KernelConfig())
        if prefill is None:
            chunks = [SequenceChunk(row, self.context, (1,), slot) for row, slot in enumerate(slots)]
        else:
            per = prefill // self.seqs
            chunks = [
                SequenceChunk(row, 0, tuple(self.prompts[row][:per].tolist()) or (1,), slot)
                for row, slot in enumerate(slots)
            ]
        chunks.sort(key=lambda c: c.slot)  # as the engine orders a step
        return lambda: self.forward(chunks, meta, slot_rows)

    def close(self) -> None:
        for lease in self.leases:
            self.manager.release(lease)
