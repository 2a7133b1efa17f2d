"""The decoder block of the batched Llama: GQA attention over the KV cache and a gated MLP, every projection a
:class:`LoRALinear`, and what every block of one forward shares (:class:`BlockStep`). The served families' terms
(:mod:`.families`) are the config's: projection biases, per-head q/k norms, a query scale, GeGLU, sandwich norms."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from adapter_manager.kernels import DecodeOps, LinearStep

from .batch import ForwardBatch
from .config import LlamaConfig
from .kv_cache import AttentionPlan, KVCache
from .norm import RMSNorm
from .projection import LoRALinear
from .rope import apply_rope
from .shard_plan import ShardPlan


class BlockStep(NamedTuple):
    """What every block of one eager forward shares."""

    batch: ForwardBatch
    linear: LinearStep
    """What every linear of the step shares: its executor, LoRA metadata and the device's base matmuls."""
    tables: torch.Tensor
    """[R, MB] the step's block tables (the batch's, or the model's dense ones)."""
    slots: torch.Tensor | None
    """[T] each token's place in the caches' flat positions (:func:`slot_index`); None when the decode op writes."""
    rope: tuple[torch.Tensor, torch.Tensor] | None
    """cos, sin [T, 1, D/2] for the torch attention; None on a step the CPU decode op attends."""
    plan: AttentionPlan | None
    """The batched attention plan (eager steps with spans); None: per-sequence calls, or the CPU decode op."""
    rope_table: torch.Tensor | None
    """The model's [P, 2, D/2] table, set when ``ops.decode_attention`` runs the step's attention (a decode-only
    step with the compiled glue)."""
    ops: DecodeOps
    """The device's decode glue (norms with the residual adds, SwiGLU's activation, and attention on a decode-only
    step where compiled): the C++ ops on CPU, the torch forms elsewhere."""


