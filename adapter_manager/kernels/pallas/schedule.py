"""Which blocks each Pallas grid step fetches: pairs without work re-point at the blocks fetched last.

Pallas TPU pipelining copies an input block only when its block index differs from the previous grid step's. The
work table (scalar-prefetched) says which (token block i, lane block j) pairs have a token of a compact slot whose
lanes meet the lane block; for a pair without work the index maps return the indices already fetched, so the pair
does no matmul and no DMA: weight traffic follows the active blocks, not the grid.

Shrink grid (i, j, k), k the input-feature sweep inside a pair: a pair without work repeats the x and A blocks of
the latest pair with work at its last k (or, before any, those of the first pair with work at k = 0).
Expand grid (i, n, j), j the lane sweep inside an output block: inside a token block with work, a lane block without
work repeats the row's latest lane block with work (or its next one); a token block with no work at all repeats
the blocks of the latest pair with work at the last n (or the first pair with work at n = 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Schedule:
    """Per (i, j) pair, flattened i·nL + j; all int32, scalar-prefetched in this order."""

    work: jax.Array
    """Shape: [nT·nL]: 1 where the pair has work."""
    row: jax.Array
    """Shape: [nT·nL]: the token block to fetch."""
    lane: jax.Array
    """Shape: [nT·nL]: the lane block to fetch."""
    fixed: jax.Array
    """Shape: [nT·nL]: the index of the swept axis to fetch (shrink: k, expand: n), or -1 for the grid's own."""

    def operands(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        return self.work, self.row, self.lane, self.fixed


def work_table(slots: jax.Array, token_block: int, lane_block: int, padded_rank: int, lane_blocks: int) -> jax.Array:
    """Shape: [nT·nL] int32: 1 where token block i has a token whose compact slot's lanes meet lane block j.
    ``slots``: Shape: [nT·bt] int32 compact ids, -1 = none."""
    blocks = slots.reshape(-1, token_block, 1)  # [nT, bt, 1]
    first = (blocks * padded_rank) // lane_block
    last = ((blocks + 1) * padded_rank - 1) // lane_block
    lane_ids = jnp.arange(lane_blocks, dtype=jnp.int32)[None, None, :]
    hit = (blocks >= 0) & (first <= lane_ids) & (lane_ids <= last)
    return jnp.any(hit, axis=1).astype(jnp.int32).reshape(-1)


def _source(work: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Along the last axis of 0/1 ``work``: (src, has_prev): src is the position itself where work, else the latest
    position with work before it, else the first after it (0 when there is none); has_prev says "latest"."""
    size = work.shape[-1]
    pos = jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), work.shape)
    last = jax.lax.cummax(jnp.where(work > 0, pos, -1), axis=work.ndim - 1)
    after = jax.lax.cummin(jnp.where(work > 0, pos, size), axis=work.ndim - 1, reverse=True)
    src = jnp.where(last >= 0, last, jnp.where(after < size, after, 0))
    return src.astype(jnp.int32), last >= 0


def shrink_schedule(work: jax.Array, lane_blocks: int, feature_blocks: int) -> Schedule:
    src, has_prev = _source(work)
    fixed = jnp.where(work > 0, -1, jnp.where(has_prev, feature_blocks - 1, 0)).astype(jnp.int32)
    return Schedule(work, src // lane_blocks, src % lane_blocks, fixed)


def expand_schedule(work: jax.Array, lane_blocks: int, out_blocks: int) -> Schedule:
    grid_work = work.reshape(-1, lane_blocks)  # [nT, nL]
    row_has_work = jnp.any(grid_work > 0, axis=1, keepdims=True)
    in_row, _ = _source(grid_work)
    src, has_prev = _source(work)
    src, has_prev = src.reshape(grid_work.shape), has_prev.reshape(grid_work.shape)
    rows = jnp.arange(grid_work.shape[0], dtype=jnp.int32)[:, None]
    row = jnp.where(row_has_work, rows, src // lane_blocks)
    lane = jnp.where(row_has_work, in_row, src % lane_blocks)
    fixed = jnp.where(row_has_work, -1, jnp.where(has_prev, out_blocks - 1, 0))
    return Schedule(work, row.reshape(-1), lane.reshape(-1), fixed.reshape(-1).astype(jnp.int32))


def _pick(fixed, free):
    return jnp.where(fixed < 0, free, fixed)


def shrink_x_map(i, j, k, work, row, lane, fixed, *, lane_blocks: int):
    p = i * lane_blocks + j
    return row[p], _pick(fixed[p], k)


def shrink_a_map(i, j, k, work, row, lane, fixed, *, lane_blocks: int):
    p = i * lane_blocks + j
    return lane[p], _pick(fixed[p], k)


def expand_h_map(i, n, j, work, row, lane, fixed, *, lane_blocks: int):
    p = i * lane_blocks + j
    return row[p], lane[p]


def expand_b_map(i, n, j, work, row, lane, fixed, *, lane_blocks: int):
    p = i * lane_blocks + j
    return lane[p], _pick(fixed[p], n)


@dataclass(frozen=True)
class FetchCount:
    """What one call does, counted by replaying its grid through the weight block's index map."""

    pairs: int
    """nT·nL (token block, lane block) pairs."""
    work_pairs: int
    """Pairs with work (a matmul)."""
    grid_steps: int
    """Grid steps, each of which would fetch a weight block without the redirection."""
    weight_fetches: int
    """Weight-block DMAs: steps whose weight block index differs from the previous step's."""


def count_fetches(schedule: Schedule, grid: tuple[int, int, int], weight_map: Callable, lane_blocks: int) -> FetchCount:
    """Replay ``grid`` in order through ``weight_map`` (shrink_a_map or expand_b_map) and count the block changes."""
    tables = [jax.device_get(t) for t in schedule.operands()]
    fetches, previous = 0, None
    for a in range(grid[0]):
        for b in range(grid[1]):
            for c in range(grid[2]):
                index = tuple(int(v) for v in weight_map(a, b, c, *tables, lane_blocks=lane_blocks))
                fetches += index != previous
                previous = index
    work = int(jnp.sum(schedule.work))
    return FetchCount(int(schedule.work.shape[0]), work, grid[0] * grid[1] * grid[2], fetches)
