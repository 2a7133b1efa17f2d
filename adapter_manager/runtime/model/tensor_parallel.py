"""Megatron tensor parallelism as one SPMD program: where each of the model's tensors is split over the mesh.

Column-parallel (q/k/v, gate/up: their fused weights hold each shard's rows together, :mod:`.hf_map`) split by
output rows; row-parallel (o, down) by input columns, so each device's partial output joins the LoRA's before the
layer's one all-reduce; the embedding and an untied lm_head by vocabulary rows; the KV caches by KV heads. Norms and
the RoPE table are whole on every device. The pool's rows are split by their sections (the lifecycle's slot pool).
"""

from __future__ import annotations

import torch
from torch import nn

from adapter_manager.spmd import place

from .llama import Llama


def shard_dim(name: str) -> int | None:
    """The dim along which parameter ``name`` of a :class:`Llama` is split over the mesh; None: whole on every
    device (the norms, a row-parallel layer's bias)."""
    column = ("wqkv.weight", "w13.weight", "wqkv.bias", "w13.bias")
    if name in ("tok_embeddings.weight", "output.weight") or name.endswith(column):
        return 0
    return 1 if name.endswith(("wo.weight", "w2.weight")) else None


def place_sharded(model: Llama, name: str, host: torch.Tensor, device: torch.device) -> None:
    """Make parameter ``name`` of ``model`` (built on the meta device) the host tensor ``host`` placed on the mesh:
    each device receives only its shard (:func:`spmd.place`: the host sends each shard once), a norm whole on each.
    A weight moved whole and then marked would sit whole on every device first. Unsharded: moved whole."""
    dim = shard_dim(name) if model.tensor_parallel.size > 1 else None
    placed = host.to(device) if dim is None else place(host, model.tensor_parallel.size, dim)
    module, attribute = name.rsplit(".", 1)
    setattr(model.get_submodule(module), attribute, nn.Parameter(placed, requires_grad=False))