class Attention(nn.Module):
    """GQA self-attention: fused q/k/v base matmul, per-projection LoRA, RoPE, cached causal attention, o_proj.

    Over S tensor-parallel shards (one SPMD program) the fused q/k/v output is shard-major — shard s's q heads, then
    its KV heads' k and v — and the cache holds S·KV_s heads (KV heads replicated where KV < S); S = 1 is the plain
    q|k|v layout. One process per shard (the plan's ``group``): the layer holds its shard's heads only, and o's
    output (LoRA included) is summed over the shards.
    """

    def __init__(self, config: LlamaConfig, plan: ShardPlan) -> None:
        super().__init__()
        tp = plan.tensor_parallel
        self.group, self.head_dim = plan.group, config.head_dim
        self.shards = plan.local_shards  # the shards this process's tensors hold
        local_kv = tp.kv_heads(config.to_spec())
        self.num_heads = config.num_heads // tp.size * self.shards
        self.num_kv_heads = local_kv * self.shards  # the cache's heads (replicated where KV < S)
        q_width, kv_width = self.num_heads * config.head_dim, self.num_kv_heads * config.head_dim
        qkv_bias, o_bias = "q_proj" in config.bias, "o_proj" in config.bias
        widths, hidden = (q_width, kv_width, kv_width), config.hidden_size
        self.wqkv = LoRALinear(hidden, widths, plan=plan, bias=qkv_bias)
        self.wo = LoRALinear(q_width, (hidden,), plan=plan, row_parallel=True, bias=o_bias)
        self.kv_cache: KVCache | None = None
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        scalar = config.query_pre_attn_scalar
        self.q_scale = None if scalar is None or scalar == config.head_dim else (config.head_dim / scalar) ** 0.5
        """q's factor that turns the attention's 1/√D into ``query_pre_attn_scalar ** -0.5`` (Gemma 2)."""

    def _qk_terms(self, qkv: torch.Tensor, ops: DecodeOps) -> torch.Tensor:
        """The family's terms on q and k before RoPE, in place: each head's RMSNorm (Qwen3), q's scale (Gemma 2).
        Shape: qkv [T, (H + 2·KV)·D] (shard-major over S shards); returns it."""
        if self.q_norm is None and self.q_scale is None:
            return qkv
        q_heads, kv_heads = self.num_heads // self.shards, self.num_kv_heads // self.shards
        heads = qkv.view(qkv.shape[0], self.shards, q_heads + 2 * kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            for norm, part in ((self.q_norm, heads[:, :, :q_heads]), (self.k_norm, heads[:, :, q_heads:-kv_heads])):
                normed = ops.add_rms_norm(part.reshape(-1, self.head_dim), None, norm.weight, norm.eps)
                part.copy_(normed.view(part.shape))
        if self.q_scale is not None:
            heads[:, :, :q_heads].mul_(self.q_scale)
        return qkv

    def _output(self, out: torch.Tensor, step: BlockStep) -> torch.Tensor:
        y = self.wo.output(out, step.linear)
        return y if self.group is None else self.group.all_reduce(y)

    def forward(self, x: torch.Tensor, step: BlockStep) -> torch.Tensor:
        """Shape: x [T, H]; returns [T, H]. Writes the step's keys/values into the cache.

        ``step.rope_table`` set: RoPE, the cache write and attention in one ``step.ops.decode_attention`` call;
        otherwise ``step.rope`` (cos, sin [T, 1, D/2] each) and ``step.plan`` (the step's batched attention
        plan; None: a traced step, every token over its whole row).
        """
        assert self.kv_cache is not None, "setup_caches() first"
        batch = step.batch
        qkv = self._qk_terms(self.wqkv.output(x, step.linear), step.ops)  # [T, (H + 2·KV)·D]
        if step.rope_table is not None:
            cache = self.kv_cache
            out = step.ops.decode_attention(
                qkv,
                step.rope_table,
                cache.k,
                cache.v,
                step.tables,
                batch.cache_rows,
                batch.positions,
                self.num_heads,
                self.num_kv_heads,
            )  # [T, H·D]
            return self._output(out, step)
        assert step.rope is not None
        tokens, cos, sin, dim, shards = x.shape[0], step.rope[0], step.rope[1], self.head_dim, self.shards
        q_heads, kv_heads = self.num_heads // shards, self.num_kv_heads // shards  # one shard's
        heads = q_heads + kv_heads  # q|k side by side in each shard's output: one rotation for all
        qkv = qkv.view(tokens, shards, heads + kv_heads, dim)
        qk = apply_rope(qkv[:, :, :heads].reshape(tokens, shards * heads, dim), cos, sin)  # [T, S·(H_s + KV_s), D]
        qk = qk.view(tokens, shards, heads, dim)
        q = qk[:, :, :q_heads].reshape(tokens, self.num_heads, dim)  # views where S = 1
        k = qk[:, :, q_heads:].reshape(tokens, self.num_kv_heads, dim)
        v = qkv[:, :, heads:].reshape(tokens, self.num_kv_heads, dim)
        assert step.slots is not None
        self.kv_cache.update(step.slots, k, v)
        if step.plan is None:  # a traced step (no spans): every token over its whole row, masked
            out = self.kv_cache.attend_static(q, step.tables, batch.cache_rows, batch.positions)
        else:
            out = self.kv_cache.attend(q, step.plan, step.tables, k, v)  # [T, heads, D]
        return self._output(out.reshape(tokens, -1), step)


class FeedForward(nn.Module):
    """The gated MLP: ``down(act(gate(x)) · up(x))``, act SiLU (SwiGLU) or tanh-GELU (GeGLU), with gate/up fused
    into one base matmul (over S shards shard-major: shard s's gate and up columns side by side; one process per
    shard: its slice, down's output summed)."""

    def __init__(self, config: LlamaConfig, plan: ShardPlan) -> None:
        super().__init__()
        self.group, self.shards = plan.group, plan.local_shards
        self.act = config.hidden_act
        width = config.intermediate_size // plan.size * self.shards
        bias = "gate_proj" in config.bias
        self.w13 = LoRALinear(config.hidden_size, (width, width), plan=plan, bias=bias)
        hidden = config.hidden_size
        self.w2 = LoRALinear(width, (hidden,), plan=plan, row_parallel=True, bias=bias)

    def _gated(self, gate_up: torch.Tensor, ops: DecodeOps) -> torch.Tensor:
        return ops.silu_mul(gate_up) if self.act == "silu" else ops.gelu_tanh_mul(gate_up)

    def forward(self, x: torch.Tensor, step: BlockStep) -> torch.Tensor:
        """Shape: x [T, H]; returns [T, H]."""
        gate_up = self.w13.output(x, step.linear)  # [T, 2·I]
        if self.shards > 1:  # [T, S, 2·I_s]: each shard's gate|up (the shard axis kept, so each stays on its device)
            gated = self._gated(gate_up.view(x.shape[0], self.shards, -1), step.ops).flatten(1)  # [T, I]: shard-major
        else:
            gated = self._gated(gate_up, step.ops)
        y = self.w2.output(gated, step.linear)
        return y if self.group is None else self.group.all_reduce(y)


class TransformerBlock(nn.Module):
    """Pre-norm decoder block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``; with sandwich norms (Gemma 2)
    each branch's output is normed too: ``h = x + norm(attn(norm(x))); out = h + norm(mlp(norm(h)))``."""

    def __init__(self, config: LlamaConfig, plan: ShardPlan) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.attention_norm = RMSNorm(hidden, eps)
        self.attention = Attention(config, plan)
        self.ffn_norm = RMSNorm(hidden, eps)
        self.feed_forward = FeedForward(config, plan)
        self.attention_post_norm = RMSNorm(hidden, eps) if config.sandwich_norms else None
        self.ffn_post_norm = RMSNorm(hidden, eps) if config.sandwich_norms else None

    def forward(self, x: torch.Tensor, step: BlockStep) -> torch.Tensor:
        ops = step.ops  # the residual adds fused with the norms or done in place
        h = self.attention(ops.add_rms_norm(x, None, self.attention_norm.weight, self.attention_norm.eps), step)
        if self.attention_post_norm is not None:
            h = ops.add_rms_norm(h, None, self.attention_post_norm.weight, self.attention_post_norm.eps)
        out = self.feed_forward(ops.add_rms_norm(h, x, self.ffn_norm.weight, self.ffn_norm.eps), step)
        if self.ffn_post_norm is not None:
            out = ops.add_rms_norm(out, None, self.ffn_post_norm.weight, self.ffn_post_norm.eps)
        return out.add_(h)  # h: x + attention, written by add_rms_norm
