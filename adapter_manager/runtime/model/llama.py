"""The batched Llama: RMSNorm, RoPE (Llama 3 scaling), GQA attention over a KV cache, SwiGLU, LoRA linears; with the
served families' terms (:mod:`.families`: the blocks' own, the embedding's scale and the logits' soft-cap here).

One forward is one engine step over a flat, ragged token batch (:class:`ForwardBatch`): prefill chunks and decode
tokens of many sequences together, each with its own KV cache row and its own adapter slot. Build it on the ``meta``
device and load weights into it (:func:`runtime.model.checkpoint.load_checkpoint`), then size the caches with
:meth:`Llama.setup_caches` (gpt-fast).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import nn

from adapter_manager import ModuleKey, TensorParallel
from adapter_manager.kernels import (
    LayerKernels,
    LinearStep,
    LinearWeight,
    LoRAKernelMeta,
    Stacks,
    WeightLayout,
    embed_lora,
    head_lora,
    layer_kernels,
    platform_for,
)

from .batch import ForwardBatch
from .blocks import BlockStep, TransformerBlock
from .config import LlamaConfig, RopeScaling
from .families import UnsupportedModelError
from .kv_cache import KVCache, plan_attention, slot_index
from .norm import RMSNorm
from .projection import LoRALinear, pack_linears
from .rope import rope_factors, rope_table
from .shard_plan import ShardGroup, ShardPlan


class Llama(nn.Module):
    """A Llama causal LM whose every projection is a :class:`LoRALinear` fed by the slot pool's stacks.

    Lifetime: ``Llama(config)`` under ``torch.device("meta")`` -> weights loaded (``to_empty`` + copies, or
    :func:`runtime.model.checkpoint.load_checkpoint`) -> :meth:`setup_caches` -> optionally :meth:`attach_lora` ->
    :meth:`forward` once per step.
    """

    def __init__(self, config: LlamaConfig, plan: ShardPlan | None = None) -> None:
        super().__init__()
        self.config = config
        self.plan = plan = plan or ShardPlan()
        """Megatron's split over N shards and how they run (:func:`.shard_plan.shard_plan`, chosen once): held side by
        side in the tensors (one SPMD program over N devices), or this process's shard alone (one process per
        shard, the plan's ``group``)."""
        plan.tensor_parallel.check(config.to_spec())
        vocab = plan.vocab_rows(config.vocab_size)  # the rows held here
        self.tok_embeddings = nn.Embedding(vocab, config.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(config, plan) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output = None if config.tie_word_embeddings else LoRALinear(config.hidden_size, (vocab,))
        self.cpu_ops = True
        """Eager steps run the device's compiled decode glue where it has one (the CPU library's C++ ops; False: the
        torch forms only)."""
        self.deterministic = False
        """Every op's result for a token depends on that token's inputs alone (the engine's deterministic mode): base
        matmuls in one fixed order on plain weights, norms per row, and attention per token over its own cached keys,
        prefill too (the CPU library's ops, or their torch forms a token at a time). Set before :meth:`setup_caches`."""
        self.kernels: LayerKernels | None = None
        """The device's base matmuls and decode glue (:func:`kernels.layer_kernels`), set by :meth:`setup_caches`."""
        self.rope_table: torch.Tensor | None
        self.register_buffer("rope_table", None, persistent=False)  # [P, 2, D/2], made by setup_caches
        self.local_rope_table: torch.Tensor | None
        self.register_buffer("local_rope_table", None, persistent=False)  # the config's local_layers' (Gemma 3)
        self.dense_tables: torch.Tensor | None
        self.register_buffer("dense_tables", None, persistent=False)  # [max_batch + 1, MB], made by setup_caches
        self.max_batch = 0
        """The sequences of the dense tables (set by :meth:`setup_caches`); their row ``max_batch`` is the spare."""
        self.layout_choice = None  # how pack_weights chose the weights' layout (kernels.choose_weight_layout)
        self.vocab_lora: dict[str, Stacks] = {}
        """The vocabulary modules' rows (embed_tokens, lm_head) where the pool has them (:meth:`attach_lora`)."""

    @property
    def tensor_parallel(self) -> TensorParallel:
        """The plan's N-way split (:attr:`plan`)."""
        return self.plan.tensor_parallel

    @property
    def shard_group(self) -> ShardGroup | None:
        """One process per shard: this process's place in the group (:attr:`plan`); None otherwise."""
        return self.plan.group

    @property
    def embed_scale(self) -> float | None:
        """The embedding's factor where the family scales it (Gemma: √hidden, rounded to the dtype as HF does)."""
        if not self.config.scale_embeddings:
            return None
        return float(torch.tensor(self.config.hidden_size**0.5, dtype=self.dtype))

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    @property
    def max_seq_len(self) -> int:
        return 0 if self.rope_table is None else self.rope_table.shape[0]

    @property
    def kv_caches(self) -> list[KVCache]:
        """Every layer's KV cache (after :meth:`setup_caches`)."""
        caches = [layer.attention.kv_cache for layer in self.layers]
        assert all(cache is not None for cache in caches), "setup_caches() first"
        return caches

    @property
    def spare_block(self) -> int:
        """The caches' last block: padding tokens write it and padded tables name it; no sequence owns it."""
        return self.kv_caches[0].num_blocks - 1

    @property
    def block_size(self) -> int:
        return self.kv_caches[0].block_size

    def setup_caches(
        self, max_batch: int, max_seq_len: int, num_blocks: int | None = None, block_size: int = 16
    ) -> None:
        """Allocate every layer's KV cache, ``num_blocks`` blocks of ``block_size`` positions plus one spare block
        (:attr:`spare_block`: padding tokens write it, padded tables name it), and the RoPE table of ``max_seq_len``.

        ``num_blocks`` None: ``max_batch · MB`` (MB = ⌈max_seq_len / block_size⌉: every sequence at its longest).
        When the blocks cover that, batches without block tables use the dense ones (:attr:`dense_tables`: row r <
        ``max_batch`` owns blocks ``r·MB .. r·MB + MB - 1``, row ``max_batch`` only the spare block). Calling it again
        replaces the caches (their contents are lost).
        """
        if self.device == torch.device("meta"):
            raise ValueError("the model is still on the meta device: load its weights before setup_caches()")
        if max_seq_len <= 0 or max_batch <= 0 or block_size <= 0:
            raise ValueError(
                f"max_batch ({max_batch}), max_seq_len ({max_seq_len}) and block_size ({block_size}) must be positive"
            )
        window = self.config.sliding_window
        if window is not None and max_seq_len > window:
            raise UnsupportedModelError(
                self.config.model_type,
                "sliding_window",
                f"{window} is shorter than max_seq_len {max_seq_len}: the sliding-window attention past it is not "
                f"computed here; serve with max_seq_len <= {window}",
            )
        config, width = self.config, -(-max_seq_len // block_size)
        num_blocks = max_batch * width if num_blocks is None else num_blocks
        if num_blocks <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) must be positive")
        for layer in self.layers:
            heads = layer.attention.num_kv_heads  # S·KV_s over S shards
            layer.attention.kv_cache = KVCache(
                num_blocks + 1, block_size, heads, config.head_dim, self.dtype, self.device, layer.attention.shards
            )
            layer.attention.kv_cache.softcap = config.attn_logit_softcapping
        self.max_batch = max_batch
        self.dense_tables = None
        if num_blocks >= max_batch * width:
            dense = torch.full((max_batch + 1, width), num_blocks, dtype=torch.long)
            dense[:max_batch] = torch.arange(max_batch * width).view(max_batch, width)
            self.dense_tables = dense.to(self.device)
        self.rope_table = rope_table(config, max_seq_len, self.device)
        if config.local_layers and config.local_rope_theta is not None:
            local = replace(config, rope_theta=config.local_rope_theta, rope_scaling=RopeScaling())
            self.local_rope_table = rope_table(local, max_seq_len, self.device)
        if self.deterministic and self.packed:
            raise ValueError("the deterministic mode reads plain weights: unpack_weights() first")
        if self.deterministic and config.attn_logit_softcapping is not None:
            raise UnsupportedModelError(
                config.model_type, "attn_logit_softcapping", "the deterministic mode's attention has no soft-cap"
            )
        self.kernels = layer_kernels(self.device, self.deterministic)
        self.kernels.decode_ops(self.rope_table, self.cpu_ops)  # builds the CPU library now (first use), not in a step

    @property
    def packed(self) -> bool:
        """Whether the projections' base weights are held packed or int8 (see :meth:`pack_weights`)."""
        return any(module.packed for module in self.modules() if isinstance(module, LoRALinear))

    @property
    def weight_layout(self) -> str:  # the first projection's: plain, blocked, onednn or int8
        return next((m.layout.value for m in self.modules() if isinstance(m, LoRALinear)), "plain")

    def pack_weights(self, layout: WeightLayout | None = None) -> bool:
        """Pack every projection's (and an untied lm_head's) base weight (:func:`kernels.pack_weight`) in ``layout``,
        in place of the plain one, where it applies (CPU, fp32 / supported bf16); returns whether any was packed.
        ``layout`` None: the one :func:`kernels.choose_weight_layout` measures fastest on this machine for these
        shapes (cached; kept in :attr:`layout_choice`). A no-op on CUDA and XLA. Call after loading;
        :meth:`unpack_weights` undoes it."""
        packed, choice = pack_linears([m for m in self.modules() if isinstance(m, LoRALinear)], layout)
        self.layout_choice = choice or self.layout_choice
        return packed

    def unpack_weights(self) -> None:
        """Plain weights again (same values)."""
        for module in (m for m in self.modules() if isinstance(m, LoRALinear)):
            module.unpack()

    def set_deterministic(self, on: bool) -> None:
        """The :attr:`deterministic` mode on or off, before :meth:`setup_caches`. On: packed weights are unpacked (the
        same values); refused for int8 weights and a model sharded over devices."""
        if on and (self.weight_layout == WeightLayout.INT8.value or self.tensor_parallel.size > 1):
            raise ValueError(
                "the deterministic mode serves one device's model in its dtype: got weights "
                f"{self.weight_layout}, tensor_parallel_size {self.tensor_parallel.size}"
            )
        if on and self.packed:
            self.unpack_weights()
        self.deterministic = on

    def attach_lora(self, stacks: Mapping[ModuleKey, Stacks]) -> None:
        """Route every module's LoRA through the slot pool's rows (by reference: later slot loads are seen).

        Modules missing from ``stacks`` stay base-only. Shape: stacks[key].a [N, in], .bt [N, out]; over S
        tensor-parallel sections [N, S, in_s], [N, S, out_s] (one process per shard takes its own section's).
        """
        for key, module_stacks in stacks.items():
            if key.is_vocab:
                if self.tensor_parallel.size > 1:
                    raise ValueError(f"{key.module_name} LoRA on a model sharded {self.tensor_parallel.size} ways")
                self.vocab_lora[key.proj] = module_stacks
                continue
            linear, part = self.lora_target(key)
            linear.attach(part, self.plan.own_rows(module_stacks))

    def detach_lora(self) -> None:
        """Back to exactly the base model."""
        self.vocab_lora = {}
        for module in self.modules():
            if isinstance(module, LoRALinear):
                module.detach()

    def lora_target(self, key: ModuleKey) -> tuple[LoRALinear, int]:
        if not 0 <= key.layer < len(self.layers):
            raise ValueError(f"{key} names layer {key.layer}; the model has {len(self.layers)} layers")
        block = self.layers[key.layer]
        targets = {
            "q_proj": (block.attention.wqkv, 0),
            "k_proj": (block.attention.wqkv, 1),
            "v_proj": (block.attention.wqkv, 2),
            "o_proj": (block.attention.wo, 0),
            "gate_proj": (block.feed_forward.w13, 0),
            "up_proj": (block.feed_forward.w13, 1),
            "down_proj": (block.feed_forward.w2, 0),
        }
        if key.proj not in targets:
            raise ValueError(f"unknown projection {key.proj!r}; expected one of {sorted(targets)}")
        return targets[key.proj]

    def base_weight(self, key: ModuleKey) -> torch.Tensor:
        """Module ``key``'s base weight as served (:meth:`LoRALinear.plain_weight`): Shape: [out, in], on the model's
        device; on XLA a host copy (the whole fused weight moves, then the part is sliced on the host). The weights
        there are views of device data, so the transfer compiles once per weight shape: `Engine.warm_up` does it."""
        if key.is_vocab:  # [V, H]: the table, or the head's weight (the table when tied)
            table = self.tok_embeddings.weight.detach()
            weight = self.output.plain_weight() if key.proj == "lm_head" and self.output is not None else table
            return platform_for(weight.device).to_host(weight)
        linear, part = self.lora_target(key)
        weight = platform_for(linear.plain_weight().device).to_host(linear.plain_weight())
        start = sum(linear.out_features[:part])
        return weight[start : start + linear.out_features[part]]

    def forward(self, batch: ForwardBatch, lora_meta: LoRAKernelMeta | None = None) -> torch.Tensor:
        """One step: embed, run every block (writing the KV cache), and return the requested tokens' logits.

        Semantics::

            h = embed(tokens); for each block: h = block(h)     # LoRA per token through lora_meta's slots
            logits = lm_head(norm(h[logits_index]))             # all tokens when logits_index is None
            (with the pool's vocabulary rows attached, :attr:`vocab_lora`: the embedding's LoRA added to h after the
            lookup and the head's to the logits, per token's adapter: :func:`kernels.embed_lora`, `head_lora`)

        Shape: batch of T tokens; returns [N, vocab] in the model dtype (N = len(logits_index), or T).
        ``lora_meta`` must have been prepared for this step's T tokens; None (or a step with no adapter token, or
        no stacks attached) runs exactly the base model. Every block runs the device's decode glue
        (:class:`kernels.DecodeOps`): norms with the residual adds and SwiGLU's activation, and on decode-only steps
        where it is compiled (CPU, :attr:`cpu_ops`) RoPE, the cache write and attention in one call (same semantics,
        fp32 accumulation), on every step in the :attr:`deterministic` mode; the torch forms elsewhere.
        """
        tables = self._check_step(batch, lora_meta)
        step = self._block_step(batch, lora_meta, tables)  # the step's kind, decided once
        h = self._embed(batch.tokens, step)  # [T, H]
        local = self._local_step(step, batch.positions)
        for index, layer in enumerate(self.layers):
            h = layer(h, local if index in self.config.local_layers else step)
        return self._logits(h, step)

    def _check_step(self, batch: ForwardBatch, lora_meta: LoRAKernelMeta | None) -> torch.Tensor:
        """The step's block tables, once the batch fits the caches and the metadata was prepared for it."""
        if self.rope_table is None:
            raise ValueError("setup_caches(max_batch, max_seq_len) first")
        if batch.spans is not None and max(span.end_pos for span in batch.spans) > self.max_seq_len:
            raise ValueError(
                f"a sequence reaches position {max(span.end_pos for span in batch.spans)}, beyond the cache's "
                f"max_seq_len {self.max_seq_len}"
            )
        if lora_meta is not None and lora_meta.num_tokens != batch.num_tokens:
            raise ValueError(
                f"lora_meta was prepared for {lora_meta.num_tokens} tokens, the batch has {batch.num_tokens}"
            )
        if self.deterministic and batch.spans is None:
            raise ValueError("the deterministic mode runs eager batches (with spans), not traced ones")
        tables = batch.block_tables if batch.block_tables is not None else self.dense_tables
        if tables is None:
            raise ValueError("the caches are paged (fewer blocks than the dense tables need): pass block_tables")
        return tables

    def _block_step(self, batch: ForwardBatch, lora_meta: LoRAKernelMeta | None, tables: torch.Tensor) -> BlockStep:
        """What every block of the step shares, in one of three kinds: RoPE, the cache write and attention in one
        compiled call per layer (a decode-only step on the compiled glue, or the deterministic mode); the eager
        batched attention over a plan of the step's spans; a traced step (no spans), every token over its whole
        row."""
        assert self.kernels is not None and self.rope_table is not None
        ops = self.kernels.decode_ops(self.tok_embeddings.weight, self.cpu_ops and batch.spans is not None)
        linear = LinearStep.make(lora_meta, self.kernels, ops.compiled)
        compiled_attention = ops.compiled and self.config.attn_logit_softcapping is None  # its op has no soft-cap
        if self.deterministic or (compiled_attention and all(span.count == 1 for span in batch.spans)):
            return BlockStep(batch, linear, tables, None, None, None, self.rope_table, ops)
        rope = rope_factors(self.rope_table[batch.positions], self.dtype)  # cos, sin [T, 1, D/2]
        block_size = self.block_size
        plan = None if batch.spans is None else plan_attention(batch.spans, tables, block_size, self.device)
        slots = slot_index(tables, batch.cache_rows, batch.positions, block_size)
        return BlockStep(batch, linear, tables, slots, rope, plan, None, ops)

    def _vocab(self, step: BlockStep, proj: str) -> Stacks | None:
        """The pool's rows of a vocabulary module where attached and the step has LoRA metadata."""
        return None if step.linear.meta is None else self.vocab_lora.get(proj)

    def _logits(self, h: torch.Tensor, step: BlockStep) -> torch.Tensor:
        """The requested tokens' logits, whole: the final norm, the head (the embeddings where tied) with its LoRA,
        the soft-cap. Shape: h [T, H]; returns [N, vocab]."""
        assert self.kernels is not None
        batch, ops = step.batch, step.ops
        if batch.logits_index is not None:
            h = h[batch.logits_index]  # [N, H]
        h = ops.add_rms_norm(h, None, self.norm.weight, self.norm.eps)
        if self.output is None:
            table = self.tok_embeddings.weight
            embeddings = LinearWeight(WeightLayout.PLAIN, table, table.shape[0])
            logits = self.kernels.linear(h, embeddings, fast=ops.compiled, reorder=False)  # [N, vocab]
        else:
            logits = self.output.output(h, LinearStep.make(None, self.kernels, ops.compiled))  # [N, vocab]
        head = self._vocab(step, "lm_head")
        if head is not None:
            logits = head_lora(logits, h, head, step.linear.meta, batch.logits_index, self.deterministic)
        if self.config.final_logit_softcapping is not None:
            cap = self.config.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return self.plan.whole_logits(logits)

    def _local_step(self, step: BlockStep, positions: torch.Tensor) -> BlockStep:
        """The step as the local layers see it: their own RoPE table (Gemma 3's sliding layers); ``step`` where the
        model has none."""
        table = self.local_rope_table
        if table is None:
            return step
        rope = None if step.rope is None else rope_factors(table[positions], self.dtype)
        return step._replace(rope=rope, rope_table=None if step.rope_table is None else table)

    def _embed(self, tokens: torch.Tensor, step: BlockStep) -> torch.Tensor:
        """The lookup (:meth:`.shard_plan.ShardPlan.embed`), the embedding's LoRA, the family's scale. Shape: tokens
        [T]; returns [T, H]."""
        h = self.plan.embed(self.tok_embeddings, tokens)
        stacks = self._vocab(step, "embed_tokens")
        if stacks is not None:
            h = embed_lora(h, tokens, stacks, step.linear.meta, self.deterministic)
        return h if self.embed_scale is None else h * self.embed_scale
