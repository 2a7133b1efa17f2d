"""Megatron tensor parallelism as one SPMD program: where each of the model's tensors is split over the mesh.

Column-parallel (q/k/v, gate/up: their fused weights hold each shard's rows together, :mod:`.hf_map`) split by
output rows; row-parallel (o, down) by input columns, so each device's partial output joins the LoRA's before the
layer's one all-reduce; the embedding and an untied lm_head by vocabulary rows; the KV caches by KV heads. Norms and
the RoPE table are whole on every device. The pool's rows are split by their sections (the lifecycle's slot pool).
"""

from __future__ import annotations

from adapter_manager.spmd import MODEL_AXIS, mark

from .llama import Llama


def mark_weights(model: Llama) -> None:
    """Shard every weight of ``model`` (on the XLA device, loaded) over its ``tensor_parallel.size`` devices."""
    size = model.tensor_parallel.size
    mark(model.tok_embeddings.weight, size, (MODEL_AXIS, None))
    for block in model.layers:
        for column in (block.attention.wqkv, block.feed_forward.w13):
            mark(column.weight, size, (MODEL_AXIS, None))
        for row in (block.attention.wo, block.feed_forward.w2):
            mark(row.weight, size, (None, MODEL_AXIS))
    if model.output is not None:
        mark(model.output.weight, size, (MODEL_AXIS, None))
