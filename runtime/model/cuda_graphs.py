"""Captured decode steps: one CUDA graph of the model's static-shape forward per token bucket (the triton backend).

On a GPU the eager decode step is launch-bound: ~10 kernels per layer plus the LoRA launches, each paying the host's
launch latency. A CUDA graph replays the whole step as one launch. It needs static shapes and no host work inside the
step, which the XLA path already has: tokens padded up to a bucket (padding tokens in a spare KV cache row, slot -1),
``logits_index`` padded to ``max_batch`` rows, and the static attention path (``spans=None``).

What may change between replays, and how it reaches the graph:
  - the step's tokens, positions, cache rows and logits rows: copied into the bucket's static input tensors;
  - the step's adapters: ``meta.prepare`` runs on the host as for an eager step, and its BGMV token table (each
    token's first pool row and rank, :func:`kernels.triton_backend.token_table`) is copied into the bucket's static
    table, which the captured kernels read. BGMV's grid depends only on T, so the graph is the same whatever the
    number of distinct adapters: the active bucket of the XLA path is not a graph axis here;
  - the adapters' weights: a swap writes the pool rows in place (one copy into the same storage), and the graph reads
    the pool through the same pointers, so a graph stays valid across swaps.

A step with no adapter replays the same graph: every token has rank 0, so the LoRA launches add nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from kernels import LoRAKernelMeta
from kernels.triton_backend import TritonBackend, TritonStepTables, token_table

from .batch import ForwardBatch, StaticPadding
from .llama import Llama


@dataclass(frozen=True)
class DecodeGraphConfig:
    """Which decode steps are captured, and how they are padded."""

    token_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    """Ascending token counts T captured; a decode step of n tokens replays the smallest bucket >= n."""
    logits_rows: int = 64
    """N: rows of ``logits_index`` every captured step returns (the engine's ``max_batch``)."""
    spare_row: int = 64
    """The KV cache row padding tokens write (the engine's ``max_batch``: the cache has ``max_batch + 1`` rows)."""
    warmup_steps: int = 2
    """Eager runs of each bucket before its capture (Triton compiles, cuBLAS picks its kernels)."""

    def __post_init__(self) -> None:
        buckets = self.token_buckets
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"token_buckets must be distinct, ascending and >= 1, got {buckets}")
        if self.logits_rows < 1 or self.spare_row < 0 or self.warmup_steps < 1:
            raise ValueError(
                f"logits_rows ({self.logits_rows}) and warmup_steps ({self.warmup_steps}) must be >= 1, spare_row "
                f"({self.spare_row}) >= 0"
            )

    def padding(self, num_tokens: int) -> StaticPadding | None:
        """How to pad a decode step of ``num_tokens`` tokens: the smallest bucket holding it; None when none does."""
        bucket = next((b for b in self.token_buckets if b >= num_tokens), None)
        return None if bucket is None else StaticPadding(bucket, self.logits_rows, self.spare_row)


@dataclass
class _Captured:
    """One bucket's graph and the static tensors it reads and writes."""

    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch
    """Static inputs: tokens, positions, cache_rows [T] and logits_index [N] on the device."""
    tables: TritonStepTables
    """Static BGMV token table [2, T] int32 on the device."""
    logits: torch.Tensor
    """Shape: [N, vocab], the graph's output (overwritten by every replay)."""


