"""Pallas TPU shrink and expand kernels (JAX), laned: slot s owns lanes [s·R', (s+1)·R') of the S·R' lane axis.

On torch_xla the torch side gathers the compact active table (:mod:`kernels.active_table`) from the row pools and
passes it as the stack, with the compact ids as the token slots: S here is the active bucket A, never the pool size.

Layout (R' = the rank padded so a slot never straddles a lane block: a divisor of the lane width L, or a multiple
of it). Small-rank slots share one lane block: with L = 128 and R' = 16, lane block j holds slots 8j … 8j+7.
The work table, scalar-prefetched into SMEM, says for each (token block, lane block) whether any token of the
block belongs to a slot of the lane block; pairs without work do no matmul and, through the fetch schedule
(:mod:`kernels.pallas.schedule`), no weight DMA. A batch whose tokens all use one slot therefore touches one lane
block per token block: the single-slot fast path. Tokens with slot -1 match no lane and get exactly zero.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from adapter_manager.kernels.config import PallasInterpret
from adapter_manager.kernels.pallas.block_sizes import BlockSizes
from adapter_manager.kernels.pallas.schedule import (
    FetchCount,
    count_fetches,
    expand_b_map,
    expand_h_map,
    expand_schedule,
    shrink_a_map,
    shrink_schedule,
    shrink_x_map,
    work_table,
)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class _Tiling:
    """Static tiling of one call: padded extents and effective block sizes."""

    rank: int
    padded_rank: int
    lanes: int
    lane_block: int
    tokens: int
    token_block: int

    @property
    def lane_blocks(self) -> int:
        return self.lanes // self.lane_block

    def work(self, slots: jax.Array) -> jax.Array:
        return work_table(slots, self.token_block, self.lane_block, self.padded_rank, self.lane_blocks)

    @classmethod
    def make(cls, num_tokens: int, num_slots: int, rank: int, blocks: BlockSizes) -> _Tiling:
        width = blocks.lane_width
        if rank >= width:
            padded_rank = _round_up(rank, width)
        else:
            padded_rank = next(d for d in (8, 16, 32, 64, 128, 256) if d >= rank and width % d == 0)
        lane_count = num_slots * padded_rank
        lane_block = lane_count if lane_count <= width else width
        token_block = num_tokens if num_tokens <= blocks.block_tokens else blocks.block_tokens
        return cls(
            rank=rank,
            padded_rank=padded_rank,
            lanes=_round_up(lane_count, lane_block),
            lane_block=lane_block,
            tokens=_round_up(num_tokens, token_block),
            token_block=token_block,
        )


def _feature_tile(features: int, block: int) -> tuple[int, int]:
    """(tile, padded extent): the whole axis when it fits one block (always a legal block), else block-sized."""
    return (features, features) if features <= block else (block, _round_up(features, block))


def _lane_stack(stack: jax.Array, tiling: _Tiling, features: int) -> jax.Array:
    """[S, R, F] -> [lanes, F]: ranks zero-padded to R', slots flattened onto lanes, lanes padded to blocks."""
    num_slots = stack.shape[0]
    stack = jnp.pad(stack, ((0, 0), (0, tiling.padded_rank - tiling.rank), (0, features - stack.shape[2])))
    flat = stack.reshape(num_slots * tiling.padded_rank, features)
    return jnp.pad(flat, ((0, tiling.lanes - flat.shape[0]), (0, 0)))


def _lane_mask(slots_ref, lane_block_index, tiling: _Tiling) -> jax.Array:
    lane = lane_block_index * tiling.lane_block + jax.lax.broadcasted_iota(jnp.int32, (1, tiling.lane_block), 1)
    return slots_ref[...] == lane // tiling.padded_rank  # [bt, 1] vs [1, L] -> [bt, L]


def _shrink_kernel(work_ref, _row, _lane, _fixed, slots_ref, x_ref, a_ref, h_ref, acc_ref, *, tiling: _Tiling):
    i, j, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    has_work = work_ref[i * pl.num_programs(1) + j] > 0

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(has_work)
    def _accumulate():
        acc_ref[...] += jax.lax.dot_general(
            x_ref[...], a_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )

    @pl.when(k == pl.num_programs(2) - 1)
    def _finish():
        h_ref[...] = jnp.where(_lane_mask(slots_ref, j, tiling), acc_ref[...], 0.0).astype(h_ref.dtype)


