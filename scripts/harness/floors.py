"""The floors every LoRA cost is judged against (shared/DESIGN.md, Floors): one definition of each.

Prefill is compute-bound: LoRA FLOPs ÷ base FLOPs. Decode is memory-bound at small batches: the weight bytes of the
step's distinct active adapters ÷ the base weight bytes (the KV cache's bytes not counted).
"""

from __future__ import annotations

from adapter_manager import PROJECTIONS
from adapter_manager.runtime.model.config import LlamaConfig
from scripts.harness.workload import RANK


def projection_shapes(config: LlamaConfig) -> list[tuple[int, int]]:
    """(in, out) of one layer's seven projections, in PROJECTIONS order: what the LoRA floors count."""
    spec = config.to_spec("bench")
    return [spec.projection_shape(p) for p in PROJECTIONS]


def vocab_flops(config: LlamaConfig, rank: int, vocab: str | None, tokens: int = 8) -> tuple[int, int]:
    """(per token, per sampled row) multiply-adds of an adapter's vocabulary modules: "vocab" (embedding LoRA: the
    column of A is a gather, then r·H; the head's LoRA r·(H + V) per logits row), "tokens" (``tokens`` replaced
    embedding rows: nothing to multiply), None (neither)."""
    if vocab == "vocab":
        return rank * config.hidden_size, rank * (config.hidden_size + config.vocab_size)
    return 0, 0


def vocab_bytes(config: LlamaConfig, rank: int, vocab: str | None, tokens: int = 8) -> int:
    """Elements an adapter's vocabulary modules must read in a decode step: "vocab" the token's column of the
    embedding A (r), its Bt (r·H) and the head's A and Bt (r·(H + V)); "tokens" the replaced rows (tokens·H)."""
    if vocab == "vocab":
        return rank + rank * config.hidden_size + rank * (config.hidden_size + config.vocab_size)
    return tokens * config.hidden_size if vocab == "tokens" else 0


def prefill_floor(
    config: LlamaConfig, rank: int, prompt: int, vectors: bool = False, vocab: str | None = None
) -> float:
    """LoRA FLOPs / base FLOPs of prefilling one ``prompt``-token sequence (every adapter the same rank: the fraction
    does not depend on how many are distinct). The base does, per token, the seven projections of every layer and
    causal attention's QKᵀ and PV (on average ``heads · head_dim · (prompt + 1)`` multiply-adds a layer), and the
    lm_head once for the sequence (the engine computes logits for the sampled row only). ``vectors``: the adapters'
    variant adds a vector epilogue (DoRA, LoRA bias): one multiply-add per output feature of every projection;
    ``vocab``: the vocabulary modules' (:func:`vocab_flops`)."""
    shapes = projection_shapes(config)
    linears = config.num_layers * sum(i * o for i, o in shapes)
    attention = config.num_layers * config.num_heads * config.head_dim * (prompt + 1)
    lm_head = config.hidden_size * config.vocab_size
    lora = config.num_layers * sum(rank * (i + o) + (o if vectors else 0) for i, o in shapes)
    per_token, per_row = vocab_flops(config, rank, vocab)
    return (prompt * (lora + per_token) + per_row) / (prompt * (linears + attention) + lm_head)


def adapter_bytes(config: LlamaConfig, adapters: int, element: int, rank: int = RANK, vectors: bool = False) -> int:
    """The LoRA weight bytes of ``adapters`` rank-``rank`` adapters on every projection, ``element`` bytes a value;
    ``vectors``: with each adapter's vector row (one value per output feature of every projection)."""
    shapes = projection_shapes(config)
    per_layer = rank * sum(i + o for i, o in shapes) + (sum(o for _, o in shapes) if vectors else 0)
    return adapters * per_layer * config.num_layers * element


def decode_floor(
    config: LlamaConfig, rank: int, adapters: int, vectors: bool = False, vocab: str | None = None
) -> float:
    """``adapters`` distinct rank-``rank`` adapters' LoRA weight bytes (``vectors``: and their vector rows; ``vocab``:
    and what their vocabulary modules must read, :func:`vocab_bytes`) / the base weight bytes a decode step reads
    (every projection and the lm_head; the KV cache's bytes are not counted: DESIGN.md's Floors)."""
    base = config.num_layers * sum(i * o for i, o in projection_shapes(config)) + config.hidden_size * config.vocab_size
    return (adapter_bytes(config, adapters, 1, rank, vectors) + adapters * vocab_bytes(config, rank, vocab)) / base