@dataclass
class DecodeGraphs:
    """The captured decode steps of one model and one metadata object (an engine's): capture once per bucket, replay
    per step. Usage::

        graphs = DecodeGraphs(model, meta, DecodeGraphConfig(logits_rows=max_batch, spare_row=max_batch))
        padding = graphs.padding(num_tokens)              # None: not a capturable step, run it eagerly
        batch = ForwardBatch.from_chunks(chunks, device, padding=padding)
        logits = graphs.run(batch, slot_rows)             # [N, vocab]; valid until the bucket's next replay
    """

    model: Llama
    meta: LoRAKernelMeta
    config: DecodeGraphConfig = field(default_factory=DecodeGraphConfig)
    _captured: dict[int, _Captured] = field(init=False, default_factory=dict, repr=False)
    _pool: object = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        backend = self.meta.backend
        if not isinstance(backend, TritonBackend):
            raise ValueError(
                f"captured decode steps need the triton backend (its BGMV grid depends only on T); the metadata has "
                f"{type(backend).__name__}"
            )
        if self.model.device.type != "cuda" or self.meta.device.type != "cuda":
            raise ValueError(
                f"CUDA graphs need a cuda model and metadata, got {self.model.device} / {self.meta.device}"
            )
        largest = self.config.token_buckets[-1]
        if largest > min(backend.bgmv_max_tokens, self.meta.max_tokens):
            raise ValueError(
                f"token bucket {largest} exceeds bgmv_max_tokens={backend.bgmv_max_tokens} or the metadata's "
                f"max_tokens={self.meta.max_tokens}: a captured step must take the BGMV kernels"
            )
        cache = self.model.layers[0].attention.kv_cache
        if cache is None or self.config.spare_row >= cache.max_batch:
            raise ValueError(
                f"spare_row {self.config.spare_row} must be a row of the KV cache: setup_caches(max_batch + 1) first"
            )

    def padding(self, num_tokens: int) -> StaticPadding | None:
        """How to pad a decode step of ``num_tokens`` tokens for its graph; None when no bucket holds it."""
        return self.config.padding(num_tokens)

    def capture(self, bucket: int) -> None:
        """Warm up and capture the decode step of ``bucket`` tokens (all padding: the spare row, slot -1)."""
        if bucket not in self.config.token_buckets:
            raise ValueError(f"{bucket} is not one of the token buckets {self.config.token_buckets}")
        device, rows = self.model.device, self.config.logits_rows

        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.long, device=device)

        spare = torch.full((bucket,), self.config.spare_row, dtype=torch.long, device=device)
        host_slots = torch.zeros(bucket, dtype=torch.int32)
        batch = ForwardBatch(zeros(bucket), zeros(bucket), spare, zeros(rows), None, host_slots)
        tables = TritonStepTables(torch.zeros(2, bucket, dtype=torch.int32, device=device), None)
        self._prepare(batch.slot_indices, {0: 1}, tables)  # a FUSED step: the graph holds the LoRA launches
        tables.tokens.zero_()  # ...which add nothing while every token has rank 0
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(self.config.warmup_steps):
                self.model(batch, self.meta)
        torch.cuda.current_stream(device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool), torch.no_grad():
            logits = self.model(batch, self.meta)
        self._captured[bucket] = _Captured(graph, batch, tables, logits)

    def warm_up(self) -> None:
        """Capture every bucket, the largest first (later, smaller graphs reuse its memory pool)."""
        for bucket in reversed(self.config.token_buckets):
            if bucket not in self._captured:
                self.capture(bucket)

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._captured))

    def run(self, batch: ForwardBatch, slot_rows: Mapping[int, int]) -> torch.Tensor:
        """One decode step by replaying its bucket's graph (captured on first use).

        ``batch``: static (``spans`` None), padded to a bucket with :meth:`padding`; ``slot_rows``: the rank of every
        slot in it. Returns the graph's logits [N, vocab] (the bucket's static output: consume it before the next
        replay of the same bucket).
        """
        num_tokens = batch.num_tokens
        if batch.spans is not None or num_tokens not in self.config.token_buckets or batch.logits_index is None:
            raise ValueError(
                f"a captured step takes a static batch padded to a bucket {self.config.token_buckets} with "
                f"{self.config.logits_rows} logits rows; got {num_tokens} tokens, spans={batch.spans is not None}"
            )
        if batch.logits_index.shape[0] != self.config.logits_rows or batch.slot_indices is None:
            raise ValueError(f"logits_index must have {self.config.logits_rows} rows and the batch its slot_indices")
        if num_tokens not in self._captured:
            self.capture(num_tokens)
        captured = self._captured[num_tokens]
        static = captured.batch
        for mine, theirs in (
            (static.tokens, batch.tokens),
            (static.positions, batch.positions),
            (static.cache_rows, batch.cache_rows),
            (static.logits_index, batch.logits_index),
        ):
            mine.copy_(theirs, non_blocking=True)
        self._prepare(batch.slot_indices, slot_rows, captured.tables)
        captured.graph.replay()
        return captured.logits

    def _prepare(self, slot_indices: torch.Tensor, slot_rows: Mapping[int, int], tables: TritonStepTables) -> None:
        """The host part of a step: the metadata, and the BGMV token table copied into the static one."""
        self.meta.prepare(slot_indices, slot_rows)
        assert tables.tokens is not None
        if self.meta.runs is None:  # no adapter this step: every token rank 0
            tables.tokens.zero_()
        else:
            tables.tokens.copy_(token_table(self.meta), non_blocking=True)
        self.meta.step_tables = tables