def _expand_kernel(work_ref, _row, _lane, _fixed, slots_ref, h_ref, b_ref, y_ref, out_ref, acc_ref, *, tiling: _Tiling):
    i, j = pl.program_id(0), pl.program_id(2)
    has_work = work_ref[i * pl.num_programs(2) + j] > 0

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = y_ref[...].astype(jnp.float32)

    @pl.when(has_work)
    def _accumulate():
        h = jnp.where(_lane_mask(slots_ref, j, tiling), h_ref[...], jnp.zeros((), h_ref.dtype))
        acc_ref[...] += jnp.dot(h, b_ref[...], preferred_element_type=jnp.float32)

    @pl.when(j == pl.num_programs(2) - 1)
    def _finish():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _interpret_arg(interpret: PallasInterpret) -> pltpu.InterpretParams | bool:
    if interpret is PallasInterpret.TPU:
        return pltpu.InterpretParams()
    return interpret is PallasInterpret.HLO


def _padded_slots(token_slots: jax.Array, tiling: _Tiling) -> jax.Array:
    slots = jnp.pad(token_slots.astype(jnp.int32), (0, tiling.tokens - token_slots.shape[0]), constant_values=-1)
    return slots


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def lora_shrink(
    x: jax.Array, a_stack: jax.Array, token_slots: jax.Array, *, blocks: BlockSizes, interpret: PallasInterpret
) -> jax.Array:
    """Laned shrink.

    Semantics::

        h[t, s·R + r] = x[t] @ a_stack[s, r]   if s == slot[t] (slot[t] >= 0)
        h[t, l]       = 0                      otherwise

    Shape: x [T, in], a_stack [S, R, in], token_slots [T] int32 -> h [T, S·R], new array. From
    :class:`kernels.pallas.backend.PallasBackend`: a_stack is the compact table [A, R, in] (S = A), token_slots the
    compact ids.
    """
    num_tokens, in_features = x.shape
    num_slots, rank, _ = a_stack.shape
    tiling = _Tiling.make(num_tokens, num_slots, rank, blocks)
    block_in, in_padded = _feature_tile(in_features, blocks.block_features)
    slots = _padded_slots(token_slots, tiling)
    xp = jnp.pad(x, ((0, tiling.tokens - num_tokens), (0, in_padded - in_features)))
    lanes = _lane_stack(a_stack, tiling, in_padded)
    grid = (tiling.tokens // tiling.token_block, tiling.lane_blocks, in_padded // block_in)
    bt, lb, nl = tiling.token_block, tiling.lane_block, tiling.lane_blocks
    schedule = shrink_schedule(tiling.work(slots), nl, grid[2])
    h = pl.pallas_call(
        functools.partial(_shrink_kernel, tiling=tiling),
        out_shape=jax.ShapeDtypeStruct((tiling.tokens, tiling.lanes), x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=grid,
            in_specs=[
                pl.BlockSpec((bt, 1), lambda i, j, k, *_: (i, 0)),
                pl.BlockSpec((bt, block_in), functools.partial(shrink_x_map, lane_blocks=nl)),
                pl.BlockSpec((lb, block_in), functools.partial(shrink_a_map, lane_blocks=nl)),
            ],
            out_specs=pl.BlockSpec((bt, lb), lambda i, j, k, *_: (i, j)),
            scratch_shapes=[pltpu.VMEM((bt, lb), jnp.float32)],
        ),
        interpret=_interpret_arg(interpret),
    )(*schedule.operands(), slots[:, None], xp, lanes)
    h = h[:num_tokens, : num_slots * tiling.padded_rank]
    return h.reshape(num_tokens, num_slots, tiling.padded_rank)[:, :, :rank].reshape(num_tokens, num_slots * rank)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def lora_expand(
    y: jax.Array,
    h: jax.Array,
    bt_stack: jax.Array,
    token_slots: jax.Array,
    *,
    blocks: BlockSizes,
    interpret: PallasInterpret,
) -> jax.Array:
    """Laned expand on pre-transposed B.

    Semantics::

        y_new[t] = y[t] + sum over lanes l of slot[t]: h[t, l] * bt_lanes[l]   (slot[t] >= 0)
        y_new[t] = y[t]                                                       (slot[t] == -1)

    Shape: y [T, out], h [T, S·R], bt_stack [S, R, out], token_slots [T] int32 -> y_new [T, out], new array
    (on TPU the padded y buffer is aliased to the output). From :class:`kernels.pallas.backend.PallasBackend`:
    bt_stack is the compact table [A, R, out] (S = A), token_slots the compact ids.
    """
    num_tokens, out_features = y.shape
    num_slots, rank, _ = bt_stack.shape
    tiling = _Tiling.make(num_tokens, num_slots, rank, blocks)
    block_out, out_padded = _feature_tile(out_features, blocks.block_features)
    slots = _padded_slots(token_slots, tiling)
    hp = jnp.pad(h.reshape(num_tokens, num_slots, rank), ((0, 0), (0, 0), (0, tiling.padded_rank - rank)))
    hp = hp.reshape(num_tokens, num_slots * tiling.padded_rank)
    hp = jnp.pad(hp, ((0, tiling.tokens - num_tokens), (0, tiling.lanes - hp.shape[1])))
    yp = jnp.pad(y, ((0, tiling.tokens - num_tokens), (0, out_padded - out_features)))
    lanes = _lane_stack(bt_stack, tiling, out_padded)
    grid = (tiling.tokens // tiling.token_block, out_padded // block_out, tiling.lane_blocks)
    bt, lb, nl = tiling.token_block, tiling.lane_block, tiling.lane_blocks
    schedule = expand_schedule(tiling.work(slots), nl, grid[1])
    out = pl.pallas_call(
        functools.partial(_expand_kernel, tiling=tiling),
        out_shape=jax.ShapeDtypeStruct((tiling.tokens, out_padded), y.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=grid,
            in_specs=[
                pl.BlockSpec((bt, 1), lambda i, n, j, *_: (i, 0)),
                pl.BlockSpec((bt, lb), functools.partial(expand_h_map, lane_blocks=nl)),
                pl.BlockSpec((lb, block_out), functools.partial(expand_b_map, lane_blocks=nl)),
                pl.BlockSpec((bt, block_out), lambda i, n, j, *_: (i, n)),
            ],
            out_specs=pl.BlockSpec((bt, block_out), lambda i, n, j, *_: (i, n)),
            scratch_shapes=[pltpu.VMEM((bt, block_out), jnp.float32)],
        ),
        input_output_aliases={7: 0},
        interpret=_interpret_arg(interpret),
    )(*schedule.operands(), slots[:, None], hp, lanes, yp)
    return out[:num_tokens, :out_features]


def weight_fetches(
    op: str, token_slots: jax.Array, num_slots: int, rank: int, features: int, blocks: BlockSizes
) -> FetchCount:
    """Replay one ``op`` ("shrink" or "expand") call's grid on the host: its pairs, pairs with work, and weight-block
    DMAs (``features``: shrink's input or expand's output features). Shape: token_slots [T] int32."""
    if op not in ("shrink", "expand"):
        raise ValueError(f"op must be 'shrink' or 'expand', got {op!r}")
    tiling = _Tiling.make(token_slots.shape[0], num_slots, rank, blocks)
    feature_blocks = _feature_tile(features, blocks.block_features)
    num_features = feature_blocks[1] // feature_blocks[0]
    work = tiling.work(_padded_slots(token_slots, tiling))
    nt, nl = tiling.tokens // tiling.token_block, tiling.lane_blocks
    if op == "shrink":
        return count_fetches(shrink_schedule(work, nl, num_features), (nt, nl, num_features), shrink_a_map, nl)
    return count_fetches(expand_schedule(work, nl, num_features), (nt, num_features, nl), expand_b_map, nl)
