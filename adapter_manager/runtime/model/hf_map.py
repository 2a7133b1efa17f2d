"""Where each tensor of a Hugging Face checkpoint of a served family goes in :class:`Llama` (fused q/k/v and gate/up
rows; over S tensor-parallel shards, each shard's rows), and which tensors such a checkpoint holds."""

from __future__ import annotations

import torch

from adapter_manager import PROJECTIONS, ModuleKey
from adapter_manager.base_model import FUSED_PROJECTIONS as FUSED
from adapter_manager.base_model import PROJECTION_PARENT
from adapter_manager.sharding import COLUMN_PARALLEL, ROW_PARALLEL

from .config import LlamaConfig
from .llama import Llama

_HF_PROJECTIONS = {(PROJECTION_PARENT[proj], proj) for proj in PROJECTIONS}
_PLAIN_NORMS = {"input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"}
_SANDWICH_NORMS = {
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "attention_post_norm",  # Gemma 2: the attention output's norm, not the MLP's input's
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "ffn_post_norm",
}


def _norms(config: LlamaConfig) -> dict[str, str]:
    return _SANDWICH_NORMS if config.sandwich_norms else _PLAIN_NORMS


def hf_target(model: Llama, name: str) -> tuple[torch.Tensor, slice | torch.Tensor | None]:
    """The parameter (and its rows for fused weights and biases) that HF tensor ``name`` loads into.

    Example: ``model.layers.1.self_attn.k_proj.weight`` -> (layers[1].attention.wqkv.weight, rows q..q+kv);
    over S shards the rows are an index (every shard's rows of the part: :func:`load_hf` copies into them). A fused
    Phi-3 tensor (``qkv_proj``) names its first part's parameter (:func:`load_hf` splits it).
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
    if len(parts) in (5, 6) and parts[:2] == ["model", "layers"] and parts[-1] in ("weight", "bias"):
        layer, parent, proj, kind = int(parts[2]) if parts[2].isdigit() else -1, parts[3], parts[-2], parts[-1]
        if 0 <= layer < len(model.layers):
            block, norms = model.layers[layer], _norms(model.config)
            if len(parts) == 5 and kind == "weight" and parent in norms:
                return getattr(block, norms[parent]).weight, None
            if len(parts) == 6 and kind == "weight" and parent == "self_attn" and proj in ("q_norm", "k_norm"):
                norm = getattr(block.attention, proj)
                if norm is not None:
                    return norm.weight, None
            if len(parts) == 6 and model.config.fused_projections and proj in FUSED:
                return hf_target(model, name.replace(proj, FUSED[proj][0]))
            if len(parts) == 6 and (parent, proj) in _HF_PROJECTIONS:
                linear, part = model.lora_target(ModuleKey(layer, proj))
                param = linear.weight if kind == "weight" else linear.bias
                if param is None:
                    raise KeyError(f"{name}: the config gives {proj} no bias")
                start, shards = sum(linear.out_features[:part]), linear.shards.local
                if kind == "bias" and linear.row_parallel:
                    return param, None
                if shards == 1 or linear.row_parallel:  # a row-parallel weight's shards are its column blocks
                    return param, slice(start, start + linear.out_features[part])
                width, total = linear.out_features[part] // shards, linear.out_total // shards
                rows = [torch.arange(width) + s * total + start // shards for s in range(shards)]
                return param, torch.cat(rows)  # shard s's rows of this part, shard-major
    raise KeyError(f"{name}: not a tensor of a {model.config.model_type} checkpoint with {len(model.layers)} layers")


def load_hf(model: Llama, name: str, tensor: torch.Tensor, into: torch.Tensor | None = None) -> None:
    """Copy HF tensor ``name`` into its place (:func:`hf_target`); over S shards a column-parallel projection's
    rows go to each shard's rows (its heads, KV heads replicated where KV < S; its MLP columns). ``into``: a tensor
    of the parameter's shape standing for it (the sharded SPMD load fills one on the host, then places it). A norm's
    weight gains the config's ``norm_offset`` (Gemma's 1 + w); a fused Phi-3 tensor loads as its parts."""
    proj, config = name.split(".")[-2], model.config
    if config.fused_projections and proj in FUSED:
        spec = config.to_spec()
        widths = [spec.projection_shape(part)[1] for part in FUSED[proj]]
        for part, piece in zip(FUSED[proj], tensor.split(widths), strict=True):
            load_hf(model, name.replace(proj, part), piece, into)
        return
    if config.norm_offset and name.endswith("norm.weight"):
        tensor = (tensor.float() + config.norm_offset).to(tensor.dtype)
    if model.shard_group is not None:
        tensor = _shard_of(model, name, tensor, model.shard_group.rank)
    param, rows = hf_target(model, name)
    param = param if into is None else into
    if not isinstance(rows, torch.Tensor):
        (param if rows is None else param[rows]).copy_(tensor)
        return
    spec, tp = config.to_spec(), model.tensor_parallel
    source = torch.cat([tp.out_index(spec, proj, shard) for shard in range(tp.size)])
    param[rows.to(param.device)] = tensor.index_select(0, source).to(param.device, param.dtype)


def _shard_of(model: Llama, name: str, tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """The part of HF tensor ``name`` that shard ``rank`` holds (one process per shard): a projection's output rows
    (column-parallel, with its bias) or input columns (row-parallel; its bias whole), the embedding's and lm_head's
    vocabulary rows; norms whole."""
    tp, spec, proj = model.tensor_parallel, model.config.to_spec(), name.split(".")[-2]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = model.tok_embeddings.weight.shape[0]
        return tensor[rank * rows : (rank + 1) * rows]
    if proj in COLUMN_PARALLEL:
        return tensor.index_select(0, tp.out_index(spec, proj, rank))
    if proj in ROW_PARALLEL and name.endswith(".weight"):
        return tensor.index_select(1, tp.in_index(spec, proj, rank))
    return tensor


def hf_tensor_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of an HF checkpoint of ``config``'s family (``LlamaForCausalLM``'s and the family's own: biases,
    q/k norms, sandwich norms, Phi-3's fused projections), in HF order."""
    hidden, spec = config.hidden_size, config.to_spec()
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}"
        norms = list(_norms(config))
        shapes[f"{prefix}.{norms[0]}.weight"] = (hidden,)
        projections: dict[str, tuple[int, int]] = {p: spec.projection_shape(p) for p in PROJECTIONS}
        if config.fused_projections:
            for fused, parts in FUSED.items():
                widths = [projections.pop(part)[1] for part in parts]
                projections[fused] = (hidden, sum(widths))
        for proj, (fan_in, fan_out) in projections.items():
            parent = PROJECTION_PARENT.get(proj, "self_attn" if proj == "qkv_proj" else "mlp")
            shapes[f"{prefix}.{parent}.{proj}.weight"] = (fan_out, fan_in)
            if proj in config.bias or FUSED.get(proj, ("",))[0] in config.bias:
                shapes[f"{prefix}.{parent}.{proj}.bias"] = (fan_out,)
        if config.qk_norm:
            shapes[f"{prefix}.self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[f"{prefix}.self_attn.k_norm.weight"] = (config.head_dim,)
        for norm in norms[1:]:
            shapes[f"{prefix}.{norm}.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes
