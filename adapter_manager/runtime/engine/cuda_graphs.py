"""Captured decode steps: one CUDA graph of the model's static-shape decode step per token bucket (triton backend).

On a GPU the eager decode step is launch-bound: ~10 kernels per layer plus the LoRA launches, each paying the host's
launch latency. A CUDA graph replays the whole step as one launch. It needs static shapes and no host work inside the
step, which the XLA path already has: tokens padded up to a bucket (padding tokens: token 0 at position 0 in the
spare block, rank 0), ``logits_index`` padded to a fixed row count, and the static attention path (``spans=None``).

The eager step runner (:mod:`.step_runner`) holds one :class:`DecodeGraphs` of its model and metadata where
:func:`use_decode_graphs` keeps them; :meth:`DecodeGraphs.forward` replays every decode-only step (one token per
sequence, at most the largest bucket) prepared with that metadata from its bucket's graph, captured on first use (or
all at once by :meth:`DecodeGraphs.warm_up`), and runs other steps (prefill chunks, more tokens) eagerly. The model
knows nothing of graphs. Per replay:

  - the step's tokens, positions, block-table rows, block tables and logits rows are copied into the bucket's static
    inputs (the rest padding: the spare block);
  - the step's adapters: the caller prepared the metadata as for an eager step; the backend's inputs for it
    (:class:`kernels.DecodeCapture`: the triton backend's BGMV token table, each token's first pool row and rank) are
    copied into the bucket's static inputs, which the captured kernels read. The captured kernels' grid depends only
    on T, so one graph serves any number of distinct adapters: the active bucket of the XLA path is not a graph axis
    here;
  - the adapters' weights: a swap writes the pool rows in place (the same storage), and the graph reads the pool
    through the same pointers, so a graph stays valid across swaps.

A step with no adapter replays the same graph: every token has rank 0, so the LoRA launches add nothing.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from adapter_manager.kernels import DecodeCapture, LoRAKernelMeta, platform_for

from ..model.batch import ForwardBatch, SequenceChunk

log = logging.getLogger(__name__)


class DecodeGraphError(RuntimeError):
    """Captured decode steps cannot be trusted on this device: a capture that raised, or a replay that differs from
    the eager step."""


class _Model(Protocol):
    """What the graphs need of the model (:class:`runtime.model.llama.Llama`)."""

    layers: nn.ModuleList

    @property
    def device(self) -> torch.device: ...

    max_batch: int
    dense_tables: torch.Tensor | None

    @property
    def spare_block(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def max_seq_len(self) -> int: ...

    def __call__(self, batch: ForwardBatch, lora_meta: LoRAKernelMeta | None = None) -> torch.Tensor: ...


def can_capture(meta: LoRAKernelMeta) -> bool:
    """Whether ``meta``'s decode steps can be captured: a backend that says what a graph keeps static
    (:class:`kernels.DecodeCapture`: the triton backend) on a cuda device."""
    return platform_for(meta.device).captures_graphs and isinstance(meta.backend, DecodeCapture)


@dataclass(frozen=True)
class DecodeGraphConfig:
    """Which decode steps are captured."""

    token_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    """Ascending token counts T captured; a decode step of n tokens replays the smallest bucket >= n."""
    warmup_steps: int = 2
    """Eager runs of each bucket before its capture (Triton compiles, cuBLAS picks its kernels)."""
    cuda_graph: bool = True
    """False: no graph; a replay runs the bucket's static step eagerly from the same static buffers (any device:
    the check, on CPU in Triton's interpreter, of everything a replay does but the capture itself)."""

    def __post_init__(self) -> None:
        buckets = self.token_buckets
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"token_buckets must be distinct, ascending and >= 1, got {buckets}")
        if self.warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {self.warmup_steps}")

    @classmethod
    def up_to(cls, limit: int) -> DecodeGraphConfig:
        """The default buckets below ``limit``, and ``limit`` itself (e.g. 6 -> (1, 2, 4, 6))."""
        return cls(tuple(b for b in cls().token_buckets if b < limit) + (limit,))

    def bucket_for(self, num_tokens: int) -> int | None:
        """The smallest bucket holding ``num_tokens`` tokens; None when none does."""
        return next((b for b in self.token_buckets if b >= num_tokens), None)


@dataclass
class _Captured:
    """One bucket's graph and the static tensors it reads and writes."""

    graph: torch.cuda.CUDAGraph | None
    """None with ``cuda_graph=False``."""
    batch: ForwardBatch
    """Static inputs: tokens, positions, cache_rows [T], logits_index [N] and block_tables [max_batch + 1, MB] on the
    device."""
    inputs: torch.Tensor
    """The backend's static inputs of the step's adapters (:meth:`kernels.DecodeCapture.static_inputs`)."""
    logits: torch.Tensor | None
    """Shape: [N, vocab], the graph's output (overwritten by every replay); None without a graph."""


