"""The step runner: how a scheduled step reaches the device, in the device's mode, so the engine only schedules.

:func:`make_runner` picks the mode once, from the backend the seam chose:

- :class:`EagerRunner` (cpu, cuda): no padding; the logits stay on the device; on cuda with a backend whose decode
  steps a graph may capture (the triton backend), decode steps replay CUDA graphs, checked against the eager step
  at once (any failure keeps them eager for the process, with one warning). With one process per tensor-parallel
  shard it first sends the other shards the step (:class:`shard_workers.ShardChannel`).
- :class:`TracedRunner` (XLA): every step has a static shape. Tokens pad up to a token bucket through a spare table
  row (row ``max_batch``, naming only the spare block, which no sequence owns), logits rows to ``max_batch`` (to the
  bucket in an echo step: prompt_logprobs); one sync runs a step's graph and brings its logits to the host; the
  device lock keeps slot loads (prefetch threads) out of a step's trace and sync; :meth:`warm_up` compiles every
  graph a step can reach once.

Each owns the step's LoRA metadata (:class:`kernels.LoRAKernelMeta`), prepared once per step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager

import torch

from adapter_manager import AdapterManager
from adapter_manager.kernels import KernelBackend, LoRAKernelMeta, platform_for

from ..model.batch import ForwardBatch
from ..model.llama import Llama
from .config import EngineConfig
from .cuda_graphs import can_capture, use_decode_graphs
from .scheduler import ScheduledChunk
from .shard_workers import ShardChannel
from .step_batch import step_batch, step_meta
from .warm_up import echo_logits_rows, warm_up_batches


class EagerRunner:
    """Eager devices (cpu, cuda): steps run op by op at their own size."""

    token_buckets: tuple[int, ...] = ()
    """The token buckets steps are padded to: none."""

    def __init__(
        self, model: Llama, meta: LoRAKernelMeta, config: EngineConfig, shards: ShardChannel | None = None
    ) -> None:
        self.model, self.meta, self.config = model, meta, config
        self.device_lock: AbstractContextManager = contextlib.nullcontext()
        self.shards = shards
        """One process per tensor-parallel shard: the other shards' messages, sent before each forward."""
        captures = config.cuda_graphs and shards is None and can_capture(meta)
        self.graphs = use_decode_graphs(model, meta) if captures else None
        """The captured decode steps (cuda, triton backend), where their first contact held up; None: eager."""

    @property
    def decode_mode(self) -> str:
        """How decode steps run: ``"cuda_graphs"`` (replayed) or ``"eager"``."""
        return "eager" if self.graphs is None else "cuda_graphs"

    def table_shape(self, width: int) -> tuple[int | None, int | None]:
        """The step's block tables' (rows, width): the step's own (no padding)."""
        return None, None

    def batch(
        self, chunks: Sequence[ScheduledChunk], slots: Mapping[str, int], tables: torch.Tensor
    ) -> tuple[ForwardBatch, torch.device, int | None]:
        """The step's batch, where its logits are sampled, and the logits rows to pad to (None: no padding)."""
        return step_batch(chunks, slots, tables, self.model.device), self.model.device, None

    def run(
        self, batch: ForwardBatch, slot_rows: Mapping[int, int], slot_vectors: Mapping[int, str] | None = None
    ) -> torch.Tensor:
        """One forward (a decode step the CUDA graphs cover replays its graph); returns its logits [N, vocab].
        ``slot_rows``: the rank (pool rows) of every slot in the batch; ``slot_vectors``: how each slot's vector row
        applies, for those that have one (:meth:`LoRAKernelMeta.prepare`)."""
        assert batch.slot_indices is not None
        if self.shards is not None:
            self.shards.send(batch, slot_rows)
        self.meta.prepare(batch.slot_indices, slot_rows, slot_vectors)
        with torch.inference_mode():
            return self.model(batch, self.meta) if self.graphs is None else self.graphs.forward(batch, self.meta)

    def warm_up(self, tables: torch.Tensor) -> int:
        """Nothing to compile ahead on an eager device: 0 graphs."""
        return 0


class TracedRunner:
    """Traced devices (XLA): static shapes, one sync per step, every graph compiled by :meth:`warm_up`."""

    def __init__(
        self, model: Llama, meta: LoRAKernelMeta, config: EngineConfig, device_lock: AbstractContextManager
    ) -> None:
        self.model, self.meta, self.config = model, meta, config
        self.token_buckets = config.buckets()
        self.device_lock = device_lock
        self._padding_row = config.max_batch
        self._platform = platform_for(model.device)
        with device_lock:
            self._platform.sync()  # the weights, caches and RoPE table become device data: each step one graph

    decode_mode = "eager"
    """Decode steps run as traced graphs (no CUDA graphs)."""

    def table_shape(self, width: int) -> tuple[int | None, int | None]:
        """The step's block tables' (rows, width): every sequence row and the spare row, each ``width`` wide."""
        return self.config.max_batch + 1, width

    def batch(
        self, chunks: Sequence[ScheduledChunk], slots: Mapping[str, int], tables: torch.Tensor
    ) -> tuple[ForwardBatch, torch.device, int | None]:
        """The step's batch padded to its token bucket; its logits come back to the host, padded to
        :func:`echo_logits_rows` rows."""
        padding = (self.token_buckets, self.config.max_batch, self._padding_row)
        batch = step_batch(chunks, slots, tables, self.model.device, padding)
        return batch, torch.device("cpu"), echo_logits_rows(batch.num_tokens, self.config.max_batch)

    def run(
        self, batch: ForwardBatch, slot_rows: Mapping[int, int], slot_vectors: Mapping[int, str] | None = None
    ) -> torch.Tensor:
        """One forward and the sync that runs its graph; returns its logits [N, vocab] on the host."""
        assert batch.slot_indices is not None
        with self.device_lock:
            self.meta.prepare(batch.slot_indices, slot_rows, slot_vectors)
            with torch.no_grad():  # XLA refuses inference mode
                logits = self.model(batch, self.meta)
            self._platform.sync()  # one graph: the step's KV cache writes and its logits
            return logits.cpu()

    def warm_up(self, tables: torch.Tensor) -> int:
        """Compile the step graph of every (token bucket, active-adapter bucket, logits rows) once, each step padding
        only through ``tables`` (the engine's static tables, all the spare block); returns the graphs run."""
        runs = 0
        shapes = (self.token_buckets, self.meta.active_buckets, self.config.max_batch, self._padding_row)
        for batch, active in warm_up_batches(*shapes, tables, self.model.device):
            self.run(batch, dict.fromkeys(range(active), 1))
            runs += 1
        return runs


StepRunner = EagerRunner | TracedRunner


def make_runner(model: Llama, backend: KernelBackend, manager: AdapterManager, config: EngineConfig) -> StepRunner:
    """The runner of ``backend``'s device mode, with the step metadata sized for it (a traced step's tokens are at
    most the largest bucket; an eager step's the scheduler's token budget). Call after ``model.attach_lora``."""
    max_batch, device = config.max_batch, model.device
    if platform_for(device).static_shapes:
        meta = step_meta(backend, manager, max_batch, config.buckets()[-1], device)
        return TracedRunner(model, meta, config, manager.device_lock)
    meta = step_meta(backend, manager, max_batch, config.scheduler.token_budget, device)
    shards = ShardChannel(model, meta, manager, config) if model.shard_group is not None else None
    return EagerRunner(model, meta, config, shards)
