"""The shard plan: how the model's N tensor-parallel shards run, decided once (:func:`shard_plan`) and handed whole to
the model, its blocks and its linears.

- none (N = 1): every tensor whole in this process.
- SPMD (XLA): one program over N devices; each tensor holds the N shards side by side and the partitioner places
  them (:mod:`adapter_manager.spmd`); a linear's LoRA runs through its SPMD marks (``spmd.Shards``).
- processes (CPU): one process per shard; this process's tensors hold its shard alone and its layers sum or join
  theirs through :class:`.shard_group.ShardGroup` (``runtime.engine.shard_workers`` starts the others).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from adapter_manager import TensorParallel
from adapter_manager.kernels import platform_for
from adapter_manager.spmd import MODEL_AXIS, Shards, mark

from .shard_group import ShardGroup

ShardForm = Literal["none", "spmd", "processes"]


@dataclass(frozen=True)
class ShardPlan:
    """N-way tensor parallelism and the form its shards run in (see the module)."""

    tensor_parallel: TensorParallel = field(default_factory=TensorParallel)
    group: ShardGroup | None = None
    """One process per shard: this process's place (rank, size, collectives); None otherwise."""

    def __post_init__(self) -> None:
        if self.group is not None and self.group.size != self.tensor_parallel.size:
            raise ValueError(
                f"a shard group of {self.group.size} for tensor_parallel_size {self.tensor_parallel.size}: the sizes "
                "must agree"
            )

    @property
    def form(self) -> ShardForm:
        if self.group is not None:
            return "processes"
        return "spmd" if self.tensor_parallel.size > 1 else "none"

    @property
    def size(self) -> int:
        """N, the shards."""
        return self.tensor_parallel.size

    @property
    def local_shards(self) -> int:
        """The shards this process's tensors hold side by side: N in one SPMD program, else 1."""
        return self.size if self.form == "spmd" else 1

    @property
    def marks(self) -> Shards | None:
        """The SPMD marks a sharded linear's LoRA makes (``kernels.linear_lora.ShardHooks``); None off SPMD."""
        return Shards(self.size) if self.form == "spmd" else None

    def vocab_rows(self, vocab_size: int) -> int:
        """The embedding's (and an untied head's) rows this process holds: ``vocab / N`` with one process per shard
        (which must divide it), else all."""
        if self.form != "processes":
            return vocab_size
        if vocab_size % self.size:
            raise ValueError(f"tensor_parallel_size {self.size} must divide the vocabulary's {vocab_size} rows")
        return vocab_size // self.size

    def embed(self, table: torch.nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
        """The embedding lookup. Shape: tokens [T]; returns [T, H]. One process per shard: each holds ``vocab / N``
        rows, looks up the tokens it holds (zero for the others) and the shards' lookups are summed."""
        group = self.group
        if group is None:
            return table(tokens)
        rows = table.weight.shape[0]
        local = tokens - group.rank * rows
        held = (local >= 0) & (local < rows)
        h = table(torch.where(held, local, torch.zeros_like(local))) * held[:, None].to(table.weight.dtype)
        return group.all_reduce(h)

    def whole_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's output whole: one process per shard, each shard's vocabulary rows joined; one SPMD program,
        gathered inside the graph (the head's output marked split by vocabulary, as its weight is, then whole: the
        partitioner gathers ``[N, V]``, never the head's ``[V, H]`` weight); unsharded, itself."""
        if self.group is not None:
            return self.group.all_gather(logits)
        if self.form == "spmd":
            mark(logits, self.size, (None, MODEL_AXIS))
            logits = logits.clone()
            mark(logits, self.size, (None, None))
        return logits


def shard_plan(
    tensor_parallel: TensorParallel, device: torch.device | str, group: ShardGroup | None = None
) -> ShardPlan:
    """The one place the form is chosen: unsharded at N = 1; one SPMD program where the device's platform runs one
    (XLA); else one process per shard, which needs this process's ``group``."""
    if tensor_parallel.size == 1:
        return ShardPlan(tensor_parallel)
    if platform_for(device).spmd:
        return ShardPlan(tensor_parallel)
    if group is None:
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel.size} on {device} runs one process per shard: give this "
            "process's shard_group (runtime.engine.shard_workers starts the others)"
        )
    return ShardPlan(tensor_parallel, group)


def runs_processes(tensor_parallel_size: int, device: torch.device | str) -> bool:
    """Whether N shards on ``device`` run one process per shard (what a server launch starts workers for)."""
    return tensor_parallel_size > 1 and not platform_for(device).spmd
