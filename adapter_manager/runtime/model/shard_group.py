"""One process's shard of an N-way tensor-parallel model run one process per shard (vLLM's multiprocess executor):
its rank, and the collectives its layers call over torch.distributed's default group (gloo on CPU, NCCL on CUDA).

A sharded model in this mode holds only its shard's features (its heads, its slice of the MLP width, its vocabulary
rows, its section of the adapter pool's rows) and joins the shards' partial results where Megatron's split needs it:
one all-reduce after each row-parallel layer (o, down: the LoRA's partial output already added) and after the
vocabulary-parallel embedding, one all-gather of the logits. Each collective is counted with its bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from adapter_manager.kernels import Stacks


class ShardGroup:
    """Rank ``rank`` of ``size`` shards; the process group must be initialised before a collective runs."""

    def __init__(self, size: int, rank: int, loads: object | None = None) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside 0..{size - 1}")
        self.size, self.rank = size, rank
        self.loads = loads
        """A second process group of the same shards, for the adapter rows a slot load sends while steps run."""
        self.collectives = 0
        """Collectives this process took part in."""
        self.collective_bytes = 0
        """Bytes of the tensors those collectives joined (one shard's operand each)."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the shards, in place; returns it."""
        dist.all_reduce(tensor)
        self._count(tensor)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """The shards' ``tensor`` side by side along the last dim, in rank order. Shape: [..., n] -> [..., size·n]."""
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous())
        self._count(tensor)
        return torch.cat(parts, dim=-1)

    def _count(self, tensor: torch.Tensor) -> None:
        self.collectives += 1
        self.collective_bytes += tensor.numel() * tensor.element_size()


class PoolSection(NamedTuple):
    """One tensor-parallel section of a module's pool rows (a process holding one shard reads only its own)."""

    rows: Stacks  # the module's sectioned rows: a [N, S, in_s], bt [N, S, out_s]
    section: int

    @property
    def a(self) -> torch.Tensor:  # Shape: [N, in_s]
        return self.rows.a[:, self.section]

    @property
    def bt(self) -> torch.Tensor:  # Shape: [N, out_s]
        return self.rows.bt[:, self.section]

    @property
    def vector(self) -> None:
        """No vector rows under tensor parallelism (DoRA and LoRA-bias adapters are refused there)."""
        return None
