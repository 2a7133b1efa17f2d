"""The shard plan: how the model's N tensor-parallel shards run, decided once (:func:`shard_plan`) and handed whole to
the model, its blocks and its linears (each linear's split: :meth:`ShardPlan.linear`).

- none (N = 1): every tensor whole in this process.
- SPMD (XLA): one program over N devices; each tensor holds the N shards side by side and the partitioner places
  them (:mod:`adapter_manager.spmd`): where each parameter is split over the mesh is :meth:`ShardPlan.place`'s
  (Megatron's split: column-parallel q/k/v and gate/up by output rows, row-parallel o and down by input columns,
  the embedding and an untied lm_head by vocabulary rows; norms whole on every device).
- processes (CPU): one process per shard; this process's tensors hold its shard alone and its layers sum or join
  theirs through :class:`ShardGroup` (``runtime.engine.shard_workers`` starts the others); its linears read their
  own section of the pool's rows (:meth:`ShardPlan.own_rows`).

What the lifecycle keeps beside it: :mod:`adapter_manager.sharding` (which features of each projection a shard
holds, the pool's sections included) and :mod:`adapter_manager.spmd` (torch_xla's mesh and marks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from adapter_manager import TensorParallel
from adapter_manager.kernels import LinearShards, ShardForm, Stacks, platform_for
from adapter_manager.spmd import MODEL_AXIS, Shards, mark
from adapter_manager.spmd import place as place_on_mesh


class ShardGroup:
    """One process's shard of a model run one process per shard (vLLM's multiprocess executor): rank ``rank`` of
    ``size``, and the collectives its layers call over torch.distributed's default group (gloo on CPU), which must
    be initialised before a collective runs.

    Such a model holds only its shard's features (its heads, its slice of the MLP width, its vocabulary rows, its
    section of the adapter pool's rows) and joins the shards' partial results where Megatron's split needs it: one
    all-reduce after each row-parallel layer (o, down: the LoRA's partial output already added) and after the
    vocabulary-parallel embedding, one all-gather of the logits. Each collective is counted with its bytes.
    """

    def __init__(self, size: int, rank: int) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside 0..{size - 1}")
        self.size, self.rank = size, rank
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
    """One tensor-parallel section of a module's pool rows: what a process holding one shard reads."""

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


@dataclass(frozen=True)
class ShardPlan:
    """N-way tensor parallelism and the form its shards run in (see the module)."""

    tensor_parallel: TensorParallel = field(default_factory=TensorParallel)
    """N, and whether the LoRA is fully sharded (``fully_sharded_loras``): the adapter pool's plan too."""
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

    def linear(self, row_parallel: bool = False) -> LinearShards:
        """How one of the model's linears is split (:class:`kernels.LinearShards`, made here only): its role
        (``row_parallel``: o, down), whether its LoRA is fully sharded (the plan's ``fully_sharded_loras``, N > 1),
        and the form's handle: the SPMD marks, or this process's group."""
        marks = Shards(self.size) if self.form == "spmd" else None
        full = self.tensor_parallel.fully_sharded_loras and self.size > 1
        return LinearShards(row_parallel, full, marks, self.group)

    def reads(self, pool: TensorParallel) -> bool:
        """Whether the rows of an adapter pool split as ``pool`` are what this plan's linears read: the same N and,
        over N > 1, the same LoRA split (``fully_sharded_loras``)."""
        mine = self.tensor_parallel
        return pool.size == mine.size and (mine.size == 1 or pool.fully_sharded_loras == mine.fully_sharded_loras)

    def own_rows(self, stacks: Stacks) -> Stacks:
        """The rows of one module this process's linear reads: with one process per shard, its own section of the
        pool's sectioned rows (``[N, S, in_s]`` -> ``[N, in_s]``); else, or rows that are one section already
        (``[N, in_s]``), ``stacks`` as they are."""
        group = self.group
        return stacks if group is None or stacks.a.dim() == 2 else PoolSection(stacks, group.rank)

    def vocab_rows(self, vocab_size: int) -> int:
        """The embedding's (and an untied head's) rows this process holds: ``vocab / N`` with one process per shard
        (which must divide it), else all."""
        if self.form != "processes":
            return vocab_size
        if vocab_size % self.size:
            raise ValueError(f"tensor_parallel_size {self.size} must divide the vocabulary's {vocab_size} rows")
        return vocab_size // self.size

    def place(self, name: str, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Parameter ``name`` of the model (a :class:`.llama.Llama` name) from its host tensor ``host`` onto
        ``device``: in one SPMD program split over the mesh along the dim Megatron splits it by, each device receiving
        only its shard (:func:`spmd.place`: the host sends each shard once; a weight moved whole and then marked
        would sit whole on every device first), a norm whole on each; otherwise moved whole."""
        dim = _mesh_dim(name) if self.form == "spmd" else None
        return host.to(device) if dim is None else place_on_mesh(host, self.size, dim)

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


def _mesh_dim(name: str) -> int | None:
    """The dim along which the model's parameter ``name`` is split over the mesh; None: whole on every device (the
    norms, a row-parallel layer's bias)."""
    column = ("wqkv.weight", "w13.weight", "wqkv.bias", "w13.bias")
    if name in ("tok_embeddings.weight", "output.weight") or name.endswith(column):
        return 0
    return 1 if name.endswith(("wo.weight", "w2.weight")) else None


def shard_form(tensor_parallel_size: int, device: torch.device | str) -> ShardForm:
    """The one place the form is chosen: unsharded at N = 1; one SPMD program where the device's platform runs one
    (XLA); else one process per shard (what a server launch starts workers for, and a model load needs a group for)."""
    if tensor_parallel_size == 1:
        return "none"
    return "spmd" if platform_for(device).spmd else "processes"


def shard_plan(
    tensor_parallel: TensorParallel, device: torch.device | str, group: ShardGroup | None = None
) -> ShardPlan:
    """The plan of :func:`shard_form`'s form; one process per shard needs this process's ``group``."""
    if shard_form(tensor_parallel.size, device) != "processes":
        return ShardPlan(tensor_parallel)
    if group is None:
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel.size} on {device} runs one process per shard: give this "
            "process's shard_group (runtime.engine.shard_workers starts the others)"
        )
    return ShardPlan(tensor_parallel, group)
