"""Where each tensor of a Hugging Face Llama checkpoint goes in :class:`Llama` (fused q/k/v and gate/up rows; over S
tensor-parallel shards, each shard's rows)."""

from __future__ import annotations

import torch

from adapter_manager import PROJECTIONS, ModuleKey
from adapter_manager.base_model import PROJECTION_PARENT
from adapter_manager.sharding import COLUMN_PARALLEL, ROW_PARALLEL

from .llama import Llama

_HF_PROJECTIONS = {(PROJECTION_PARENT[proj], proj) for proj in PROJECTIONS}


def hf_target(model: Llama, name: str) -> tuple[torch.Tensor, slice | torch.Tensor | None]:
    """The parameter (and its rows for fused weights) that HF tensor ``name`` loads into.

    Example: ``model.layers.1.self_attn.k_proj.weight`` -> (layers[1].attention.wqkv.weight, rows q..q+kv);
    over S shards the rows are an index (every shard's rows of the part: :func:`load_hf` copies into them).
    Raises KeyError for a name this model has no place for.
    """
    parts = name.split(".")
    if model.packed:
        raise ValueError(f"{name}: the model's weights are packed; unpack_weights() before loading into it")
    if name == "model.embed_tokens.weight":
        return model.tok_embeddings.weight, None
    if name == "model.norm.weight":
        return model.norm.weight, None
    if name == "lm_head.weight":
        if model.output is None:
            raise KeyError(f"{name}: the config ties word embeddings, the model has no separate lm_head")
        return model.output.weight, None
    if len(parts) in (5, 6) and parts[:2] == ["model", "layers"] and parts[-1] == "weight" and parts[2].isdigit():
        layer, parent, proj = int(parts[2]), parts[3], parts[-2]
        if layer < len(model.layers):
            block = model.layers[layer]
            if len(parts) == 5 and parent == "input_layernorm":
                return block.attention_norm.weight, None
            if len(parts) == 5 and parent == "post_attention_layernorm":
                return block.ffn_norm.weight, None
            if len(parts) == 6 and (parent, proj) in _HF_PROJECTIONS:
                linear, part = model.lora_target(ModuleKey(layer, proj))
                start, shards = sum(linear.out_features[:part]), linear.shards
                if shards == 1 or linear.row_parallel:  # a row-parallel weight's shards are its column blocks
                    return linear.weight, slice(start, start + linear.out_features[part])
                width, total = linear.out_features[part] // shards, linear.out_total // shards
                rows = [torch.arange(width) + s * total + start // shards for s in range(shards)]
                return linear.weight, torch.cat(rows)  # shard s's rows of this part, shard-major
    raise KeyError(f"{name}: not a tensor of a Llama checkpoint with {len(model.layers)} layers")


def load_hf(model: Llama, name: str, tensor: torch.Tensor, into: torch.Tensor | None = None) -> None:
    """Copy HF tensor ``name`` into its place (:func:`hf_target`); over S shards a column-parallel projection's
    rows go to each shard's rows (its heads, KV heads replicated where KV < S; its MLP columns). ``into``: a tensor
    of the parameter's shape standing for it (the sharded SPMD load fills one on the host, then places it)."""
    if model.shard_group is not None:
        tensor = _shard_of(model, name, tensor, model.shard_group.rank)
    param, rows = hf_target(model, name)
    param = param if into is None else into
    if not isinstance(rows, torch.Tensor):
        (param if rows is None else param[rows]).copy_(tensor)
        return
    proj, spec, tp = name.split(".")[-2], model.config.to_spec(), model.tensor_parallel
    source = torch.cat([tp.out_index(spec, proj, shard) for shard in range(tp.size)])
    param[rows.to(param.device)] = tensor.index_select(0, source).to(param.device, param.dtype)


def _shard_of(model: Llama, name: str, tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """The part of HF tensor ``name`` that shard ``rank`` holds (one process per shard): a projection's output rows
    (column-parallel) or input columns (row-parallel), the embedding's and lm_head's vocabulary rows; norms whole."""
    tp, spec, proj = model.tensor_parallel, model.config.to_spec(), name.split(".")[-2]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = model.tok_embeddings.weight.shape[0]
        return tensor[rank * rows : (rank + 1) * rows]
    if proj in COLUMN_PARALLEL:
        return tensor.index_select(0, tp.out_index(spec, proj, rank))
    if proj in ROW_PARALLEL:
        return tensor.index_select(1, tp.in_index(spec, proj, rank))
    return tensor