@dataclass
class DecodeGraphs:
    """The captured decode steps of one model and one metadata object (an engine's).

    Padding tokens write the caches' spare block through the static tables' last row (``spare_row``); a step's
    tables (at most ``max_batch`` rows of at most MB blocks: the dense tables' shape) are copied into the rest.
    """

    model: _Model
    meta: LoRAKernelMeta
    config: DecodeGraphConfig | None = None
    """None: :meth:`DecodeGraphConfig.up_to` the most decode tokens a step can have (min of the cache's rows, the
    metadata's max_tokens and the backend's capture_max_tokens)."""
    logits_rows: int = field(init=False)
    """N: the rows of every captured step's ``logits_index`` (the model's ``max_batch``)."""
    spare_row: int = field(init=False)
    """The static tables' row padding tokens write through (every entry the spare block)."""
    _captured: dict[int, _Captured] = field(init=False, default_factory=dict, repr=False)
    _pool: object = field(init=False, default=None, repr=False)
    _backend: DecodeCapture = field(init=False, repr=False)

    def __post_init__(self) -> None:
        backend = self.meta.backend
        if not isinstance(backend, DecodeCapture):
            raise ValueError(
                f"captured decode steps need the triton backend (a backend that says what a graph keeps static: "
                f"kernels.DecodeCapture); the metadata has {type(backend).__name__}"
            )
        self._backend = backend
        if self.model.max_batch == 0:
            raise ValueError("setup_caches(max_batch, max_seq_len) first")
        if self.config is None:
            limit = min(self.model.max_batch, self.meta.max_tokens, backend.capture_max_tokens)
            self.config = DecodeGraphConfig.up_to(limit)
        captures = platform_for(self.model.device).captures_graphs and platform_for(self.meta.device).captures_graphs
        if self.config.cuda_graph and not captures:
            raise ValueError(
                f"CUDA graphs need a cuda model and metadata, got {self.model.device} / {self.meta.device}"
            )
        largest = self.config.token_buckets[-1]
        if largest > min(backend.capture_max_tokens, self.meta.max_tokens):
            raise ValueError(
                f"token bucket {largest} exceeds the backend's capture_max_tokens={backend.capture_max_tokens} or the "
                f"metadata's max_tokens={self.meta.max_tokens}"
            )
        self.logits_rows = self.spare_row = self.model.max_batch

    @property
    def _config(self) -> DecodeGraphConfig:
        assert self.config is not None, "resolved in __post_init__"
        return self.config

    @property
    def captured(self) -> tuple[int, ...]:
        """The buckets captured so far."""
        return tuple(sorted(self._captured))

    def covers(self, batch: ForwardBatch, meta: LoRAKernelMeta | None) -> bool:
        """Whether this step replays a graph: a decode-only step (one token per sequence) of at most the largest
        bucket, prepared with this object's metadata (or no LoRA), no adapter with a vector row and no vocabulary
        LoRA attached (its eager groups are per step)."""
        if meta is not None and (meta is not self.meta or meta.bias_index is not None or meta.scale_index is not None):
            return False  # another metadata, or a vector epilogue (the graphs are captured without one): eager
        if meta is not None and self.model.vocab_lora:
            return False
        if batch.spans is None or any(span.count != 1 for span in batch.spans):
            return False
        rows = batch.num_tokens if batch.logits_index is None else batch.logits_index.shape[0]
        tables = batch.block_tables
        if tables is not None and (tables.shape[0] > self.logits_rows or tables.shape[1] > self._table_width):
            return False
        return self._config.bucket_for(batch.num_tokens) is not None and rows <= self.logits_rows

    def forward(self, batch: ForwardBatch, meta: LoRAKernelMeta | None) -> torch.Tensor:
        """The step's logits: replayed from its bucket's graph where :meth:`covers` it, else the model's eager
        forward. ``meta``: prepared for the step (None: no LoRA)."""
        return self.replay(batch, meta) if self.covers(batch, meta) else self.model(batch, meta)

    @property
    def _table_width(self) -> int:
        """MB: the blocks of the longest sequence (the caches' max_seq_len)."""
        return -(-self.model.max_seq_len // self.model.block_size)

    def replay(self, batch: ForwardBatch, meta: LoRAKernelMeta | None) -> torch.Tensor:
        """One decode step (``covers`` it) by replaying its bucket's graph, captured first if it is not yet.

        ``meta``: this object's metadata prepared for the step (None: no LoRA). Returns the logits of the step's
        ``logits_index`` rows (all its tokens when None): [rows, vocab], a new tensor.
        """
        num_tokens = batch.num_tokens
        bucket = self._config.bucket_for(num_tokens)
        assert bucket is not None and self.covers(batch, meta), "replay() a step covers() accepts"
        host = self._backend.static_inputs(bucket, torch.device("cpu"))  # no LoRA: padding throughout
        if meta is not None:
            host = self._backend.step_inputs(meta, bucket)  # before a capture re-prepares the metadata
        if bucket not in self._captured:
            self.capture(bucket)
        captured = self._captured[bucket]
        static = captured.batch
        static.tokens[:num_tokens].copy_(batch.tokens)
        static.tokens[num_tokens:].zero_()
        static.positions[:num_tokens].copy_(batch.positions)
        static.positions[num_tokens:].zero_()
        static.cache_rows[:num_tokens].copy_(batch.cache_rows)
        static.cache_rows[num_tokens:].fill_(self.spare_row)
        assert static.block_tables is not None
        tables = self.model.dense_tables if batch.block_tables is None else batch.block_tables
        assert tables is not None, "a batch without block tables needs the dense ones"
        static.block_tables.fill_(self.model.spare_block)
        static.block_tables[: tables.shape[0], : tables.shape[1]].copy_(tables)
        static.block_tables[self.spare_row].fill_(self.model.spare_block)
        assert static.logits_index is not None
        rows = num_tokens if batch.logits_index is None else batch.logits_index.shape[0]
        if batch.logits_index is None:
            static.logits_index[:rows].copy_(torch.arange(rows, device=static.logits_index.device))
        else:
            static.logits_index[:rows].copy_(batch.logits_index)
        static.logits_index[rows:].zero_()
        captured.inputs.copy_(host, non_blocking=True)
        if captured.graph is None:
            self._prepare_static(captured)
            return self._run_static(captured)[:rows]
        captured.graph.replay()
        assert captured.logits is not None
        return captured.logits[:rows].clone()

    def capture(self, bucket: int) -> None:
        """Warm up and capture the decode step of ``bucket`` tokens (all padding while capturing; with
        ``cuda_graph=False`` only its static buffers are made). Leaves the metadata prepared for that padding step."""
        if bucket not in self._config.token_buckets:
            raise ValueError(f"{bucket} is not one of the token buckets {self._config.token_buckets}")
        device = self.model.device

        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.long, device=device)

        spare = torch.full((bucket,), self.spare_row, dtype=torch.long, device=device)
        tables = torch.full(
            (self.logits_rows + 1, self._table_width), self.model.spare_block, dtype=torch.long, device=device
        )
        batch = ForwardBatch(zeros(bucket), zeros(bucket), spare, zeros(self.logits_rows), None, None, tables)
        captured = _Captured(None, batch, self._backend.static_inputs(bucket, device), None)
        if self._config.cuda_graph:
            self._prepare_static(captured)
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(self._config.warmup_steps):
                    self._run_static(captured)
            torch.cuda.current_stream(device).wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                captured.logits = self._run_static(captured)
            captured.graph = graph
        self._captured[bucket] = captured

    def _prepare_static(self, captured: _Captured) -> None:
        """The metadata as the graph holds it (host work, outside any capture): a step with an adapter, so the LoRA
        launches are recorded, whose kernels read the bucket's static inputs."""
        self.meta.prepare(torch.zeros(captured.batch.num_tokens, dtype=torch.int32), {0: 1})
        self._backend.bind_inputs(self.meta, captured.inputs)

    def _run_static(self, captured: _Captured) -> torch.Tensor:
        """The model on the bucket's static inputs (what a capture records)."""
        with torch.no_grad():
            return self.model(captured.batch, self.meta)

    def warm_up(self) -> None:
        """Capture every bucket, the largest first (the smaller graphs reuse its memory pool)."""
        for bucket in reversed(self._config.token_buckets):
            if bucket not in self._captured:
                self.capture(bucket)

    def check(self, rtol: float = 1e-3) -> None:
        """First contact with the device: capture every bucket, then replay one decode step (a token at position 0
        of dense row 0, no adapter) and compare it with the same step run eagerly. Call it before any sequence is
        cached (it writes that row's first position). Raises :class:`DecodeGraphError` saying why when a capture
        raises or the replay's logits differ by more than ``rtol · (1 + max |logit|)``."""
        try:
            self.warm_up()
            batch = ForwardBatch.from_chunks([SequenceChunk(0, 0, (1,), -1)], self.model.device)
            replayed = self.replay(batch, None).float()
            with torch.no_grad():
                eager = self.model(batch, None).float()  # the same step, eagerly
        except Exception as err:  # noqa: BLE001 - whatever the device refuses, the answer is: run eagerly
            raise DecodeGraphError(f"capturing the decode steps failed: {type(err).__name__}: {err}") from err
        diff, scale = (replayed - eager).abs().max().item(), eager.abs().max().item()
        if not diff <= rtol * (1 + scale):  # also a NaN
            raise DecodeGraphError(
                f"a replayed decode step differs from the eager one by {diff:.3g} (max |logit| {scale:.3g}, "
                f"allowed {rtol * (1 + scale):.3g})"
            )


def use_decode_graphs(
    model: _Model, meta: LoRAKernelMeta, config: DecodeGraphConfig | None = None
) -> DecodeGraphs | None:
    """``model``'s captured decode steps for ``meta`` where they hold up: made and :meth:`DecodeGraphs.check`-ed at
    once; on any failure None (decode runs eagerly for the process), with one warning that says why."""
    try:
        graphs = DecodeGraphs(model, meta, config)
        graphs.check()
    except Exception as err:  # noqa: BLE001 - refused, a capture raised or a replay differed: eager it is
        warnings.warn(f"CUDA graphs off, decode steps run eagerly: {err}", RuntimeWarning, stacklevel=2)
        return None
    log.info("decode steps replay CUDA graphs (buckets %s)", graphs.captured)
    return graphs
