"""A traced backend's step state (:class:`TracedMeta`): the compact active table and its lane owners."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from adapter_manager.kernels.active_table import compact_ids
from adapter_manager.kernels.meta import LoRAKernelMeta

_HOST = torch.device("cpu")


@dataclass
class TracedMeta(LoRAKernelMeta):
    """:class:`LoRAKernelMeta` of a traced backend (laned XLA, Pallas): the slots must be on the host; the compact
    table is built there and moved whole, so the graph depends only on (T, A)."""

    lane_owner: torch.Tensor | None = field(init=False, default=None)
    """Traced only. Shape: [A·R] int32 on ``device``: ``lane // R``, made once per active width."""
    _lane_owners: dict[int, torch.Tensor] = field(init=False, default_factory=dict, repr=False)

    def _fill(self, slot_indices: torch.Tensor, slot_rows: Mapping[int, int], slot_vectors: Mapping[int, str]) -> None:
        """The compact table built on the host, moved whole; the vector indices always (the graph has the epilogue
        whatever the step's adapters)."""
        if slot_indices.device != _HOST:
            raise ValueError(
                f"slot_indices must be a CPU tensor on a traced backend (the compact table is built on the host), "
                f"got one on {slot_indices.device}"
            )
        if slot_vectors and not self.vectors:
            raise ValueError(f"slot_vectors {dict(slot_vectors)} on traced metadata made without vectors")
        host = slot_indices.numpy()
        self._check_range(int(host.min()), int(host.max()))
        active, _, compact = compact_ids(host)
        adapters = self._adapters(tuple(active.tolist()), slot_rows)
        self._set_active(host.shape[0], adapters)
        self._build_table(compact, adapters)
        self.lane_owner = self._lane_owner(self.active_width)
        self._vector_indices(host.tolist(), slot_vectors, self.vectors, True)

    def _lane_owner(self, width: int) -> torch.Tensor:
        if width not in self._lane_owners:
            lanes = torch.arange(width * self.rank, dtype=torch.int32) // self.rank
            self._lane_owners[width] = lanes.to(self.device)
        return self._lane_owners[width]

    def on_shard(self, local: Callable[[torch.Tensor], torch.Tensor]) -> TracedMeta:
        """A copy of this step's metadata whose traced operands (:meth:`args`) are ``local(t)`` of this one's: what a
        backend called per shard under manual sharding reads (``kernels.sharded``)."""
        shard = copy.copy(self)
        shard.token_compact, shard.gather_rows, shard.lane_owner = (local(t) for t in self.args())
        return shard

    def args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The traced kernels' operands: ``(token_compact [T] int32, gather_rows [A·R] int64, lane_owner [A·R])``."""
        assert self.token_compact is not None and self.gather_rows is not None and self.lane_owner is not None
        return self.token_compact, self.gather_rows, self.lane_owner
